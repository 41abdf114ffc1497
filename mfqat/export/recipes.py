"""Per-tensor format plans for export: ``uniform:FMT`` and ``seed`` (docs/file-formats.md).

Tensors the anchor holds in MX codes are lowered by Slice-and-Scale (origin "anchor"), or for the
derived affine formats (``uniform:affine4``, ``seed:affine``, ``auto:BPW:affine``) re-quantized from the anchor's values
in MLX's own layout, groups of ``Plan.derived_group`` (``uniform:nvfp4``: blocks of 16; mfqat.quant.derive); 2-D
weights the anchor keeps in full precision (embeddings, an untied lm_head) are quantized
directly when the plan names a format for them (origin "ptq"), else kept in bfloat16.
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch

from mfqat._moved import renamed
from mfqat.anchor.checkpoint import Anchor
from mfqat.anchor.lazy import tensor_info, tensor_infos
from mfqat.quant.derive import DERIVED_GROUP_SIZE, check_reachable, derived_group, is_derived
from mfqat.formats import AFFINE_GROUP_SIZES, canonical_name, get_format
from mfqat.models import DENSE, Family, family_for, is_embedding, is_output_head
from mfqat.quant.mxtensor import MXTensor
from mfqat.anchor.learned_scales import pick
from mfqat.export.sensitivity import (SENSITIVITY_BLOCKS, StoredCost, auto_plan_formats, in_format, in_format_chunks,
                                      ladder, lowest_bits, plain_levels)
from mfqat.export.mlx_sizes import (anchor_parameters, check_mlx_group_size, header_entry_bound, resolve_scale_dtype,
                                    shard_overhead_bound, stored_bits)
from mfqat.storage.shard_files import MAX_SHARD_BYTES

FAMILY_BY_BITS = {
    "mxint": {b: f"mxint{b}" for b in range(2, 9)},
    "mxfp": {4: "mxfp4_e2m1", 5: "mxfp6_e2m3", 6: "mxfp6_e2m3", 7: "mxfp8_e4m3", 8: "mxfp8_e4m3"},
    "affine": {b: f"affine{b}" for b in (2, 3, 4, 5, 6, 8)},
}
RECIPES = ("uniform:FMT", "seed[:FAMILY]", "unsloth[:FAMILY]", "dynamic2[:FAMILY]", "auto:BPW[:FAMILY]")  # FAMILY: mxint, mxfp or affine
# Matrices above this many elements are lowered, written and checked in row chunks (Plan.chunk_rows): an
# embedding of 150M entries would otherwise take several float32 copies at once.
CHUNK_ELEMENTS = 8 * 1024 ** 2
AFFINE_BITS = {2: 2, 3: 3, 4: 4, 5: 5, 6: 6, 7: 8, 8: 8}  # MLX affine has no 7-bit mode: mxint7 goes in 8


def mlx_storage(fmt) -> Optional[Tuple[str, int]]:
    """(MLX quantization mode, bits) that carries ``fmt`` code-for-code (docs/file-formats.md), or None for
    mxfp8_e5m2, which is stored as bfloat16."""
    f = get_format(fmt)
    if f.family in ("mxint", "affine"):
        return "affine", AFFINE_BITS[f.bits]
    if f.name == "mxfp4_e2m1":
        return "mxfp4", 4
    if f.name in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp6_e3m2"):
        return "mxfp8", 8
    if f.family == "nvfp4":
        return "nvfp4", 4
    return None


@dataclass
class LearnedScales:
    """The scales (and affine biases) ``--refine`` learned for one planned tensor. Refine keeps the tensor's derived
    codes, so a refined plan holds these few bytes a group and :meth:`Plan.tensor` derives the codes again when
    the tensor is written or checked, instead of holding every tensor's codes (a byte a weight) from the end of
    the refine to the end of the export."""

    scales: torch.Tensor
    biases: Optional[torch.Tensor] = None

    def on(self, q: MXTensor) -> MXTensor:
        """``q`` (the derived tensor: its codes) with these scales and biases."""
        return dataclasses.replace(q, scales=self.scales, biases=self.biases)

    def rows(self, lo: int, hi: int) -> "LearnedScales":
        """The scales and biases of a matrix's rows lo:hi (groups run along the rows, so its chunks are rows)."""
        return LearnedScales(self.scales[lo:hi], None if self.biases is None else self.biases[lo:hi])


@dataclass
class LearnedExponents:
    """The E8M0 block exponents ``--refine`` chose for one MX tensor lowered from the anchor (mfqat.export.refine).
    An MX block's codes depend on its exponent, so :meth:`on` encodes the anchor's values again at these exponents
    (``mx_encode_blocks``, what the scale search's lowering does): an ordinary MX tensor of the planned format."""

    scales: torch.Tensor  # uint8 E8M0 bytes, one per block (255: a non-finite block, kept)

    def on(self, a: MXTensor, fmt: str) -> MXTensor:
        """The anchor's tensor ``a`` lowered to ``fmt`` at these exponents (mfqat.quant.slice.slice_at_exponents)."""
        from mfqat.quant.reference import E8M0_BIAS, E8M0_NAN
        from mfqat.quant.slice import slice_at_exponents

        return slice_at_exponents(a, fmt, self.scales.to(torch.int32) - E8M0_BIAS, self.scales == E8M0_NAN)

    def chunks(self, a: MXTensor, fmt: str, rows: int):
        """(lo, hi, MXTensor) row chunks of :meth:`on` for a matrix (exponents run along the rows' blocks, so each
        chunk is the rows of the whole)."""
        for lo in range(0, a.shape[0], rows):
            hi = min(a.shape[0], lo + rows)
            yield lo, hi, LearnedExponents(self.scales[lo:hi]).on(a.rows(lo, hi), fmt)


@dataclass
class Plan:
    """{tensor name: format}, where each comes from, what stays 16-bit, the top-level entry."""
    formats: Dict[str, str] = field(default_factory=dict)
    origin: Dict[str, str] = field(default_factory=dict)
    kept16: Set[str] = field(default_factory=set)
    base_bits: int = 4
    base_mode: str = "affine"
    group_size: int = 32  # the anchor's block size, checked against what MLX takes (mlx_sizes.py)
    sensitivity: Optional[dict] = None  # auto:BPW - written beside the model as sensitivity.json
    derived_group: int = DERIVED_GROUP_SIZE  # group of the derived affine formats
    base_group: int = 32  # the config's top-level group size (that of the top-level format)
    family: Family = DENSE  # the model family's rules (mfqat.models): mlx-lm names, what stays high precision
    # export --refine's learned scales (LearnedScales: the codes are derived again; LearnedExponents: the codes
    # are encoded again from the anchor's values) or whole tensors (MXTensor)
    learned_scales: Dict[str, "LearnedScales | LearnedExponents | MXTensor"] = field(default_factory=dict)
    refined = renamed("Plan", "refined", "learned_scales")

    def group_of(self, fmt: str) -> int:
        """MLX group size of a tensor in ``fmt``."""
        return derived_group(fmt, self.derived_group) if is_derived(fmt) else self.group_size

    def tensors(self, anchor: Anchor) -> Dict[str, MXTensor]:
        """Every planned tensor as an MXTensor in its planned format (sensitivity.in_format); all in memory
        at once: streaming steps ask :meth:`tensor` one name at a time."""
        return {name: self.tensor(anchor, name) for name in self.formats}

    def tensor(self, anchor: Anchor, name: str) -> MXTensor:
        """One planned tensor in its planned format (with its learned scales when ``--refine`` learned them)."""
        learned = self.learned_scales.get(name)
        if isinstance(learned, MXTensor):
            return learned
        if isinstance(learned, LearnedExponents):
            return learned.on(anchor.quantized[name], self.formats[name])
        q = in_format(anchor, name, self.formats[name], self.derived_group)
        return q if learned is None else learned.on(q)

    def chunk_rows(self, anchor: Anchor, name: str, elements: Optional[int] = None) -> Optional[int]:
        """Rows per chunk when tensor ``name`` is large enough to be lowered, written and checked in row
        chunks (a 2-D matrix of over ``elements`` elements, default :data:`CHUNK_ELEMENTS` read at the call,
        written under one mlx-lm name: learned scales, MX exponents and codes the plan holds, GPTQ's, are cut with it),
        else None (whole)."""
        elements = CHUNK_ELEMENTS if elements is None else elements
        shape = anchor.shape(name)
        fmt = self.formats[name]
        held = isinstance(self.learned_scales.get(name), MXTensor)  # its codes in the plan: rows of them, not derived
        if len(shape) != 2 or shape[0] * shape[1] <= elements:
            return None
        if not held and name in anchor.quantized and is_derived(fmt) and pick(anchor.learned_scales, fmt,
                                                                            self.group_of(fmt)):
            return None
        if [(lo, hi) for _, lo, hi in self.family.mlx_pieces(name, shape[0])] != [(0, shape[0])]:
            return None
        return max(1, elements // shape[1])

    def tensor_chunks(self, anchor: Anchor, name: str, rows: int):
        """(lo, hi, MXTensor) row chunks of :meth:`tensor` (see :meth:`chunk_rows`)."""
        learned = self.learned_scales.get(name)
        if isinstance(learned, MXTensor):  # codes held whole (mfqat.export.gptq): cut, never derived again
            n = learned.shape[0]
            return ((lo, min(n, lo + rows), learned.rows(lo, min(n, lo + rows))) for lo in range(0, n, rows))
        if isinstance(learned, LearnedExponents):
            return learned.chunks(anchor.quantized[name], self.formats[name], rows)
        chunks = in_format_chunks(anchor, name, self.formats[name], self.derived_group, rows)
        if isinstance(learned, LearnedScales):
            return ((lo, hi, learned.rows(lo, hi).on(q)) for lo, hi, q in chunks)
        return chunks

    def mlx_modules(self, name: str, shape: tuple) -> List[str]:
        """The mlx-lm module paths that hold the tensor ``name`` (several for a split expert parameter)."""
        return [piece[: -len(".weight")] for piece, _, _ in self.family.mlx_pieces(name, shape[-2] if len(shape) > 1 else 1)]

    def module_entries(self, anchor: Anchor) -> Dict[str, object]:
        """Per-module quantization entries (mlx-lm module paths) that differ from the top level; False
        for 16-bit ones."""
        entries: Dict[str, object] = {}
        for name, fmt in self.formats.items():
            storage = mlx_storage(fmt)
            if storage is None:
                entry: object = False
            elif storage != (self.base_mode, self.base_bits) or self.group_of(fmt) != self.base_group:
                entry = {"group_size": self.group_of(fmt), "bits": storage[1], "mode": storage[0]}
            else:
                continue
            entries.update(dict.fromkeys(self.mlx_modules(name, _shape(anchor, name)), entry))
        for name in sorted(self.kept16):  # sorted: the same config.json bytes whatever the hash seed
            entries.update(dict.fromkeys(self.mlx_modules(name, _shape(anchor, name)), False))
        return entries

    def numels(self, anchor: Anchor) -> Dict[str, int]:
        """{planned tensor, by its mlx-lm weight name: element count} (a split expert parameter gives
        one entry per piece)."""
        out: Dict[str, int] = {}
        for name in self.formats:
            shape = _shape(anchor, name)
            rows = shape[-2] if len(shape) > 1 else 1
            per_row = int(torch.Size(shape).numel()) // max(rows, 1)
            for piece, lo, hi in self.family.mlx_pieces(name, rows):
                out[piece] = (hi - lo) * per_row
        return out

    def bits_per_weight(self, anchor: Anchor) -> float:
        """Average bits per weight over the Linear/Embedding weights (16 for kept ones)."""
        total_bits, total = 0.0, 0
        for name in list(self.formats) + sorted(self.kept16):
            n = int(torch.Size(anchor.shape(name)).numel())
            bpw = (get_format(self.formats[name]).bits_per_weight(self.group_of(self.formats[name]))
                   if name in self.formats else 16.0)
            total_bits += bpw * n
            total += n
        return total_bits / max(total, 1)


def stored_cost(anchor: Anchor, plan: Plan, names: List[str], levels: List[str], scale_dtype: str,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> StoredCost:
    """What ``auto:BPW`` counts, as mfqat.export.mlx_sizes.stored_size will count the written export: each
    level at the bits it is written in (``scale_dtype``: the affine scales' resolved dtype), and as fixed bits
    every tensor the writer takes as it is (not in ``names``: norms, biases, in bfloat16 or the float32 its
    family keeps) plus an upper bound on the safetensors headers (every written tensor's entry, the planned
    ones with a weight, scales and biases entry each), over the whole model's parameters."""
    family = plan.family
    level_bits = {f: stored_bits(mlx_storage(f), plan.group_of(f), scale_dtype, is_derived(f)) for f in levels}
    planned = set(names)
    entries: List[Tuple[str, tuple]] = []  # (written name, shape bound) of every header entry
    fixed = 0  # bytes of the tensors written as they are
    for name in anchor.plain:
        if name in planned:
            continue
        info = tensor_info(anchor.plain, name)
        shape = tuple(info.shape)
        if info.dtype.is_floating_point:
            if family.plain_rule(name) is not None:  # a rule may change the shape mlx-lm runs it in
                shape = tuple(family.mlx_value(name, anchor.plain[name].float()).shape)
            itemsize = 4 if family.float32_on_export(name) else 2
        else:
            itemsize = info.dtype.itemsize
        fixed += int(torch.Size(shape).numel()) * itemsize
        entries.append((family.mlx_name(name), shape))
    top = max(level_bits.values())
    data = fixed
    for name in names:
        shape = _shape(anchor, name)
        data += int(torch.Size(shape).numel()) * top / 8
        for piece, lo, hi in family.mlx_pieces(name, shape[-2] if len(shape) > 1 else 1):
            module = piece[: -len(".weight")]
            bound = tuple(shape[:-2]) + (hi - lo, shape[-1])  # no part's dimension has more digits than these
            entries += [(f"{module}.{kind}", bound) for kind in ("weight", "scales", "biases")]
    digits = len(str(int(data)))
    headers = shard_overhead_bound(int(data), max_shard_bytes) + sum(header_entry_bound(n, sh, digits)
                                                                      for n, sh in entries)
    return StoredCost(level_bits, 8.0 * (fixed + headers), anchor_parameters(anchor))


def _matrix_weights(anchor: Anchor) -> List[str]:
    """Plain 2-D weights that MLX can quantize (embeddings, untied lm_head), in-features divisible
    by the anchor's block size; not those the model's family keeps in high precision (routers)."""
    bs = anchor.meta.get("block_size", 32)
    family = family_for((anchor.config or {}).get("model_type"))
    infos = {k: tensor_info(anchor.plain, k) for k in anchor.plain}
    return [k for k, v in infos.items()
            if k.endswith(".weight") and len(v.shape) == 2 and v.dtype.is_floating_point and v.shape[-1] % bs == 0
            and not family.kept_high(k) and not family.tower(k)]


def _seed_high(anchor: Anchor, family: Family) -> List[str]:
    """Plain 2-D weights the family keeps high in general that its seed table quantizes (Qwen3.5's routers at 8
    bits, as mlx-lm's own quant_predicate does)."""
    bs = anchor.meta.get("block_size", 32)
    infos = {k: tensor_info(anchor.plain, k) for k in anchor.plain}
    return [k for k, v in infos.items() if len(v.shape) == 2 and v.dtype.is_floating_point and v.shape[-1] % bs == 0
            and family.seed_quantizes(k)]


def drop_towers(anchor: Anchor) -> Optional[List[dict]]:
    """Leave the anchor's towers (a vision-language release's vision encoder, ``Family.towers``) out of an
    mlx-lm export: their tensors are removed from this in-memory ``anchor`` (never from disk), so the plan,
    the writer, the stored size and the check see the text model mlx-lm loads, as ``mlx_lm.convert`` drops
    them. Returns the report's ``dropped`` entry ([{"why", "tensors", "parameters", "examples"}], one per
    tower) and warns; None when there is nothing to drop."""
    import warnings

    family = family_for((anchor.config or {}).get("model_type"))
    found: Dict[str, List[str]] = {}
    for name in list(anchor.plain) + list(anchor.quantized):
        why = family.tower(name)
        if why:
            found.setdefault(why, []).append(name)
    if not found:
        return None
    out = []
    for why, names in found.items():
        count = sum(int(torch.Size(_shape(anchor, n)).numel()) for n in names)
        for n in names:
            anchor.plain.pop(n, None)
            anchor.quantized.pop(n, None)
        out.append({"why": why, "tensors": len(names), "parameters": count, "examples": sorted(names)[:3]})
        warnings.warn(f"{anchor.path}: the export leaves out {len(names)} tensors ({count} parameters) of the "
                      f"{why}", stacklevel=3)
    return out


def check_family(anchor: Anchor) -> Family:
    """The anchor's model family; refuses, before anything is written, a family mlx-lm cannot load and
    3-D weights (fused experts) that no rule of the family lays out for mlx-lm."""
    model_type = (anchor.config or {}).get("model_type")
    family = family_for(model_type)
    if family.export_refusal:
        raise ValueError(f"{anchor.path}: cannot export {model_type} to MLX: {family.export_refusal}")
    infos = {k: tensor_info(anchor.plain, k) for k in anchor.plain}
    odd = [k for k, v in infos.items() if len(v.shape) >= 3 and v.dtype.is_floating_point and "conv" not in k
           and not family.tower(k)]
    if odd:
        raise ValueError(f"{anchor.path}: mfqat has no MLX layout for {model_type}'s {odd[0]} {tuple(infos[odd[0]].shape)}"
                         f"{f' (and {len(odd) - 1} more)' if len(odd) > 1 else ''}; exporting it would give a model "
                         "mlx_lm cannot load (supported families: README, 'Model families')")
    family.mlx_config(dict(anchor.config or {}))  # a config mlx-lm cannot build raises here, before writing
    return family


def _plan_by_bits(plan: Plan, anchor: Anchor, family: str, names: List[str],
                  bits_of: Callable[[str], Optional[int]]) -> None:
    """Plan each of ``names`` at ``bits_of(name)`` bits in ``family`` (None: kept in bfloat16), the width
    capped by the anchor's for MX families; from the anchor's codes where it has them, else by PTQ."""
    for name in names:
        bits = bits_of(name)
        if bits is None:
            plan.kept16.add(name)
            continue
        plan.formats[name] = _fmt_for_bits(family, bits, 8 if family == "affine" else get_format(anchor.format).bits)
        plan.origin[name] = "anchor" if name in anchor.quantized else "ptq"


def _fmt_for_bits(family: str, bits: int, anchor_bits: int) -> str:
    table = FAMILY_BY_BITS[family]
    bits = max(min(bits, anchor_bits, max(table)), min(table))
    while bits not in table:
        bits += 1
    return table[bits]


def seed_bits(name: str, base: int, tied: bool, family: Family = DENSE) -> Optional[int]:
    """The seed table, by the roles ``family`` gives its projections (mfqat.models; the default, a type with
    no family file, knows every family's names): embeddings +2 (lm_head +3; tied: the shared table counts
    as lm_head), attention inputs +2 (q/k/v, fused qkv, MLA projections, Gated DeltaNet's qkv/z), the MLP's
    output projection +1 (experts' included), the MLP's inputs base, attention outputs kept at 8 bits."""
    if is_embedding(name):
        return base + (3 if tied else 2)
    if is_output_head(name):
        return base + 3
    if family.has_role(name, "attention_inputs"):
        return base + 2
    if family.has_role(name, "mlp_outputs"):
        return base + 1
    if family.has_role(name, "attention_outputs"):
        return 8
    return base


def dynamic2_bits(name: str, base: int, family: Family = DENSE) -> Optional[int]:
    """The ``dynamic2`` recipe (the per-tensor rules of Unsloth's Dynamic 2.0 quants as ported to MLX for
    Qwen3.5, over every family's roles): the attention outputs ``family`` names (Llama's output projection,
    Gated DeltaNet's, GPT-NeoX's) stay in bfloat16 (None: no norm precedes them, so AWQ cannot protect
    their inputs); embeddings and lm_head 8 bits; everything else (attention inputs, MLPs, experts)
    ``base`` bits. Routers and gates stay high precision by their family's rule."""
    if family.has_role(name, "attention_outputs"):
        return None
    if is_embedding(name) or is_output_head(name):
        return 8
    return base


def _shape(anchor: Anchor, name: str) -> tuple:
    return anchor.shape(name)


def _check_group_size(anchor: Anchor, names, group: int = 0) -> None:
    bs = group or anchor.meta.get("block_size", 32)
    for name in names:
        if _shape(anchor, name)[-1] % bs:
            raise ValueError(f"{name}: shape {_shape(anchor, name)} is not divisible by the MLX group size {bs}")


def parse_recipe(recipe: str) -> Tuple[str, Optional[str], Optional[str]]:
    """(kind, argument, family): ``uniform:FMT`` -> ("uniform", FMT, its family); ``seed[:FAMILY]``
    -> ("seed", None, FAMILY or None); ``auto:BPW[:FAMILY]`` -> ("auto", BPW, FAMILY or None)."""
    kind, _, rest = recipe.partition(":")
    kind = "seed" if kind == "unsloth" else kind  # the name for the Qwen3.5 table (Family.seed_table)
    if kind == "uniform" and rest:
        return kind, canonical_name(rest), get_format(rest).family
    if kind in ("seed", "dynamic2"):
        return kind, None, rest or None
    if kind == "auto" and rest:
        budget, _, family = rest.partition(":")
        return kind, budget, family or None
    raise ValueError(f"unknown recipe '{recipe}'; choose one of {RECIPES}")


def _most_weights(anchor: Anchor, formats: Dict[str, str]) -> str:
    """The format holding the most weights (the config's top-level entry)."""
    count: Dict[str, int] = {}
    for name, fmt in formats.items():
        count[fmt] = count.get(fmt, 0) + int(torch.Size(_shape(anchor, name)).numel())
    return max(count, key=count.get)


def ptq_anchor_format(recipe: str) -> str:
    """The anchor format a full-precision model is quantized to before export: the 8-bit format of
    the recipe's family (mxint8, mxfp8_e4m3; an 8-bit uniform format itself, e.g. mxfp8_e5m2)."""
    kind, arg, family = parse_recipe(recipe)
    if kind == "uniform" and get_format(arg).bits == 8:
        return arg
    if family not in (None, "mxint", "mxfp", "affine", "nvfp4"):
        raise ValueError(f"recipe '{recipe}': unknown family '{family}'; choose mxint, mxfp or affine")
    return {None: "mxint8", "mxint": "mxint8", "mxfp": "mxfp8_e4m3", "affine": "mxint8", "nvfp4": "mxfp8_e4m3"}[family]


Groups = Union[int, Sequence[int]]


def split_groups(derived_group: Groups, recipe: str = "") -> Tuple[int, Tuple[int, ...]]:
    """(the derived affine formats' group, the extra groups an ``auto:BPW:affine`` plan may also store a tensor in)
    from an export's group size: one group, or several (``--group-size 64,128``: the first is every tensor's, the
    others are levels of their own, ``affine3@g128``, for the tensors whose rows divide into them)."""
    groups = (derived_group,) if isinstance(derived_group, int) else tuple(derived_group)
    if len(groups) == 1:  # one group: checked against each tensor and MLX's sizes by the plan, naming the tensor
        return groups[0], ()
    if not groups or any(isinstance(g, bool) or g not in AFFINE_GROUP_SIZES for g in groups) \
            or len(set(groups)) != len(groups):
        raise ValueError(f"group sizes {list(groups)}: give one or more different MLX affine group sizes from "
                         f"{list(AFFINE_GROUP_SIZES)}")
    kind, _, family = parse_recipe(recipe) if recipe else ("auto", None, "affine")
    if kind != "auto" or family != "affine":
        raise ValueError(f"recipe '{recipe}': several group sizes ({','.join(map(str, groups))}) are levels of an "
                         "auto:BPW:affine plan; give one group for this recipe")
    return groups[0], groups[1:]


def check_stored_budget(anchor: Anchor, recipe: str, derived_group: Groups = DERIVED_GROUP_SIZE,
                        scale_dtype: str = "auto", max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """For ``auto:BPW[:FAMILY]`` with a number BPW: ValueError naming ``recipe`` and the smallest stored budget
    when BPW is below it, from the anchor's names and shapes alone (a lazily read ``anchor``: nothing loaded;
    the command line's check before the export starts). Other recipes, and anything else wrong with this
    one, are left to :func:`build_plan`."""
    import warnings

    kind, arg, want = parse_recipe(recipe)
    try:
        derived_group, extra = split_groups(derived_group, recipe)
        budget = float(arg) if kind == "auto" else math.nan
        levels = ladder(anchor.format, want, extra, derived_group)
    except (TypeError, ValueError, KeyError):
        return
    if not math.isfinite(budget):
        return
    with warnings.catch_warnings():  # drop_towers' warning comes again when the export itself runs
        warnings.simplefilter("ignore")
        drop_towers(anchor)
    plan = Plan(group_size=anchor.meta.get("block_size", 32), derived_group=derived_group, family=check_family(anchor))
    names = list(anchor.quantized) + _matrix_weights(anchor)
    scale_dtype = resolve_scale_dtype(scale_dtype, anchor.config or {}, tensor_infos(anchor.plain))
    planned = sum(int(torch.Size(_shape(anchor, n)).numel()) for n in names)
    stored = stored_cost(anchor, plan, names, levels, scale_dtype, max_shard_bytes)
    stored.check(recipe, budget, levels, planned, lowest_bits(anchor, names, levels, stored.level_bits))


def build_plan(anchor: Anchor, recipe: str, base_bits: int = 4, calib_text: Optional[str] = None,
               derived_group: Groups = DERIVED_GROUP_SIZE, scale_dtype: str = "auto",
               max_shard_bytes: int = MAX_SHARD_BYTES, sensitivity_blocks: int = SENSITIVITY_BLOCKS) -> Plan:
    """A per-tensor plan from a recipe name; checks everything before anything is written. ``auto:BPW``
    budgets the bytes the export will store (:func:`stored_cost`) with the affine scales in ``scale_dtype``
    ("auto": mlx_sizes.resolve_scale_dtype from the anchor's config) and shards of ``max_shard_bytes``.
    ``derived_group``: the derived affine formats' group, or several for ``auto:BPW:affine`` (:func:`split_groups`).
    ``sensitivity_blocks``: the calibration blocks of 128 tokens ``auto:BPW``'s sensitivity pass scores."""
    family = get_format(anchor.format).family
    kind, arg, want = parse_recipe(recipe)
    derived_group, extra_groups = split_groups(derived_group, recipe)
    if kind in ("seed", "dynamic2") and (isinstance(base_bits, bool) or not isinstance(base_bits, int)
                                         or not 2 <= base_bits <= 8):
        raise ValueError(f"recipe '{recipe}': base_bits must be an integer from 2 to 8 (the bits of the recipe's "
                         f"base format), got {base_bits!r}")
    if want == "nvfp4" and kind != "uniform":
        raise ValueError(f"recipe '{recipe}': nvfp4 has one width; write uniform:nvfp4")
    if want in ("affine", "nvfp4"):
        family = want  # derived from the anchor (mfqat.quant.derive), not sliced
    elif want is not None and want != family:
        raise ValueError(f"recipe '{recipe}' asks for the {want} family but the anchor is {anchor.format} "
                         f"({family}): Slice-and-Scale stays inside one MX family")
    plan = Plan(group_size=anchor.meta.get("block_size", 32), derived_group=derived_group,
                family=check_family(anchor))
    tied = bool(anchor.meta.get("tied"))
    if kind == "uniform":
        fmt = arg
        check_reachable(anchor.format, fmt, name=str(anchor.path))
        for name in anchor.quantized:
            plan.formats[name], plan.origin[name] = fmt, "anchor"
        for name in _matrix_weights(anchor):
            plan.formats[name], plan.origin[name] = fmt, "ptq"
        top = get_format(fmt)
    elif kind == "seed":
        table = plan.family.seed_table or partial(seed_bits, family=plan.family)  # Qwen3.5: the design's table
        _plan_by_bits(plan, anchor, family, list(anchor.quantized) + _matrix_weights(anchor) +
                      _seed_high(anchor, plan.family), lambda name: table(name, base_bits, tied))
        top = get_format(_fmt_for_bits(family, base_bits, 8))
    elif kind == "dynamic2":
        _plan_by_bits(plan, anchor, family, list(anchor.quantized) + _matrix_weights(anchor),
                      lambda name: dynamic2_bits(name, base_bits, plan.family))
        top = get_format(_fmt_for_bits(family, base_bits, 8))
    elif kind == "auto":
        levels = ladder(anchor.format, want, extra_groups, derived_group)
        group = plan.group_of(plain_levels(levels)[0])
        for g in {plan.group_of(f) for f in levels}:
            check_mlx_group_size(g, [(anchor.format, mlx_storage(f)) for f in levels if plan.group_of(f) == g])
        try:
            budget = float(arg)
        except ValueError:
            raise ValueError(f"recipe '{recipe}': write the budget in bits per weight, e.g. auto:4.5") from None
        if not math.isfinite(budget):
            raise ValueError(f"recipe '{recipe}': the budget must be a finite number of bits per weight, "
                             "e.g. auto:4.5")
        names = list(anchor.quantized) + _matrix_weights(anchor)
        _check_group_size(anchor, names, group)
        scale_dtype = resolve_scale_dtype(scale_dtype, anchor.config or {}, tensor_infos(anchor.plain))
        stored = stored_cost(anchor, plan, names, levels, scale_dtype, max_shard_bytes)
        formats, plan.sensitivity = auto_plan_formats(anchor, names, budget, calib_text, family=want,
                                                      derived_group=derived_group, stored=stored, recipe=recipe,
                                                      extra_groups=extra_groups, n_blocks=sensitivity_blocks)
        for name, fmt in formats.items():
            plan.formats[name] = fmt
            plan.origin[name] = "anchor" if name in anchor.quantized else "ptq"
        top = get_format(_most_weights(anchor, formats))
    for name in _matrix_weights(anchor):
        if name not in plan.formats:
            plan.kept16.add(name)
    _check_group_size(anchor, [n for n, f in plan.formats.items() if not is_derived(f)])
    for fmt in {f for f in plan.formats.values() if is_derived(f)}:
        _check_group_size(anchor, [n for n, f in plan.formats.items() if f == fmt], plan.group_of(fmt))
    for name, fmt in plan.formats.items():
        if plan.origin[name] == "anchor":
            check_reachable(anchor.format, fmt, name=name)
    check_mlx_group_size(plan.group_size, [(n, mlx_storage(f)) for n, f in plan.formats.items() if not is_derived(f)])
    for fmt in {f for f in plan.formats.values() if is_derived(f)}:
        check_mlx_group_size(plan.group_of(fmt), [(n, mlx_storage(f)) for n, f in plan.formats.items() if f == fmt])
    plan.base_mode, plan.base_bits = mlx_storage(top) or ("mxfp8", 8)
    plan.base_group = plan.group_of(top.name)
    return plan
