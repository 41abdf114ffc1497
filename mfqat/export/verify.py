"""The export check: MLX's dequantized tensors and mlx_lm's logits against PyTorch on the same weights."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch

from mfqat.anchor.checkpoint import Anchor, AnchorError
from mfqat.export.recipes import Plan, mlx_storage
from mfqat.models import layer_index
from mfqat.progress import progress
from mfqat.quant.mxtensor import MXTensor
from mfqat.storage.shard_files import MAX_SHARD_BYTES
from mfqat.storage.tensor_files import ShardWriter, TensorFile

# The exported logits must match PyTorch's (float32, same weights) within LOGIT_RTOL[check] x
# max(1, max |PyTorch logit|) on the check prompt. The weights are checked bit-exact first, so this
# checks the model around them (config, per-module bits, rope, norms, tying). "float32": MLX computes in
# float32 (float32 affine scales, MXFP/NVFP4 modes). "float32-upcast": bfloat16 parameters (scales, biases,
# norms) upcast to float32 (MLX's bfloat16 arithmetic drifts with depth: 15-23% of max |logit| on
# SmolLM2-135M, and is ~100x slower on CPU) and the reference dequantizes in the same float32 arithmetic
# (_decoded), so both sides run the same numbers and only the order of float32 operations differs.
# Measured (scripts/dev/probe_logit_check.py: every catalog family, affine2..8 at group 32/64/128, mxint,
# mxfp, nvfp4, seed/dynamic2 plans, whole and cut check), as ratio = |diff| / max(1, max |logit|):
# float32-upcast: <= 1.9e-5 on the tests' tiny models, <= 2.5e-4 on the same models twice as wide with
# initializer_range 0.2 (logits ~10, sharp attention), 3.2e-6 on SmolLM2-135M affine4 (1.1e-4 absolute);
# 3e-3 is 12x the worst. float32: <= 2.3e-4 (the wider models; <= 1.7e-5 on the tests' models, 4.0e-6 on
# SmolLM2 mxint4), kept at 1e-3. MXFP/NVFP4 embeddings run in float32 for the check (_float32_embeddings):
# MLX dequantizes them to bfloat16, which failed valid OLMo2/Gemma2 MXFP exports (7.3e-3 on the tiny OLMo2).
# A planted bug the old 0.1 hid: rope_theta left in rope_parameters (mlx-lm's qwen2 then runs 1e6) moved a
# tiny Qwen2's logits by 3.8% of max |logit| with 8% of next-token argmaxes changed (tests/test_safety_export.py).
LOGIT_RTOL = {"float32": 1e-3, "float32-upcast": 3e-3}
# The logits are compared at every position of the check prompt, repeated to at least this many tokens:
# a port that differs only past a short context (a sliding window mlx-lm ignores, rope scaling) shows.
CHECK_TOKENS = 64
# The cut check (past the budget: a model of billions of parameters) compares this many positions. MLX's
# CPU matmul costs ~22 ms a token for each 25M-parameter matrix, so 64 tokens were 12 s of a 3B export;
# windows and rope scaling thresholds of real models of that size lie far beyond 64 tokens anyway (the
# families' export caveats name the windows mlx-lm ignores).
CUT_CHECK_TOKENS = 16
# The whole-model logits check runs when it needs at most this much memory (full_check_bytes; a user's
# max_memory overrides it); past it the check runs on the model cut to its first layers (compare_truncated).
CHECK_MEMORY = 2 * 1024 ** 3
# mfqat_export.json's layout; an export declaring a newer one is refused (written since mfqat 0.1.0: 1;
# exports without the field are version 1).
EXPORT_FORMAT_VERSION = 1


def check_export_version(meta: dict, where: str) -> int:
    """The export's format version; ValueError naming ``where`` when it is newer than this mfqat reads."""
    v = meta.get("format_version", 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{where}: field 'format_version' must be a positive integer, got {v!r}")
    if v > EXPORT_FORMAT_VERSION:
        raise ValueError(f"{where}: format version {v} is newer than this mfqat supports ({EXPORT_FORMAT_VERSION}); "
                         "upgrade mfqat to read it")
    return v

def _as_written(family, name: str, value: torch.Tensor) -> torch.Tensor:
    """A plain tensor as the export writes it (bfloat16 unless kept float32, in mlx-lm's form), mapped back
    to transformers' form in float32: the PyTorch reference runs on exactly the written numbers."""
    written = family.mlx_value(name, value.float())
    if not family.float32_on_export(name):
        written = written.to(torch.bfloat16)
    return family.hf_value(name, written.float())


def reference_state(anchor: Anchor, plan: Plan, keep: Callable[[str], bool] = lambda name: True
                    ) -> Dict[str, torch.Tensor]:
    """The PyTorch weights that the export must reproduce (float32); ``keep``: only the names it accepts."""
    return dict(reference_tensors(anchor, plan, keep))


def reference_tensors(anchor: Anchor, plan: Plan, keep: Callable[[str], bool] = lambda name: True,
                      vocab: Optional["VocabCut"] = None, upcast: bool = False):
    """(name, float32 tensor) of :func:`reference_state`, one at a time (large matrices dequantized in row
    chunks: Plan.chunk_rows); ``vocab``: only the kept rows of the tensors indexed by token id; ``upcast``:
    bfloat16 affine scales and biases applied in float32 arithmetic, as MLX computes once the check has
    upcast them (:func:`compare_logits`), instead of MLX's native bfloat16 two roundings."""
    family = plan.family
    for k in anchor.plain:
        if keep(k) and k not in plan.formats:
            v = anchor.plain[k]
            v = _as_written(family, k, v) if v.is_floating_point() else v
            yield k, (vocab.rows_of(k, v) if vocab else v)
    for name in plan.formats:
        if keep(name):
            yield name, _dequantized(anchor, plan, name, vocab, upcast)
    for name in plan.kept16:
        if keep(name) and name in anchor.quantized:
            v = anchor.quantized[name].dequantize(torch.float32).to(torch.bfloat16).float()
            yield name, (vocab.rows_of(name, v) if vocab else v)


def reference_tensor(anchor: Anchor, plan: Plan, name: str, vocab: Optional["VocabCut"] = None,
                     upcast: bool = False) -> Optional[torch.Tensor]:
    """The value :func:`reference_tensors` gives under ``name`` (float32), computed alone (``--refine``'s student
    and the logits check's lazily run reference ask one module's tensors at a time); None when it holds nothing
    under that name (a quantized tensor neither planned nor kept in 16 bits). Same precedence as the dict of
    :func:`reference_tensors`; ``vocab`` and ``upcast`` as there."""
    if name in plan.kept16 and name in anchor.quantized:
        v = anchor.quantized[name].dequantize(torch.float32).to(torch.bfloat16).float()
    elif name in plan.formats:
        return _dequantized(anchor, plan, name, vocab, upcast)
    elif name in anchor.plain:
        v = anchor.plain[name]
        v = _as_written(plan.family, name, v) if v.is_floating_point() else v
    else:
        return None
    return vocab.rows_of(name, v) if vocab else v


def _decoded(q, upcast: bool) -> torch.Tensor:
    """``q`` dequantized to float32; ``upcast``: a bfloat16 affine tensor's arithmetic in float32."""
    if upcast and q.dtype == torch.bfloat16 and q.biases is not None:
        q = dataclasses.replace(q, dtype=torch.float32)
    return q.dequantize(torch.float32)


def _dequantized(anchor: Anchor, plan: Plan, name: str, vocab: Optional["VocabCut"],
                 upcast: bool = False) -> torch.Tensor:
    """Planned tensor ``name`` dequantized to float32 (row chunks for large matrices; with ``vocab``, only its
    kept rows when it is indexed by token id; ``upcast``: see :func:`reference_tensors`)."""
    shape = anchor.shape(name)
    picked = vocab.index(name, shape) if vocab else None
    rows = plan.chunk_rows(anchor, name)
    if rows is None:
        v = _decoded(plan.tensor(anchor, name), upcast)
        return v if picked is None else v[picked]
    out = torch.empty((len(picked),) + tuple(shape[1:]) if picked is not None else shape, dtype=torch.float32)
    for lo, hi, q in plan.tensor_chunks(anchor, name, rows):
        if picked is None:
            out[lo:hi] = _decoded(q, upcast)
            continue
        inside = ((picked >= lo) & (picked < hi)).nonzero().flatten()
        if len(inside):
            out[inside] = _decoded(q, upcast)[picked[inside] - lo]
    return out


class VocabCut:
    """The cut check's vocabulary: the token ids it keeps (the prompt's, the config's special tokens and
    the first ``FIRST`` ids), renumbered 0..n-1. Rows of tensors indexed by token id (embeddings, lm_head:
    outside the decoder layers, first dimension the vocabulary) are independent, so the cut model's logits
    are the whole model's on those ids exactly, and its embedding and head are n rows instead of the
    vocabulary (at 1.2B parameters, 1.6 GB of float32 reference less)."""

    FIRST = 256

    def __init__(self, vocab_size: int, ids, config: dict):
        keep = set(i for i in ids if 0 <= i < vocab_size) | set(range(min(self.FIRST, vocab_size)))
        keep |= {i for i in _special_ids(config) if 0 <= i < vocab_size}
        self.vocab_size = vocab_size
        self.ids = torch.tensor(sorted(keep), dtype=torch.long)
        self.new = {int(i): n for n, i in enumerate(self.ids.tolist())}

    def index(self, name: str, shape) -> Optional[torch.Tensor]:
        """The rows to keep of tensor ``name`` (None: all of it, not indexed by token id)."""
        if layer_index(name) is None and len(shape) >= 1 and shape[0] == self.vocab_size:
            return self.ids
        return None

    def rows_of(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` with only its kept rows when it is indexed by token id."""
        picked = self.index(name, t.shape)
        return t if picked is None else t[picked]

    def tokens(self, ids) -> list:
        """``ids`` renumbered into the cut vocabulary."""
        return [self.new[i] for i in ids]

    def config(self, config: dict) -> dict:
        """``config`` (already cut to its first layers) with the cut vocabulary and its special ids renumbered."""
        cfg = json.loads(json.dumps(config))
        for c in (cfg, cfg.get("text_config")):
            if not isinstance(c, dict):
                continue
            if c.get("vocab_size") == self.vocab_size:
                c["vocab_size"] = len(self.ids)
            for k, v in list(c.items()):
                if k.endswith("_token_id"):
                    c[k] = self._renumber(v)
        return cfg

    def _renumber(self, v):
        if isinstance(v, bool) or v is None:
            return v
        if isinstance(v, int):  # an id beyond the vocabulary (an image token's) stays beyond the cut one
            return self.new.get(v, v + len(self.ids) - self.vocab_size if v >= self.vocab_size else v)
        if isinstance(v, list):
            return [self._renumber(x) for x in v]
        return v


def _special_ids(config: dict) -> list:
    """Every integer ``*_token_id`` of a config (and of its ``text_config``)."""
    out = []
    for c in (config, config.get("text_config")):
        for k, v in (c.items() if isinstance(c, dict) else ()):
            if k.endswith("_token_id"):
                out += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int) and not isinstance(x, bool)]
    return out


class WrittenTensors:
    """The tensors of a written export, read one at a time as MLX arrays (nothing else held)."""

    def __init__(self, folder: Path):
        self.files = [TensorFile.open(f) for f in sorted(Path(folder).glob("model*.safetensors"))]
        self.where = {n: f for f in self.files for n in f.infos}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def torch(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as written (torch)."""
        return self.where[name].read(name)

    def get(self, name: str):
        """Tensor ``name`` as an MLX array (None when absent)."""
        return to_mx(self.torch(name)) if name in self.where else None

    def close(self) -> None:
        """Release the files."""
        for f in self.files:
            f.close()


def to_mx(t: torch.Tensor):
    """A torch tensor as an MLX array of the same dtype and bits (bfloat16 and uint32 included)."""
    import mlx.core as mx

    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


class WriteRecord:
    """What an export wrote, kept as it wrote it, for the cut weights check (:func:`check_written`): the
    PyTorch dequantization (float32) of sampled rows of every quantized piece. (The sha256 of every
    tensor's bytes is the ShardWriter's, ``ShardWriter.digests``.) The rows: the first two and the last two
    of every piece, and the first and the last of every row chunk a large matrix is written in; for a
    stacked expert piece (experts x rows x columns) the first and the last expert. The values go to an
    unnamed temporary file in ``folder`` (the partial export), not to the heap: thousands of small arrays
    kept alive between each tensor's large temporaries would fragment it (measured: +1 GB of resident
    memory at 1.2B parameters)."""

    def __init__(self, folder: Path) -> None:
        import tempfile

        self._file = tempfile.TemporaryFile(dir=folder, prefix=".check-samples-")
        self._end = 0
        self.samples: Dict[str, Tuple[str, int, Dict[int, Tuple[int, tuple]]]] = {}  # piece -> (format, group, rows)

    def _rows(self, piece: str, plan: Plan, name: str) -> Dict[int, Tuple[int, tuple]]:
        fmt = plan.formats[name]
        return self.samples.setdefault(piece, (fmt, plan.group_of(fmt), {}))[2]

    def _keep(self, values: torch.Tensor) -> Tuple[int, tuple]:
        raw = values.contiguous().numpy().tobytes()
        self._file.write(raw)
        self._end, start = self._end + len(raw), self._end
        return start, tuple(values.shape)

    def values(self, where: Tuple[int, tuple]) -> np.ndarray:
        """The float32 values kept at ``where`` (an entry of :attr:`samples`)."""
        start, shape = where
        self._file.flush()
        n = int(np.prod(shape)) if shape else 1
        return np.frombuffer(os.pread(self._file.fileno(), 4 * n, start), dtype=np.float32).reshape(shape)

    def add_tensor(self, plan: Plan, name: str, q: MXTensor) -> None:
        """Sample every piece of planned tensor ``name``, whole in ``q``."""
        rows = q.shape[-2] if q.codes.ndim > 1 else 1
        for piece, lo, hi in plan.family.mlx_pieces(name, rows):
            kept = self._rows(piece, plan, name)
            if q.codes.ndim == 3:  # experts x rows x columns: the written piece's axis 0 is the expert
                for e in sorted({0, q.shape[0] - 1}):
                    kept[e] = self._keep(_rows_of(q, (slice(e, e + 1), slice(lo, hi))))
            elif q.codes.ndim == 2:
                for r in sorted({r for r in (lo, lo + 1, hi - 2, hi - 1) if lo <= r < hi}):
                    kept[r - lo] = self._keep(_rows_of(q, slice(r, r + 1)))
            else:
                kept[-1] = self._keep(q.dequantize(torch.float32))  # a vector: checked whole

    def add_chunk(self, plan: Plan, name: str, q: MXTensor, first_row: int) -> None:
        """Sample rows ``first_row:first_row + len(q)`` of the large matrix ``name`` (one piece), written as
        one chunk."""
        kept = self._rows(plan.family.mlx_name(name), plan, name)
        for r in sorted({0, q.shape[0] - 1}):
            kept[first_row + r] = self._keep(_rows_of(q, slice(r, r + 1)))

    def close(self) -> None:
        """Drop the kept values (the file has no name: nothing is left behind)."""
        self._file.close()


def _rows_of(q: MXTensor, index) -> torch.Tensor:
    """The float32 dequantization of ``q[index]`` (an index into its leading axes), decoded from those
    rows' codes, scales and biases alone."""
    sub = MXTensor(q.codes[index], q.scales[index], q.fmt, q.block_size, q.dtype,
                   None if q.biases is None else q.biases[index], q.scale_rule, global_scale=q.global_scale)
    return sub.dequantize(torch.float32)


def check_written(out: Path, plan: Plan, digests: Dict[str, str], record: WriteRecord) -> int:
    """The cut weights check: every tensor of the written files hashes to what the write produced
    (``digests``, sha256 of its bytes), and MLX dequantizes each sampled row (``record``) of every quantized
    piece from the files to exactly PyTorch's values. Returns the number of bytes hashed; RuntimeError
    naming the tensor otherwise."""
    import hashlib

    import mlx.core as mx

    weights = WrittenTensors(out)
    hashed = 0
    try:
        if set(weights.where) != set(digests):
            odd = sorted(set(weights.where) ^ set(digests))[0]
            raise RuntimeError(f"export check failed: {odd} is {'missing from' if odd in digests else 'extra in'} "
                               "the written files; nothing was written")
        for name in progress(sorted(weights.where), desc="export check: tensor bytes", unit="tensor"):
            raw = weights.torch(name).reshape(-1).view(torch.uint8).numpy()
            if hashlib.sha256(memoryview(raw)).hexdigest() != digests[name]:
                raise RuntimeError(f"export check failed: {name}: the bytes in the written file differ from the "
                                   "bytes the export computed; nothing was written")
            hashed += raw.size
        for piece, (fmt, group, rows) in record.samples.items():
            module = piece[: -len(".weight")]
            mode, bits = mlx_storage(fmt) or (None, None)
            for r, where in rows.items():
                expect = record.values(where)
                part = {k: to_mx(weights.torch(f"{module}.{k}") if r < 0 else
                                 weights.where[f"{module}.{k}"].read_rows(f"{module}.{k}", r, r + 1))
                        for k in ("weight", "scales", "biases") if f"{module}.{k}" in weights}
                got = part["weight"] if "scales" not in part else mx.dequantize(
                    part["weight"], part["scales"], part.get("biases"), group_size=group, bits=bits, mode=mode)
                got = np.array(got.astype(mx.float32))
                if got.shape != expect.shape or not np.array_equal(got, expect):
                    raise RuntimeError(f"export check failed: {piece}: row {r} differs between MLX's dequantization "
                                       f"of the written files and PyTorch's ({fmt}); nothing was written")
    finally:
        weights.close()
    return hashed


def check_weights(out: Path, anchor: Anchor, plan: Plan) -> int:
    """Every planned tensor dequantized by MLX from the written files equals the PyTorch dequantization,
    tensor by tensor (one in memory at a time); the number of elements checked."""
    import mlx.core as mx

    weights = WrittenTensors(out)
    checked = 0
    try:
        for name in progress(list(plan.formats), desc="export check: tensors", unit="tensor"):
            rows = plan.chunk_rows(anchor, name)
            if rows is not None:
                checked += _check_chunked(weights, plan, anchor, name, rows)
                continue
            full = plan.tensor(anchor, name).dequantize(torch.float32).numpy()
            rows = full.shape[-2] if full.ndim > 1 else 1
            for piece, lo, hi in plan.family.mlx_pieces(name, rows):
                module = piece[: -len(".weight")]
                expect = full if (lo, hi) == (0, rows) else full[..., lo:hi, :]
                if f"{module}.scales" in weights:
                    mode, bits = mlx_storage(plan.formats[name])
                    got = mx.dequantize(weights.get(piece), weights.get(f"{module}.scales"),
                                        weights.get(f"{module}.biases"),
                                        group_size=plan.group_of(plan.formats[name]), bits=bits, mode=mode)
                elif piece in weights:
                    got = weights.get(piece)
                else:
                    raise RuntimeError(f"export check failed: {name}: no {piece} in the written files; nothing was "
                                       "written")
                got = np.array(got.astype(mx.float32))
                if got.shape != expect.shape or not np.array_equal(got, expect):
                    bad = int((got != expect).sum()) if got.shape == expect.shape else got.size
                    where = "" if piece == name else f", in {piece}"
                    raise RuntimeError(f"export check failed: {name}: {bad} elements differ between MLX and PyTorch "
                                       f"dequantization ({plan.formats[name]}{where}); nothing was written")
                checked += got.size
    finally:
        weights.close()
    return checked


def _check_chunked(weights: WrittenTensors, plan: Plan, anchor: Anchor, name: str, rows: int) -> int:
    """:func:`check_weights` of one large matrix, ``rows`` rows at a time (the written rows read alone)."""
    import mlx.core as mx

    module = plan.family.mlx_name(name)[: -len(".weight")]
    mode, bits = mlx_storage(plan.formats[name]) or (None, None)
    checked = 0
    for lo, hi, q in plan.tensor_chunks(anchor, name, rows):
        expect = q.dequantize(torch.float32).numpy()
        part = {k: to_mx(weights.where[f"{module}.{k}"].read_rows(f"{module}.{k}", lo, hi))
                for k in ("weight", "scales", "biases") if f"{module}.{k}" in weights}
        if "weight" not in part:
            raise RuntimeError(f"export check failed: {name}: no {module}.weight in the written files; nothing was "
                               "written")
        got = part["weight"] if "scales" not in part else mx.dequantize(
            part["weight"], part["scales"], part.get("biases"), group_size=plan.group_of(plan.formats[name]),
            bits=bits, mode=mode)
        got = np.array(got.astype(mx.float32))
        if got.shape != expect.shape or not np.array_equal(got, expect):
            bad = int((got != expect).sum()) if got.shape == expect.shape else got.size
            raise RuntimeError(f"export check failed: {name}: {bad} elements differ between MLX and PyTorch "
                               f"dequantization ({plan.formats[name]}, rows {lo}:{hi}); nothing was written")
        checked += got.size
    return checked


def verify_export(out: Path, anchor: Anchor, plan: Plan, prompt: str, max_memory: Optional[int] = None,
                  written: Optional[Tuple[Dict[str, str], WriteRecord]] = None) -> dict:
    """The export check. When the whole check fits ``max_memory`` (bytes; default :data:`CHECK_MEMORY`):
    every planned tensor dequantized by MLX from the written files equals the PyTorch dequantization,
    re-derived tensor by tensor (:func:`check_weights`), then the logits of ``mlx_lm.load`` against
    PyTorch's on the whole model. Past it, the cut check: every
    written tensor's bytes hash to what the write computed and MLX dequantizes sampled rows of every piece
    exactly as PyTorch does (:func:`check_written`, from ``written``: the writer's digests and samples; without
    them, :func:`check_weights`), then the logits of the model cut to its first layers
    (:func:`check_layers`: every kind of layer the config has), which checks the same config keys, names,
    per-module bits, rope and tying at the memory of a few layers."""
    need = full_check_bytes(anchor)
    budget = CHECK_MEMORY if max_memory is None else max_memory
    whole = need <= budget or layer_config(anchor.config) is None
    if whole or written is None:
        rep = {"weights_checked": check_weights(out, anchor, plan), "weights_check": "every element through MLX"}
    else:
        samples = sum(int(np.prod(shape)) for _, _, rows in written[1].samples.values() for _, shape in rows.values())
        rep = {"bytes_hashed": check_written(out, plan, *written), "weights_checked": samples,
               "weights_check": "every byte by sha256, sampled rows through MLX"}
    rep["weights_bit_exact"] = rep["weights_checked"] > 0
    if whole:
        rep.update(compare_logits(out, anchor, plan, prompt))
        rep["logits_checked"] = "whole model"
    else:
        rep.update(compare_truncated(out, anchor, plan, prompt))
        rep["logits_full_check_bytes"] = need
    if not rep["max_abs_logit_diff"] <= rep["logit_tolerance"]:
        raise RuntimeError(f"export check failed: the logits of mlx_lm.load(out) differ from PyTorch by "
                           f"{rep['max_abs_logit_diff']:.3g}, above the tolerance {rep['logit_tolerance']:.3g} "
                           f"({rep['mlx_compute']} LOGIT_RTOL x max(1, max |logit|)); nothing was written")
    return rep


def full_check_bytes(anchor: Anchor) -> int:
    """Memory the whole-model logits check is budgeted: 8 bytes a parameter plus the libraries, what it needed
    when the PyTorch reference was held whole beside the MLX model upcast. The reference now runs module by
    module (:func:`reference_logits`), so this over-counts; it is kept so that which check runs, and what it
    costs in time, stays the same (the whole check's MLX forward is the slow part at 1B and up)."""
    from mfqat.export.mlx_sizes import anchor_parameters
    return 8 * anchor_parameters(anchor) + 512 * 1024 ** 2


def layer_config(config: dict) -> Optional[dict]:
    """The part of a config that counts the decoder layers: the config itself, or a vision-language
    release's ``text_config``; None when neither has ``num_hidden_layers``."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("num_hidden_layers"), int):
            return cfg
    return None


def check_layers(config: dict) -> int:
    """How many leading decoder layers the cut check keeps: at least 2, and enough to hold every kind of
    layer the config names (``layer_types``, a hybrid stack's ``full_attention_interval``, the dense layers
    before the first MoE layer)."""
    config = layer_config(config) or {}
    n = int(config.get("num_hidden_layers") or 0)
    k = 2
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        k = max(k, max(types.index(t) for t in set(types)) + 1)
    for key, extra in (("full_attention_interval", 0), ("first_k_dense_replace", 1), ("decoder_sparse_step", 0)):
        if isinstance(config.get(key), int) and not isinstance(config.get(key), bool):
            k = max(k, config[key] + extra)
    return min(k, n) if n else k


def cut_config(config: dict, k: int) -> dict:
    """``config`` with only its first ``k`` decoder layers (per-layer lists cut to match; in ``text_config``
    for a vision-language release)."""
    cfg = json.loads(json.dumps(config))
    inner = layer_config(cfg)
    inner["num_hidden_layers"] = k
    if isinstance(inner.get("layer_types"), list):
        inner["layer_types"] = inner["layer_types"][:k]
    return cfg


def compare_truncated(out: Path, anchor: Anchor, plan: Plan, prompt: str) -> dict:
    """The logits check on the export cut to its first :func:`check_layers` layers and to the check's
    vocabulary (:class:`VocabCut`): a folder holding those layers' written tensors (and every tensor
    outside the layers, token-indexed ones cut to the kept rows) is loaded by mlx_lm and compared with the
    PyTorch reference cut the same way."""
    import shutil
    import tempfile

    from mlx_lm.utils import load_tokenizer

    config = anchor.config
    k = check_layers(config)
    keep = lambda name: (layer_index(name) is None or layer_index(name) < k)  # noqa: E731
    ids = check_ids(load_tokenizer(out), prompt, CUT_CHECK_TOKENS)
    size = (layer_config(config) or config).get("vocab_size")
    vocab = VocabCut(size, ids, config) if isinstance(size, int) and not isinstance(size, bool) else None
    cut_vocab = (lambda c: vocab.config(c)) if vocab else (lambda c: c)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix=".check-", dir=out) as tmp:
        cut = Path(tmp)
        written = WrittenTensors(out)
        writer = ShardWriter(cut, MAX_SHARD_BYTES, {"format": "mlx"})
        try:
            for name in written.where:
                if keep(name):
                    t = written.torch(name)
                    writer.add(name, vocab.rows_of(name, t) if vocab else t)
            writer.close()
        finally:
            written.close()
        mlx_cfg = json.loads((out / "config.json").read_text())
        (cut / "config.json").write_text(json.dumps(cut_vocab(cut_config(mlx_cfg, k))))
        for f in out.iterdir():
            if f.is_file() and not f.name.startswith("model") and f.name != "config.json":
                shutil.copy(f, cut / f.name)
        rep = compare_logits(cut, anchor, plan, prompt, config=cut_vocab(cut_config(config, k)), keep=keep,
                             vocab=vocab, ids=vocab.tokens(ids) if vocab else ids)
    rep["logits_checked"] = (f"first {k} of {layer_config(config)['num_hidden_layers']} layers"
                             + (f", {len(vocab.ids)} of {size} token ids" if vocab else ""))
    return rep


def check_ids(tok, prompt: str, tokens: int = CHECK_TOKENS) -> list:
    """The check's token ids: ``prompt`` encoded, repeated to at least ``tokens`` tokens."""
    ids = tok.encode(prompt)
    return (ids * -(-tokens // max(len(ids), 1)))[:max(tokens, len(ids))]


def _float32_embeddings(model) -> int:
    """Make ``model``'s MXFP/NVFP4 quantized embeddings return float32 (in place; how many): MLX dequantizes
    those modes to bfloat16, so the hidden states would start in bfloat16 and the check would measure that
    rounding (7.3e-3 of max |logit| on a tiny OLMo2 at mxfp8, whose first projection reads the embedding
    without a norm between) instead of the model around the weights. The values are exact in bfloat16; only
    the activations' dtype changes. Affine embeddings already dequantize to their scales' (upcast) dtype."""
    import mlx.core as mx
    import mlx.nn as nn

    class Float32QuantizedEmbedding(nn.QuantizedEmbedding):
        def __call__(self, x):
            return super().__call__(x).astype(mx.float32)

    n = 0
    for _, m in model.named_modules():
        if type(m) is nn.QuantizedEmbedding and getattr(m, "mode", "affine") != "affine":
            m.__class__ = Float32QuantizedEmbedding
            n += 1
    return n


def reference_logits(anchor: Anchor, plan: Plan, config: dict, keep: Callable[[str], bool],
                     vocab: Optional[VocabCut], upcast: bool, ids: list) -> torch.Tensor:
    """The PyTorch reference's logits for ``ids``: the model of ``config`` (the anchor's, or a cut of it) run
    module by module (mfqat.export.lazy_model) on :func:`reference_tensor`'s values, so that one module's
    float32 weights are held at a time (a MoE layer's experts, not the model or the cut check's layers: the
    same logits, bit for bit). RuntimeError when the reference and the anchor's weights differ in names
    (every weight the anchor has that ``keep`` accepts, nothing else)."""
    from mfqat.export.lazy_model import LazyModel

    view = dataclasses.replace(anchor, config=config)
    try:
        lazy = LazyModel(view, checkpoint_layers=False)
    except AnchorError as e:
        raise RuntimeError(f"export check failed: the PyTorch reference does not match {anchor.path}'s weights "
                           f"({e}); nothing was written") from None
    shapes = {name: tuple(getattr(module, kind)[attr].shape)
              for module, entries in lazy.slots.items() for kind, attr, name in entries}
    held = [k for k in anchor.plain if k not in plan.formats] + list(plan.formats) + [
        k for k in plan.kept16 if k in anchor.quantized and k not in plan.formats]
    unexpected = [k for k in held if keep(k) and k not in shapes]
    if unexpected:
        raise RuntimeError(f"export check failed: the PyTorch reference does not match {anchor.path}'s weights "
                           f"(unexpected {unexpected[:3]}); nothing was written")

    def source(name: str) -> torch.Tensor:
        v = reference_tensor(anchor, plan, name, vocab, upcast)
        if v is None or tuple(v.shape) != shapes[name]:
            raise RuntimeError(f"export check failed: the PyTorch reference has {name} "
                               f"{'nothing' if v is None else tuple(v.shape)} where the model of its config.json "
                               f"needs {shapes[name]}; nothing was written")
        return v
    return lazy.logits(source, torch.tensor([ids]))


def compare_logits(out: Path, anchor: Anchor, plan: Plan, prompt: str, config: Optional[dict] = None,
                   keep: Callable[[str], bool] = lambda name: True, vocab: Optional[VocabCut] = None,
                   ids: Optional[list] = None) -> dict:
    """Load with mlx_lm and compare logits on ``prompt`` with the PyTorch model in the same format
    (``config``/``keep``/``vocab``/``ids``: a cut model and its renumbered tokens, see
    :func:`compare_truncated`)."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load

    from mlx.utils import tree_flatten, tree_map

    config = anchor.config if config is None else config
    model, tok = mlx_load(str(out))
    ids = check_ids(tok, prompt) if ids is None else ids
    params = tree_flatten(model.parameters())
    bf16_scales = any(a.dtype == mx.bfloat16 and k.endswith((".scales", ".biases")) for k, a in params)
    compute = "float32-upcast" if bf16_scales else "float32"  # see LOGIT_RTOL
    if any(a.dtype == mx.bfloat16 for _, a in params):  # bf16 norms upcast exactly (PyTorch holds them so)
        model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))
    _float32_embeddings(model)
    mlx_logits = np.array(model(mx.array([ids])).astype(mx.float32))
    del model
    upcast = compute == "float32-upcast"  # the reference computes as the upcast MLX model does
    with torch.no_grad():
        pt_logits = reference_logits(anchor, plan, config, keep, vocab, upcast, ids).numpy()
    diff = float(np.abs(mlx_logits - pt_logits).max())
    tol = LOGIT_RTOL[compute] * max(1.0, float(np.abs(pt_logits).max()))
    agree = float((mlx_logits.argmax(-1) == pt_logits.argmax(-1)).mean())
    return {"max_abs_logit_diff": diff, "logit_tolerance": tol, "mlx_compute": compute,
            "argmax_agreement": agree, "prompt_tokens": len(ids)}
