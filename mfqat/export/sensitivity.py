"""The ``auto:BPW`` recipe: per-tensor sensitivity on calibration text, then bits under a budget.

Measurement (one forward pass per tensor): start from the model in the anchor's format, lower only
one tensor to the *probe* format (the family step just below the budget's level), and take the
KL divergence of the next-token distribution from the anchor-format model's, averaged over the
calibration tokens. Other levels are extrapolated from the probe by the tensor's own relative
weight error, ``KL_t(f) ~= KL_t(probe) * err_t(f) / err_t(probe)`` (a first-order model: the
output change grows with the weight perturbation's energy), so the cost is one pass per tensor
instead of one per (tensor, level).

The ``affine`` family (``auto:BPW:affine``) plans MLX's affine widths derived from the anchor
(mfqat.quant.derive) in groups of ``group`` (64 by default, as mlx_lm.convert): its levels are affine3..8
and their cost includes the bfloat16 scale and bias of every group (4.5 bits/weight for affine4 at
group 64), so a budget means the same bytes as an ``mlx_lm.convert`` file of that size.

The budget counts what the export stores (:class:`StoredCost`, built by mfqat.export.recipes): each level at the
bytes it is written in (codes and scales/biases in their file dtype), plus the bytes the plan does not choose
(tensors written as they are, norms among them, and the safetensors headers), over the model's parameters:
the figure the export reports as "stored N bits/weight" (mfqat.export.mlx_sizes.stored_size), never above it.

Allocation: the per-tensor levels with the least summed estimated KL within that budget, every width
considered for every tensor (a multiple-choice knapsack, solved exactly by dynamic
programming over the extra bits; when that table would be too large, greedily: from the lowest level,
the upgrade with the largest sensitivity reduction per extra bit while the budget allows).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from mfqat.anchor.checkpoint import Anchor
from mfqat.export.lazy_model import LazyModel, anchor_source
from mfqat.export.replay import LayerReplay, start_layers
from mfqat.quant.derive import DERIVED_GROUP_SIZE, derive, is_derived
from mfqat.quant.derive import derived_group as group_of_derived
from mfqat.formats import canonical_name, get_format, grouped
from mfqat.quant.scale_rules import DEFAULT_SCALE_RULE
from mfqat.progress import progress
from mfqat.quant.api import quantize
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.slice import slice_and_scale

SENSITIVITY_BLOCKS = 4  # calibration blocks of 128 tokens the pass scores (export-mlx --sensitivity-blocks)

# Matrices above this many elements (a 1B+ model's embedding and head) are measured in row chunks of about
# ROWS_ELEMENTS elements (_errors_in_chunks); SmolLM2-135M's largest, 28M, stays whole (its plans unchanged).
CHUNK_ELEMENTS = 32 * 1024 ** 2
ROWS_ELEMENTS = 4 * 1024 ** 2

LADDERS = {
    "mxint": ["mxint2", "mxint3", "mxint4", "mxint5", "mxint6", "mxint8"],
    "mxfp": ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3"],
    "affine": ["affine3", "affine4", "affine5", "affine6", "affine8"],
}


@dataclass
class TensorSensitivity:
    """One tensor's measured and extrapolated sensitivity."""
    name: str
    numel: int
    probe_format: str
    probe_kl: float
    rel_error: Dict[str, float] = field(default_factory=dict)

    def at(self, fmt: str) -> float:
        """Estimated KL when only this tensor is in ``fmt``."""
        base = self.rel_error[self.probe_format]
        if fmt not in self.rel_error:  # a grouped level the tensor's rows do not divide into (fits)
            return math.inf
        return self.probe_kl * self.rel_error[fmt] / base if base > 0 else 0.0


class BudgetTooSmall(ValueError):
    """An ``auto:BPW`` budget below the smallest plan (the message names the recipe and the smallest budget)."""


@dataclass
class StoredCost:
    """What an ``auto:BPW`` budget counts: ``level_bits`` {level: bits per weight as stored}, ``fixed_bits``
    (the bits stored whatever the plan: tensors written as they are, file headers; an upper bound) and
    ``parameters`` (the weights the budget is per: the whole model's)."""
    level_bits: Dict[str, float]
    fixed_bits: float
    parameters: int

    def planned_budget(self, budget_bpw: float, planned: int) -> float:
        """The bits per weight ``budget_bpw`` leaves the ``planned`` weights the plan chooses formats for."""
        return (budget_bpw * self.parameters - self.fixed_bits) / max(planned, 1)

    def smallest(self, lowest: str, planned: int) -> float:
        """The smallest stored budget: every one of the ``planned`` weights in ``lowest``."""
        return (self.fixed_bits + self.level_bits[lowest] * planned) / max(self.parameters, 1)

    def check(self, recipe: str, budget_bpw: float, levels: List[str], planned: int,
              lowest_bits: Optional[float] = None) -> None:
        """ValueError naming ``recipe`` and the smallest stored budget when ``budget_bpw`` is below it;
        ``lowest_bits``: the planned tensors' bits in the lowest level each takes (:func:`fits`; default: every
        one in ``levels[0]``)."""
        floor = (self.smallest(levels[0], planned) if lowest_bits is None
                 else (self.fixed_bits + lowest_bits) / max(self.parameters, 1))
        if budget_bpw < floor - 1e-9:
            ask = math.ceil(floor * 100 - 1e-6) / 100
            family = "".join(":" + f for f in recipe.split(":")[2:3])  # auto:BPW:FAMILY keeps its family
            each = (f"every planned tensor in {levels[0]}" if not any(get_format(f).group for f in levels)
                    else f"each planned tensor in the cheapest of {levels[0]}, {levels[1]}, ... its rows divide into")
            raise BudgetTooSmall(
                f"recipe '{recipe}': the budget is below the smallest plan: {floor:.3f} stored bits/weight ({each}, "
                f"plus {self.fixed_bits / max(self.parameters, 1):.3f} bits/weight "
                f"of tensors kept as they are and file headers); ask for auto:{ask:g}{family} or more")


def ladder(anchor_format: str, family: Optional[str] = None, extra_groups: Sequence[int] = (),
           group: int = DERIVED_GROUP_SIZE) -> List[str]:
    """Candidate formats, fewest bits first: the anchor's family none above the anchor, or every
    derived affine width (``family="affine"``, reachable from any MX anchor) in groups of ``group``, and in each
    of ``extra_groups`` as grouped formats (``affine3@g128``: a tensor takes one only when its rows divide
    into its groups, :func:`fits`), ordered by their bits/weight."""
    if family == "affine":
        levels = list(LADDERS["affine"]) + [grouped(f, g) for f in LADDERS["affine"] for g in extra_groups if g != group]
        return sorted(levels, key=lambda f: get_format(f).bits_per_weight(group_of_derived(f, group)))
    if extra_groups:
        raise ValueError(f"several group sizes are for the affine family (auto:BPW:affine), not {family or anchor_format}")
    f = get_format(anchor_format)
    return [c for c in LADDERS[f.family] if get_format(c).bits <= f.bits]


def fits(shape: Sequence[int], fmt: str) -> bool:
    """True when a tensor of ``shape`` can be stored in ``fmt``: always, but for a grouped format
    (``affine3@g128``), whose group must divide the rows (the last dimension)."""
    group = get_format(fmt).group
    return not group or int(shape[-1]) % group == 0


def plain_levels(levels: List[str]) -> List[str]:
    """The levels every planned tensor can take (not the grouped ones: :func:`fits`)."""
    return [f for f in levels if not get_format(f).group]


def level_group(anchor: Anchor, fmt: str, derived_group: int = DERIVED_GROUP_SIZE) -> int:
    """The group size a level is stored with: the anchor's block size, or the derived group."""
    return group_of_derived(fmt, derived_group) if is_derived(fmt) else anchor.meta.get("block_size", 32)


def anchor_values(anchor: Anchor, name: str) -> torch.Tensor:
    """Tensor ``name``'s values in the anchor (float32): what the derived formats re-quantize."""
    return anchor.quantized[name].dequantize(torch.float32) if name in anchor.quantized else anchor.plain[name].float()


def in_format(anchor: Anchor, name: str, fmt: str, derived_group: int = DERIVED_GROUP_SIZE,
              values: Optional[torch.Tensor] = None) -> MXTensor:
    """Tensor ``name`` in ``fmt``: Slice-and-Scale from the anchor (derived: re-quantized from its
    values, ``values`` when the caller holds them: anchor_values), or direct for plain weights."""
    if is_derived(fmt):
        if name in anchor.quantized:  # with the anchor's learned scales for that width, if any
            return anchor.derived(name, fmt, derived_group, values)
        return derive(anchor_values(anchor, name) if values is None else values, fmt, derived_group)
    if name in anchor.quantized:
        return slice_and_scale(anchor.quantized[name], fmt)
    return quantize(anchor.plain[name].float(), fmt, anchor.meta.get("block_size", 32),
                    scale_rule=DEFAULT_SCALE_RULE.get(canonical_name(fmt), "floor"))


def in_format_chunks(anchor: Anchor, name: str, fmt: str, derived_group: int = DERIVED_GROUP_SIZE,
                     rows: int = 1024):
    """Tensor ``name`` in ``fmt`` as :func:`in_format` gives it, ``rows`` rows at a time: (lo, hi, MXTensor) of
    rows lo:hi. Blocks and groups run along the last axis, so rows are independent and the chunks are the
    rows of the whole; not for a width with learned scales (``anchor.learned_scales``: applied to whole tensors)."""
    src = anchor.quantized[name] if name in anchor.quantized else anchor.plain[name]
    n = src.shape[0]
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        if isinstance(src, MXTensor):
            part = src.rows(lo, hi)
            yield lo, hi, (derive(part.dequantize(torch.float32), fmt, derived_group) if is_derived(fmt)
                           else slice_and_scale(part, fmt))
        elif is_derived(fmt):
            yield lo, hi, derive(src[lo:hi].float(), fmt, derived_group)
        else:
            yield lo, hi, quantize(src[lo:hi].float(), fmt, anchor.meta.get("block_size", 32),
                                   scale_rule=DEFAULT_SCALE_RULE.get(canonical_name(fmt), "floor"))


def level_bits(levels: List[str], group: int = 32) -> Dict[str, float]:
    """{level: stored bits/weight} with ``group``-sized scales (and biases, for affine levels; a grouped level
    with its own group)."""
    return {f: get_format(f).bits_per_weight(get_format(f).group or group) for f in levels}


def probe_for(budget_bpw: float, levels: List[str], group: int = 32, bits: Optional[Dict[str, float]] = None) -> str:
    """The level just below the one the budget affords uniformly (the lowest level at least); levels cost
    ``bits`` {level: bits/weight} (default: :func:`level_bits` at ``group``)."""
    bpw = bits or level_bits(levels, group)
    affordable = [f for f in levels if bpw[f] <= budget_bpw] or levels[:1]
    i = levels.index(affordable[-1])
    return levels[max(i - 1, 0)]


def calibration_blocks(anchor: Anchor, calib_text: Optional[str], n_blocks: int = 4, seq_len: int = 128
                       ) -> torch.Tensor:
    """Calibration token blocks with the anchor's tokenizer (default text: the pydoc training split)."""
    from transformers import AutoTokenizer

    from mfqat.data.sources import calibration_blocks as blocks_of

    return blocks_of(AutoTokenizer.from_pretrained(str(anchor.path)), calib_text, n_blocks, seq_len)


class _ProbeKL:
    """KL(reference || model with one tensor changed) over ``blocks``, averaged over the tokens, on the anchor's
    model run lazily (mfqat.export.lazy_model: each module's weights read from the anchor as it runs, so the
    pass holds one module's weights at a time, not the model).

    ``replay=True`` (the default pass): each probe runs only the decoder layers from the first one
    its tensor feeds (mfqat.export.replay), the layers before it returning their reference outputs:
    the same logits as a full forward, bit for bit. ``replay=False``: a full forward per probe (the
    plain pass, kept for comparison: scripts/bench/bench_auto.py, tests/test_sensitivity.py)."""

    def __init__(self, anchor: Anchor, blocks: torch.Tensor, names: List[str], replay: bool = True):
        self.lazy, self.blocks = LazyModel(anchor, checkpoint_layers=False), blocks
        self.weights = anchor_source(anchor)
        model = self.lazy.model
        self.replay = LayerReplay(model) if replay else None
        self.start = start_layers(model, names) if replay else {}
        with torch.no_grad(), self.lazy.running(self.weights) as m:
            logits = self.replay.record(input_ids=blocks) if replay else m(input_ids=blocks).logits
        self.ref = torch.log_softmax(logits.float(), dim=-1)
        self.p_ref = self.ref.exp()

    def __call__(self, name: str, value: torch.Tensor) -> float:
        """The KL with tensor ``name`` (by its anchor name) set to ``value``, every other tensor the anchor's."""
        def source(n: str) -> torch.Tensor:
            return value if n == name else self.weights(n)

        with torch.no_grad(), self.lazy.running(source) as model:
            if self.replay is None:
                logits = model(input_ids=self.blocks).logits
            else:
                logits = self.replay.logits_from(self.start[name], input_ids=self.blocks)
            low = torch.log_softmax(logits.float(), dim=-1)
        return (self.p_ref * (self.ref - low)).sum(-1).mean().item()


def measure(anchor: Anchor, names: List[str], probe: str, blocks: torch.Tensor,
            levels: Optional[List[str]] = None, derived_group: int = DERIVED_GROUP_SIZE,
            replay: bool = True) -> Dict[str, TensorSensitivity]:
    """KL(anchor-format model || model with only tensor t in ``probe``) for every tensor, plus each
    tensor's relative weight error at every level (default: the anchor family's ladder).
    ``replay=False``: a full forward per tensor (the same numbers, slower; see _ProbeKL). The model is
    never held: each forward reads its modules' weights from the anchor (read lazily or not) as they run."""
    levels = levels or ladder(anchor.format)
    if probe not in levels:
        raise ValueError(f"sensitivity: the probe format {probe} is not one of the levels {', '.join(levels)}")
    kl_of = _ProbeKL(anchor, blocks, names, replay)
    out: Dict[str, TensorSensitivity] = {}
    for name in progress(names, desc=f"sensitivity (probe {probe})"):
        own = [f for f in levels if fits(anchor.shape(name), f)]
        if probe not in own:
            raise ValueError(f"sensitivity: {name} {tuple(anchor.shape(name))} cannot be stored in the probe format "
                             f"{probe}; probe with a format every tensor takes")
        rows = _chunk_rows(anchor, name, own, derived_group)
        if rows is None:
            errors, probe_w = _errors_whole(anchor, name, own, probe, derived_group, kl_of.weights(name))
        else:
            errors, probe_w = _errors_in_chunks(anchor, name, own, probe, derived_group, rows)
        kl = kl_of(name, probe_w)
        out[name] = TensorSensitivity(name, probe_w.numel(), probe, max(kl, 0.0), errors)
        del probe_w
    return out


def _errors_whole(anchor: Anchor, name: str, levels: List[str], probe: str, derived_group: int,
                  original: torch.Tensor) -> tuple:
    """({level: squared error of tensor ``name`` at that level / squared norm}, the tensor at ``probe``), whole."""
    errors = {}
    norm = original.pow(2).sum().item() or 1.0
    values = anchor_values(anchor, name) if any(is_derived(f) for f in levels) else None  # once, not per width
    probe_w = None
    for f in levels:
        w = in_format(anchor, name, f, derived_group, values).dequantize(torch.float32)
        errors[f] = (w - original).pow(2).sum().item() / norm
        if f == probe:
            probe_w = w
    return errors, probe_w


def _chunk_rows(anchor: Anchor, name: str, levels: List[str], derived_group: int) -> Optional[int]:
    """Rows per chunk when tensor ``name`` is measured in row chunks (a matrix of over :data:`CHUNK_ELEMENTS`
    elements, with no width the anchor stores learned scales for), else None (whole)."""
    from mfqat.anchor.learned_scales import pick

    shape = anchor.shape(name)
    if len(shape) != 2 or shape[0] * shape[1] <= CHUNK_ELEMENTS:
        return None
    if name in anchor.quantized and any(is_derived(f) and pick(anchor.learned_scales, f, group_of_derived(f, derived_group))
                                        for f in levels):
        return None
    return max(1, ROWS_ELEMENTS // shape[1])


def _errors_in_chunks(anchor: Anchor, name: str, levels: List[str], probe: str, derived_group: int,
                      rows: int) -> tuple:
    """:func:`_errors_whole` a block of ``rows`` rows at a time: one float32 copy of the tensor (the probe's) instead
    of five (the anchor's values twice, a level's, the probe's and the derivation's). The sums run in another
    order, so an error may differ from the whole tensor's in its last digits."""
    src = anchor.quantized.get(name)
    plain = anchor.plain[name] if src is None else None  # read once (a lazy anchor reads it at each lookup)
    probe_w = torch.empty(tuple(anchor.shape(name)), dtype=torch.float32)
    sums = dict.fromkeys(levels, 0.0)
    norm = 0.0
    for i, f in enumerate(levels):
        for lo, hi, q in in_format_chunks(anchor, name, f, derived_group, rows):
            original = src.rows(lo, hi).dequantize(torch.float32) if src is not None else plain[lo:hi].float()
            w = q.dequantize(torch.float32)
            sums[f] += (w - original).pow(2).sum().item()
            if i == 0:
                norm += original.pow(2).sum().item()
            if f == probe:
                probe_w[lo:hi] = w
    return {f: v / (norm or 1.0) for f, v in sums.items()}, probe_w


def allocate(sens: Dict[str, TensorSensitivity], levels: List[str], budget_bpw: float, group: int = 32,
             stored: Optional[StoredCost] = None) -> Dict[str, str]:
    """Per-tensor formats minimising the summed estimated KL within the budget: with ``stored``, the bits
    the export stores (levels at ``stored.level_bits``, plus ``stored.fixed_bits``) over
    ``stored.parameters`` at most ``budget_bpw``; without, the mean nominal bits/weight of the tensors in
    ``sens`` (every level with ``group``-sized scales) at most ``budget_bpw``."""
    total = sum(s.numel for s in sens.values())
    if stored is None:
        stored = StoredCost(level_bits(levels, group), 0.0, total)
    bpw = stored.level_bits
    cap = budget_bpw * stored.parameters - stored.fixed_bits
    level = {n: _next_level(s, levels, -1) for n, s in sens.items()}  # each tensor's lowest level it fits
    used = sum(bpw[levels[i]] * sens[n].numel for n, i in level.items())
    if used > cap + 1e-6:
        stored.check(f"auto:{budget_bpw}", budget_bpw, levels, total, lowest_bits=used)

    exact = _allocate_exact(sens, levels, bpw, cap - sum(bpw[levels[0]] * s.numel for s in sens.values()))
    if exact is not None:
        return exact

    def gain(n: str, room: float = math.inf):
        """The upgrade of tensor ``n`` within ``room`` extra bits with the largest sensitivity reduction per extra
        bit, to a level it fits: the next one, or a later one that buys more per bit (a grouped level such as
        affine3 -> affine3@g32 can buy little before affine4@g128 buys much)."""
        i, s = level[n], sens[n]
        best = None
        j = _next_level(s, levels, i)
        while j is not None:
            extra = (bpw[levels[j]] - bpw[levels[i]]) * s.numel
            ratio = (s.at(levels[i]) - s.at(levels[j])) / extra
            if extra <= room + 1e-6 and (best is None or ratio > best[0]):
                best = (ratio, extra, j)
            j = _next_level(s, levels, j)
        return best

    heap = []
    for n in sens:
        g = gain(n)
        if g:
            heapq.heappush(heap, (-g[0], n, g[1], g[2]))
    while heap:
        _, n, extra, j = heapq.heappop(heap)
        if used + extra > cap + 1e-6:  # does not fit: this tensor's best upgrade that still does (cheaper ones of
            g = gain(n, cap - used)    # other tensors still may too)
            if g:
                heapq.heappush(heap, (-g[0], n, g[1], g[2]))
            continue
        used += extra
        level[n] = j
        g = gain(n, cap - used)
        if g:
            heapq.heappush(heap, (-g[0], n, g[1], g[2]))
    return {n: levels[i] for n, i in level.items()}


def lowest_bits(anchor: Anchor, names: List[str], levels: List[str], bits: Dict[str, float]) -> float:
    """The bits of tensors ``names``, each in the cheapest of ``levels`` it fits (:func:`fits`; ``bits``: a level's
    bits/weight): the smallest plan's."""
    return sum(min(bits[f] for f in levels if fits(anchor.shape(n), f)) * int(torch.Size(anchor.shape(n)).numel())
               for n in names)


def _next_level(s: TensorSensitivity, levels: List[str], i: int) -> Optional[int]:
    """The index of the first level above ``levels[i]`` tensor ``s`` can take (its rows divide into the level's
    groups, :func:`fits`: it has a measured error there), or None."""
    return next((j for j in range(i + 1, len(levels)) if levels[j] in s.rel_error), None)


def _allocate_exact(sens: Dict[str, TensorSensitivity], levels: List[str], bpw: Dict[str, float],
                    slack_bits: float, max_states: int = 50_000_000) -> Optional[Dict[str, str]]:
    """The minimum of the summed estimated KL with at most ``slack_bits`` above the all-lowest plan:
    dynamic programming over the extra bits in units of their greatest common divisor; None when
    the table would exceed ``max_states`` entries or a width is not a multiple of 1/64 bit."""
    import math

    import numpy as np

    names = list(sens)
    extra = {}  # extra bits over the lowest level, in 1/64 bit, per (tensor, level)
    for n in names:
        q = [(bpw[f] - bpw[levels[0]]) * 64 for f in levels]
        if any(abs(v - round(v)) > 1e-9 for v in q):
            return None
        extra[n] = [int(round(v)) * sens[n].numel for v in q]
    unit = math.gcd(*[e for row in extra.values() for e in row]) or 1
    cap = int(math.floor(slack_bits * 64 / unit + 1e-6))
    if (cap + 1) * len(names) * len(levels) > max_states:
        return None
    best = np.zeros(cap + 1)  # least cost of the tensors so far within s units
    choices = []
    for n in names:
        new, pick = np.full(cap + 1, np.inf), np.zeros(cap + 1, dtype=np.int8)
        for j, f in enumerate(levels):
            w = extra[n][j] // unit
            if w > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[w:] = best[: cap + 1 - w] + sens[n].at(f)
            better = cand < new
            new[better], pick[better] = cand[better], j
        best = new
        choices.append(pick)
    if not np.isfinite(best[cap]):  # no plan within the budget has a finite cost (a NaN probe): the greedy one
        return None
    plan, s = {}, cap
    for n, pick in zip(reversed(names), reversed(choices)):
        j = int(pick[s])
        plan[n] = levels[j]
        s -= extra[n][j] // unit
    return {n: plan[n] for n in names}


def auto_plan_formats(anchor: Anchor, names: List[str], budget_bpw: float, calib_text: Optional[str] = None,
                      n_blocks: int = SENSITIVITY_BLOCKS, seq_len: int = 128, family: Optional[str] = None,
                      derived_group: int = DERIVED_GROUP_SIZE, stored: Optional[StoredCost] = None,
                      recipe: Optional[str] = None, extra_groups: Sequence[int] = ()) -> tuple[Dict[str, str], dict]:
    """(per-tensor formats, report) for ``auto:BPW[:affine]``; the report holds every sensitivity. ``stored``:
    the budget counts the stored bytes (mfqat.export.recipes.stored_cost), checked before anything is
    measured; None: the nominal bits/weight of ``names`` alone. ``extra_groups``: affine levels in these groups
    too, for the tensors whose rows divide into them (:func:`ladder`)."""
    levels = ladder(anchor.format, family, extra_groups, derived_group)
    group = level_group(anchor, plain_levels(levels)[0], derived_group)
    planned = sum(int(torch.Size(anchor.shape(n)).numel()) for n in names)
    stored = stored or StoredCost(level_bits(levels, group), 0.0, planned)
    bits = stored.level_bits  # a level stored in no fewer bytes than a wider one only adds error (mxfp6: mxfp8 bytes)
    levels = [f for i, f in enumerate(levels) if all(bits[g] > bits[f] for g in levels[i + 1:])]
    stored.check(recipe or f"auto:{budget_bpw}", budget_bpw, levels, planned, lowest_bits(anchor, names, levels, bits))
    probe = probe_for(stored.planned_budget(budget_bpw, planned), plain_levels(levels), group, stored.level_bits)
    blocks = calibration_blocks(anchor, calib_text, n_blocks, seq_len)
    sens = measure(anchor, names, probe, blocks, levels, derived_group)
    formats = allocate(sens, levels, budget_bpw, group, stored)
    report = {"budget_bpw": budget_bpw, "probe_format": probe, "levels": levels, "group_size": group,
              **({"extra_groups": list(extra_groups)} if extra_groups else {}),
              "stored_level_bits": dict(stored.level_bits), "fixed_bits": stored.fixed_bits,
              "parameters": stored.parameters,
              "calibration_tokens": int(blocks.numel()),
              "tensors": {n: {**asdict(s), "chosen": formats[n], "estimated_kl": s.at(formats[n])}
                          for n, s in sens.items()}}
    return formats, report
