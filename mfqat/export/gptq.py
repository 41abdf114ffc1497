"""``export-mlx --gptq``: error-compensated codes for the derived affine matrices of an export.

GPTQ (Frantar et al., 2022) with each group's derived scale and bias kept: the grid MLX stores is the one
round-to-nearest derives from the anchor, and only the codes change (with ``grid_search``, a matrix may instead
take a grid clipped per group, :func:`searched_grid`, when GPTQ on it has the lower output error). Each quantized matrix's rounding
error is pushed onto the columns not yet quantized, weighted by the second moment of the matrix's input on
calibration text, so that ``||(W - Q) x||`` (the layer's output error) shrinks rather than ``||W - Q||``.
The inputs are the anchor's own (its model in its format, as mlx-lm's ``gptq`` takes the unquantized model's), so
every matrix is independent of the others; they are gathered one decoder layer at a time (mfqat.export.layerwise),
and each layer's matrices get their codes before the next layer runs, so one layer's input moments are held.

The result is the plain MLX affine layout (same bytes per weight, stock ``mlx_lm.load``), held whole in the
plan (``Plan.learned_scales[name]``: an MXTensor with the new codes); ``--refine`` after it learns the scales
and biases of those codes, and the export check compares what is written with PyTorch bit for bit as ever.
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from mfqat.anchor.checkpoint import Anchor
from mfqat.export.recipes import Plan
from mfqat.export.sensitivity import anchor_values
from mfqat.formats import get_format
from mfqat.models import layer_index
from mfqat.quant.derive import DERIVED_DTYPE, is_derived
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.reference import affine_dequantize_blocks


@dataclass
class GPTQConfig:
    """GPTQ on a plan's derived affine matrices, each group's derived scale ``s`` and bias ``b`` fixed (or searched).

    For a matrix ``W`` (rows x K) whose input ``x`` has the calibration second moment ``H = mean(x x^T)``
    (K x K), with ``U`` the upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, the columns are
    quantized one at a time (in order of decreasing ``diag H`` when ``act_order``), each on its own group's grid::

        q_j = clamp(round((w_j - b) / s), 0, 2^k - 1)      e_j = (w_j - (q_j * s + b)) / U_jj
        w_l -= e_j * U_jl      for every column l quantized after j

    which minimises ``sum over tokens ||(W - Q) x||^2`` column by column (Frantar et al., 2022). With a diagonal
    ``H`` nothing is pushed on, and the codes are round-to-nearest on the derived grid.

    ``grid_search``: before the sweep, each group's grid is chosen among the derived one and the ranges
    ``[p * min, p * max]`` of the group's weights for ``p`` in :data:`GRID_SHRINKS` (scale and bias rounded to the
    stored dtype), the one whose round-to-nearest error weighted by each input's mean square is lowest::

        argmin over grids of   sum_j H_jj * (w_j - (clamp(round((w_j - b) / s), 0, 2^k - 1) * s + b))^2

    (in the manner of GPTQ's ``--mse`` grid, with llama.cpp's importance weights): a clipped range gives the bulk of
    a group that straddles zero finer steps, and GPTQ then pays for the clipped outliers on the columns after them.
    Each matrix keeps the lowest output error of round-to-nearest, GPTQ on the derived grid and GPTQ on the searched
    one (:func:`best_codes`): the search weighs ``diag H`` only, so it is a proposal, never a loss.

    ``sequential``: each matrix's ``H`` is taken on the inputs the *quantized* model hands its layer (every earlier
    layer, and the embedding, with its export codes: GPTQ's own setting, so a layer's codes also answer the errors
    of the layers before it), not the anchor's (each matrix on its own).

    ``n_blocks`` x ``seq_len`` calibration tokens (256 x 128 by default: on SmolLM2-135M 32 x 128 fitted the
    calibration text's inputs and raised another text's perplexity, 256 x 128 lowered both; BENCHMARKS.md,
    "A size class down"; a text with fewer tokens gives what it has, with a warning); ``damp`` the relative
    dampening (raised tenfold, up to three times, if the Cholesky factorisation fails); ``block_columns``
    columns per lazy batch update (speed only: the same codes up to float32 rounding order).
    """

    n_blocks: int = 256
    seq_len: int = 128
    damp: float = 0.01
    act_order: bool = True
    block_columns: int = 128
    sequential: bool = False
    grid_search: bool = False

    def __post_init__(self) -> None:
        for name in ("n_blocks", "seq_len", "block_columns"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"gptq: {name} must be at least 1, got {getattr(self, name)}")
        if not self.damp > 0:
            raise ValueError(f"gptq: damp must be positive, got {self.damp}")


def _upper_inverse_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(h + damp * mean(diag h) * I)^-1`` (float64 in, float32 out; ``h`` is
    changed in place and restored); the dampening grows tenfold, up to three times, when ``h`` is too
    ill-conditioned to factor."""
    level = damp * float(torch.diagonal(h).mean())
    for _ in range(4):
        torch.diagonal(h).add_(level)
        low, info = torch.linalg.cholesky_ex(h)
        torch.diagonal(h).sub_(level)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(low), upper=True).float()
        level *= 10
    raise ValueError("gptq: the calibration inputs' second moment could not be factored even at 1000x dampening")


GRID_SHRINKS = tuple(round(1 - 0.025 * i, 3) for i in range(1, 13))  # 0.975 .. 0.7 of the group's range
GRID_CHUNK_ELEMENTS = 4 * 1024 ** 2  # rows searched at once: ~16 bytes of temporaries a weight


def searched_grid(w: torch.Tensor, importance: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
                  group: int, dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each group's (scale, bias) of matrix ``w`` (rows x K) among the given grid ``scales``, ``biases``
    (rows x K/group) and the shrunk ranges ``[p * min, p * max]`` (``p`` in :data:`GRID_SHRINKS`; scale and bias
    rounded to ``dtype``) with the lowest round-to-nearest squared error weighted by ``importance`` (K: each
    input's mean square, ``diag H``); ties keep the given grid. Float32 tensors of the grid's shape."""
    rows, k = w.shape
    step = max(1, GRID_CHUNK_ELEMENTS // k)
    if rows > step:  # a row's groups are independent: bounded temporaries (a few float32 copies of a chunk)
        parts = [searched_grid(w[lo:lo + step], importance, scales[lo:lo + step], biases[lo:lo + step], bits, group,
                               dtype) for lo in range(0, rows, step)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    blocks = w.float().reshape(rows, k // group, group)
    weight = importance.float().reshape(1, k // group, group)
    qmax = float(2 ** bits - 1)

    def error(s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        q = torch.round((blocks - b.unsqueeze(-1)) / s.unsqueeze(-1)).clamp_(0, qmax)
        e = (blocks - affine_dequantize_blocks(q, s, b, dtype)).square_().mul_(weight).sum(-1)
        return torch.where(s != 0, e, torch.full_like(e, math.inf))  # a constant group keeps its grid

    best_s, best_b = scales.float().clone(), biases.float().clone()
    best = error(best_s, best_b)
    lo, hi = blocks.amin(-1), blocks.amax(-1)
    for p in GRID_SHRINKS:
        s = ((hi - lo) * p / qmax).to(dtype).float()
        b = (lo * p).to(dtype).float()
        e = error(s, b)
        better = e < best
        best = torch.where(better, e, best)
        best_s, best_b = torch.where(better, s, best_s), torch.where(better, b, best_b)
    return best_s, best_b


def gptq_codes(w: torch.Tensor, h: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int,
               group: int, cfg: Optional[GPTQConfig] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The uint8 codes (rows x K) GPTQ gives matrix ``w`` (rows x K, float) on the affine grid ``scales``,
    ``biases`` (rows x K/group, float32) at ``bits`` bits, for inputs of second moment ``h`` (K x K). Each
    column's error is taken against its value as ``mx.dequantize`` computes it for scales of ``dtype``
    (bfloat16: ``q * s`` and ``+ b`` each rounded to bfloat16, mfqat.quant.reference.affine_dequantize_blocks)."""
    cfg = cfg or GPTQConfig()
    rows, k = w.shape
    if k % group or scales.shape != (rows, k // group) or biases.shape != scales.shape or h.shape != (k, k):
        raise ValueError(f"gptq: matrix {tuple(w.shape)}, grid {tuple(scales.shape)} / {tuple(biases.shape)}, "
                         f"second moment {tuple(h.shape)} do not fit groups of {group}")
    h = h.to(torch.float64, copy=True)
    dead = torch.diagonal(h) == 0  # an input that is always 0: its weight never matters
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if cfg.act_order else torch.arange(k)
    u = _upper_inverse_factor(h[perm][:, perm], cfg.damp)
    work = w.float()[:, perm].clone()
    groups = perm // group
    s, b = scales.float(), biases.float()
    qmax = float(2 ** bits - 1)
    codes = torch.empty(rows, k, dtype=torch.uint8)
    for lo in range(0, k, cfg.block_columns):
        hi = min(k, lo + cfg.block_columns)
        block, errors, ub = work[:, lo:hi].clone(), torch.zeros(rows, hi - lo), u[lo:hi, lo:hi]
        for i in range(hi - lo):
            g = int(groups[lo + i])
            col = block[:, i]
            q = torch.round((col - b[:, g]) / s[:, g]).clamp_(0, qmax)
            codes[:, lo + i] = q.to(torch.uint8)
            e = (col - affine_dequantize_blocks(q.unsqueeze(1), s[:, g], b[:, g], dtype)[:, 0]) / ub[i, i]
            block[:, i:] -= e.unsqueeze(1) * ub[i, i:].unsqueeze(0)
            errors[:, i] = e
        work[:, hi:] -= errors @ u[lo:hi, hi:]
    out = torch.empty_like(codes)
    out[:, perm] = codes
    return out


def best_codes(w: torch.Tensor, h: torch.Tensor, q: MXTensor, cfg: GPTQConfig) -> Tuple[MXTensor, float, str]:
    """Of ``q`` (round-to-nearest on its grid: ``"rtn"``), GPTQ's codes on ``q``'s grid (``"gptq"``) and, with
    ``cfg.grid_search``, GPTQ's codes on :func:`searched_grid` (``"searched"``), the one with the lowest
    :func:`output_error` on ``h``: (tensor, its error, which). Ties keep the earlier, so the search never makes a
    matrix worse than plain GPTQ (its choice weighs ``diag H`` only; GPTQ's error is the whole ``H``'s)."""
    bits, group = q.fmt.bits, q.block_size
    found = [(q, "rtn"), (dataclasses.replace(q, codes=gptq_codes(w, h, q.scales, q.biases, bits, group, cfg,
                                                                  q.dtype)), "gptq")]
    if cfg.grid_search:
        s, b = searched_grid(w, torch.diagonal(h), q.scales, q.biases, bits, group, q.dtype)
        s, b = s.to(q.scales.dtype), b.to(q.biases.dtype)
        found.append((dataclasses.replace(q, codes=gptq_codes(w, h, s, b, bits, group, cfg, q.dtype), scales=s,
                                          biases=b), "searched"))
    errors = [output_error(w, t, h) for t, _ in found]
    i = min(range(len(found)), key=errors.__getitem__)
    return found[i][0], errors[i], found[i][1]


def output_error(w: torch.Tensor, q: MXTensor, h: torch.Tensor) -> float:
    """``trace((W - Q) H (W - Q)^T)``: the summed squared output error of ``q`` against ``w`` per token."""
    err = w.float() - q.dequantize(torch.float32)
    return float(((err @ h.float()) * err).sum())


def input_moments(anchor: Anchor, calib: torch.Tensor, names: List[str], batch_size: int = 4,
                  after: Optional[Callable[[str], torch.Tensor]] = None) -> Iterator[Dict[str, torch.Tensor]]:
    """Per decoder layer (then the tail: an untied output head), {weight name: mean(x x^T) of its nn.Linear's input
    over the calibration tokens} (float32, K x K) for the ``names`` that are nn.Linear weights of the anchor's model,
    run in its own format layer by layer (mfqat.export.layerwise: the inputs of the whole forward, bit for bit).
    Each layer's dict is yielded once its layer has seen every batch, and the next layer runs when the caller asks
    for it, so one layer's moments are held at a time (beside two copies of the calibration hidden states).
    ``after``: the weights of the quantized model (name -> float32 tensor, asked once the caller has taken a layer's
    moments): the next layer's inputs are then the quantized model's (layerwise.layer_stages's ``after``)."""
    from mfqat.export.layerwise import layer_stages
    from mfqat.export.lazy_model import LazyModel, anchor_source

    lazy = LazyModel(anchor, checkpoint_layers=False)
    wanted = set(names)
    for stage in layer_stages(lazy, anchor_source(anchor), calib, batch_size, progress_desc="gptq",
                              after=after):
        linears = {n: m for n, m in stage.modules if isinstance(m, nn.Linear) and f"{n}.weight" in wanted}
        sums: Dict[str, torch.Tensor] = {}
        counts: Dict[str, int] = {}

        def hook(name: str):
            def fn(_mod, inputs, _out):
                x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
                sums[name] = sums[name].addmm_(x.T, x) if name in sums else x.T @ x
                counts[name] = counts.get(name, 0) + x.shape[0]
            return fn

        if stage.name == "tail" and not linears:
            return  # nothing to measure in the tail (a tied or plain output head): skip its full-logits forward
        hooks = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
        try:
            stage.run()
        finally:
            for hk in hooks:
                hk.remove()
        # a Linear that saw fewer tokens than it has inputs (an expert the text rarely routes to) keeps its codes
        out = {f"{n}.weight": s.div_(counts[n]) for n, s in sums.items() if counts[n] >= s.shape[0]}
        sums.clear()  # the yielded tensors are the only copies
        yield out
        del out


def gptq_names(anchor: Anchor, plan: Plan) -> List[str]:
    """The planned 2-D tensors in a derived affine format (GPTQ takes those that are an nn.Linear's weight; expert
    stacks, 3-D, keep their derived codes)."""
    return [n for n, f in plan.formats.items() if is_derived(f) and get_format(f).family == "affine"
            and len(anchor.shape(n)) == 2]


def memory_needed(anchor: Anchor, names: List[str], n_blocks: int, seq_len: int, batch_size: int = 4,
                  grid_search: bool = False) -> int:
    """Bytes :func:`apply_gptq` holds for the matrices ``names`` on ``n_blocks`` x ``seq_len`` calibration tokens:
    the codes of the nn.Linear matrices (a byte a weight; an embedding table gets none); one decoder layer at a time,
    its matrices' input moments (K x K float32 each, K the input features) and all its tensors in float32 (expert
    stacks included); the calibration hidden states twice (tokens x hidden size, float32; ``sequential`` holds no
    more: mfqat.export.layerwise) and each layer's recorded
    attention masks (blocks x seq_len^2 float32, two kinds); the largest matrix's working copies (its weights twice
    in float32, three K x K float64 factors); and the tensors outside the decoder layers in float32 (the embedding,
    while each layer's arguments are recorded), with, when an untied output head is among ``names``, its moment and a
    batch's logits (the model's tail). ``grid_search``: the largest matrix's other candidates too (their codes, a
    byte a weight each, and a searched chunk's temporaries)."""
    from mfqat.models import is_embedding

    shapes = {n: tuple(anchor.shape(n)) for n in names if not is_embedding(n)}
    codes = sum(rows * k for rows, k in shapes.values())
    moments: Dict[Optional[int], int] = {}
    for n, (_, k) in shapes.items():
        moments[layer_index(n)] = moments.get(layer_index(n), 0) + k * k * 4
    weights: Dict[Optional[int], int] = {}
    for n in list(anchor.quantized) + list(anchor.plain):
        weights[layer_index(n)] = weights.get(layer_index(n), 0) + 4 * math.prod(anchor.shape(n))
    layer = max((moments.get(i, 0) + weights[i] for i in weights if i is not None), default=0)
    from mfqat.export.verify import layer_config

    text = (layer_config(anchor.config) if isinstance(anchor.config, dict) else None) or {}
    hidden = text.get("hidden_size") or max((k for _, k in shapes.values()), default=0)
    activations = 2 * n_blocks * seq_len * int(hidden) * 4 + 2 * n_blocks * seq_len * seq_len * 4
    heads = [rows for n, (rows, _) in shapes.items() if layer_index(n) is None]
    outside = weights.get(None, 0)  # the embedding (and the rest outside the layers) while the layers' inputs are recorded
    tail = (outside + moments.get(None, 0) + batch_size * seq_len * max(heads) * 4) if heads else outside
    work = max((rows * k * 8 + k * k * 24 for rows, k in shapes.values()), default=0)
    if grid_search:
        work += max((rows * k * 2 for rows, k in shapes.values()), default=0) + 16 * GRID_CHUNK_ELEMENTS
    return codes + max(layer, tail) + activations + work


def _export_source(anchor: Anchor, plan: Plan) -> Callable[[str], torch.Tensor]:
    """name -> the exported model's tensor as PyTorch computes it (mfqat.export.verify.reference_tensor: the plan's
    codes, GPTQ's once a layer has them), else the anchor's: the quantized model of ``sequential`` GPTQ."""
    from mfqat.export.lazy_model import anchor_source
    from mfqat.export.verify import reference_tensor

    teacher = anchor_source(anchor)

    def source(name: str) -> torch.Tensor:
        v = reference_tensor(anchor, plan, name)
        return teacher(name) if v is None else v
    return source


def apply_gptq(anchor: Anchor, plan: Plan, calib: torch.Tensor, cfg: Optional[GPTQConfig] = None,
               budget: Optional[int] = None) -> dict:
    """GPTQ codes for every :func:`gptq_names` tensor that is an nn.Linear's weight, held whole in
    ``plan.learned_scales`` (an MXTensor each). Returns the report entry: tensors, the summed output error of
    round-to-nearest and of GPTQ on the calibration inputs, seconds. A tensor whose GPTQ error is not lower
    keeps its round-to-nearest codes. Refused up front (mfqat.memory.BudgetError) when :func:`memory_needed` does
    not fit ``budget`` (bytes; None: the memory available)."""
    from mfqat.memory import check_fits, gib

    cfg = cfg or GPTQConfig()
    t0 = time.perf_counter()
    names = gptq_names(anchor, plan)
    if not names:
        raise ValueError(f"{anchor.path}: --gptq changes the codes of derived affine matrices (affine2..affine8 "
                         "lowered from an MX anchor); this plan has none: use an affine recipe (uniform:affine4, "
                         "auto:BPW:affine) or drop --gptq")
    need = memory_needed(anchor, names, calib.shape[0], calib.shape[1], grid_search=cfg.grid_search)
    check_fits(f"{anchor.path}: --gptq ({len(names)} matrices: their codes, one layer's input moments, the "
               f"calibration hidden states; {gib(need)})", need, budget,
               remedy="drop --gptq, or export on a machine with more memory")
    before = after = 0.0
    changed = searched = 0
    quantized = _export_source(anchor, plan) if cfg.sequential else None
    for moments in input_moments(anchor, calib, names, after=quantized):  # one decoder layer's at a time
        for name in [n for n in names if n in moments]:
            q = plan.tensor(anchor, name)
            w = anchor_values(anchor, name).to(DERIVED_DTYPE).float()
            h = moments.pop(name)  # freed as each matrix is done
            if not torch.isfinite(w).all():
                continue
            (new, e1, how), e0 = best_codes(w, h, q, cfg), output_error(w, q, h)
            before += e0
            after += e1
            if how != "rtn":
                plan.learned_scales[name] = new
                changed += 1
                searched += how == "searched"
    skipped = sum(1 for n, f in plan.formats.items() if is_derived(f) and get_format(f).family == "affine"
                  and len(anchor.shape(n)) != 2)
    return {"tensors": changed, "candidates": len(names), "skipped_expert_stacks": skipped, "output_error_rtn": before, "output_error_gptq": after,
            "calibration_blocks": int(calib.shape[0]), "damp": cfg.damp, "act_order": cfg.act_order,
            "sequential": cfg.sequential, "grid_search": cfg.grid_search, "on_searched_grid": searched,
            "seconds": time.perf_counter() - t0}


def apply_gptq_text(anchor: Anchor, plan: Plan, tokenizer_dir, calib_text: Optional[str],
                    cfg: Optional[GPTQConfig] = None, budget: Optional[int] = None) -> dict:
    """Tokenize the calibration text (default: the pydoc training split) and :func:`apply_gptq` (``budget``: its
    memory check's)."""
    from transformers import AutoTokenizer

    from mfqat.data.sources import calibration_blocks, describe_calibration

    cfg = cfg or GPTQConfig()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    calib = calibration_blocks(tok, calib_text, n_blocks=cfg.n_blocks, seq_len=cfg.seq_len)
    if calib.shape[0] < cfg.n_blocks:
        warnings.warn(f"gptq: the calibration text gives {calib.shape[0]} blocks of {cfg.seq_len} tokens, not "
                      f"{cfg.n_blocks}: fewer tokens fit the text's inputs more closely and may generalise less "
                      "(give a longer --calib-text)", stacklevel=2)
    return {**apply_gptq(anchor, plan, calib, cfg, budget), "calibration": describe_calibration(calib_text)}
