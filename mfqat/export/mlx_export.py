"""Export an anchor (or a plain HF model, post-training) to an MLX model directory.

Codes are carried over code-for-code, never re-quantized by MLX (docs/file-formats.md):

| source format                          | MLX storage                                  |
|----------------------------------------|----------------------------------------------|
| mxfp4                                  | mode "mxfp4" (uint32 words, uint8 E8M0)      |
| mxfp8_e4m3, mxfp6_e2m3, mxfp6_e3m2     | mode "mxfp8" (E4M3 bytes hold every value)   |
| mxint k                                | mode "affine", bits k (7 -> 8), group = the  |
|                                        | anchor's block size (32, 64 or 128),         |
|                                        | q_u = q + 2^(k-1), scale = 2^(s-(k-2)),      |
|                                        | bias = -2^(k-1) * scale                      |
| mxfp8_e5m2                             | bfloat16 (exact: every E5M2 value fits)      |
| nvfp4 (derived from an MX anchor)      | mode "nvfp4", group 16 (uint32 words, uint8  |
|                                        | E4M3 scales), no global scale                |

mxfp4 / mxfp8 modes take group 32 only; other block sizes are refused before writing (storage.py).
Packing is done here in torch/numpy; MLX is only used afterwards to verify every tensor.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Tuple, Union

import numpy as np
import torch

from mfqat.anchor.lazy import tensor_infos
from mfqat.anchor.learned_scales import pick
from mfqat.anchor.checkpoint import Anchor, AnchorError, read_anchor, save_anchor
from mfqat.anchor.stream import close_anchor
from mfqat.storage.shard_files import MAX_SHARD_BYTES
from mfqat.storage.tensor_files import DTYPES, NUMPY_NAMES, ShardWriter
from mfqat.progress import progress
from mfqat.quant.derive import DERIVED_GROUP_SIZE, is_derived
from mfqat.formats import get_format
from mfqat.models import family_for
from mfqat.storage.io import atomic_directory, write_json
from mfqat.storage.model_card import write_model_card
from mfqat.storage.manifest import seal
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.reference import E8M0_BIAS, exp2i, mx_codes_to_values, mx_values_to_codes
from mfqat.export.recipes import (AFFINE_BITS, LearnedExponents, LearnedScales, Plan, build_plan, drop_towers,
                                  ptq_anchor_format)
from mfqat.export.mlx_files import load_weights, save_sharded  # noqa: F401 (public here since 0.1)
from mfqat.export.mlx_sizes import anchor_parameters, resolve_scale_dtype, stored_size
from mfqat.export.sensitivity import SENSITIVITY_BLOCKS
from mfqat.export.verify import (EXPORT_FORMAT_VERSION, LOGIT_RTOL, WriteRecord, reference_state,  # noqa: F401 (public since 0.1)
                                 verify_export)

if TYPE_CHECKING:  # MLX is imported where it is used, so that exporting needs it only to verify
    from mfqat.export.gptq import GPTQConfig
    from mfqat.export.refine import RefineConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


@dataclass
class MLXTensor:
    """One module's MLX storage."""
    weight: np.ndarray
    scales: Optional[np.ndarray]
    biases: Optional[np.ndarray]
    mode: Optional[str]
    bits: Optional[int]
    exact: bool


def to_mlx_storage(q: MXTensor, scale_dtype: str = "float32") -> MLXTensor:
    """Lay one MX tensor out as MLX stores it (see module table)."""
    f = q.fmt
    rows = q.shape[:-1]
    if f.family == "affine":  # derived: MLX's own codes, scales and biases (mfqat.quant.derive)
        from mfqat.quant.packing import pack_codes
        words = pack_codes(q.codes, AFFINE_BITS[f.bits]).numpy().view(np.uint32)
        return MLXTensor(words, q.scales.numpy(), q.biases.numpy(), "affine", AFFINE_BITS[f.bits], True)
    if f.family == "mxint":
        bits = AFFINE_BITS[f.bits]
        qu = q.codes.to(torch.int32) + 2 ** (bits - 1)
        from mfqat.quant.packing import pack_codes
        words = pack_codes(qu, bits).numpy().view(np.uint32)
        s = q.scales.to(torch.int32) - E8M0_BIAS
        scale = exp2i((s - f.int_shift).clamp(-149, 127))  # the format's element scale 2^-(k-2)
        bias = -(2.0 ** (bits - 1)) * scale
        return MLXTensor(words, scale.numpy(), bias.numpy(), "affine", bits, True)
    if f.name == "mxfp4_e2m1":
        return MLXTensor(q.pack().numpy().view(np.uint32), q.scales.numpy(), None, "mxfp4", 4, True)
    if f.family == "nvfp4":  # E2M1 nibbles (element 0 low) and E4M3 bytes, as mx.quantize(mode="nvfp4") lays them
        if q.global_scale is not None:
            raise ValueError("nvfp4 with a global_scale has no mlx_lm Linear layout (QuantizedLinear takes none)")
        return MLXTensor(q.pack().numpy().view(np.uint32), q.scales.numpy(), None, "nvfp4", 4, True)
    if f.name in ("mxfp8_e4m3", "mxfp6_e2m3", "mxfp6_e3m2"):
        vals = mx_codes_to_values(q.codes, f)
        e4m3 = mx_values_to_codes(vals, get_format("mxfp8_e4m3"))
        return MLXTensor(e4m3.numpy().view(np.uint32).reshape(*rows, -1), q.scales.numpy(), None, "mxfp8", 8, True)
    # mxfp8_e5m2: dequantize to bf16 (every E5M2 value times a power of two fits bf16)
    return MLXTensor(q.dequantize(torch.float32).numpy(), None, None, None, None, True)


def mlx_model_config(config: dict) -> dict:
    """An HF config as mlx-lm reads it: no quantization entries, the rope keys flattened out of
    ``rope_parameters`` (transformers 5 moved them there; mlx-lm would silently use its own defaults),
    the family's own key fixes (mfqat.models, e.g. ``num_experts`` for Qwen3-MoE),
    ``tie_word_embeddings`` explicit."""
    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "quantization", "torch_dtype", "dtype")}
    cfg = family_for(cfg.get("model_type")).mlx_config(cfg)
    cfg["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    return cfg


def _config_for_mlx(config: dict, plan: Plan, anchor: Anchor) -> dict:
    cfg = mlx_model_config(config)
    quant = {"group_size": plan.base_group, "bits": plan.base_bits, "mode": plan.base_mode}
    for module, entry in plan.module_entries(anchor).items():
        quant[module] = entry
    cfg["quantization"] = quant
    cfg["quantization_config"] = quant
    return cfg


def plan_from_report(report: dict) -> Plan:
    """The per-tensor plan an export used, from its report / mfqat_export.json (no re-measuring)."""
    plan = Plan()
    for name, t in report["tensors"].items():
        if "origin" in t:
            plan.formats[name], plan.origin[name] = t["source"], t["origin"]
            if get_format(t["source"]).family == "affine" and "group_size" in t:
                if not get_format(t["source"]).group:  # a grouped format (affine3@g128) carries its own
                    plan.derived_group = t["group_size"]
            elif "group_size" in t:
                plan.group_size = t["group_size"]
        else:  # kept in 16 bits
            plan.kept16.add(name)
    return plan


def to_mlx(source, out_dir, recipe: str = "uniform:mxint4", base_bits: int = 4, verify: bool = True,
           calib_text: Optional[str] = None, prompt: str = "The Python language is", awq: bool = False,
           scale_dtype: str = "auto", max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False,
           group_size: "int | Tuple[int, ...]" = DERIVED_GROUP_SIZE, tokenizer: Optional[str] = None,
           imatrix_path: Optional[str] = None, scale_search: bool = False,
           refine: Union["RefineConfig", str, None] = None, max_memory: Optional[int] = None,
           gptq: Optional["GPTQConfig"] = None, sensitivity_blocks: int = SENSITIVITY_BLOCKS) -> dict:
    """Export an anchor directory (or a plain HF model folder, quantized first to the 8-bit anchor of
    the recipe's family: MXINT8, or MXFP8 for MXFP recipes). ``scale_dtype`` "auto": as mlx_lm.convert.

    Writes ``out_dir`` atomically: it appears only after every tensor has been checked against
    the PyTorch dequantization and the logits of ``mlx_lm.load`` agree with PyTorch within
    :data:`LOGIT_RTOL`; it carries a manifest (``mfqat verify``). An existing non-empty
    ``out_dir`` is refused unless ``overwrite`` and it is an MLX export; the source never is.
    The PTQ path's temporary anchor lives inside the partial output, so a killed export leaves
    nothing in the temp dir (the next export to ``out_dir`` cleans the partial). ``tokenizer``: a
    folder whose tokenizer files are copied instead of the source's (for an anchor saved without one);
    from the anchor itself only the files its manifest lists are copied (:func:`tokenizer_files`).
    ``imatrix_path``: a llama.cpp imatrix GGUF: with ``awq``, AWQ's importance instead of calibrating on
    ``calib_text``; without, the scale search's importance (mxint6..mxint3 blocks, mfqat.export.scale_search).
    ``scale_search``: lower the anchor with the output-aware per-block scale choice, calibrated on
    ``calib_text`` (mfqat.export.scale_search). ``refine``: learn the affine tensors' scales and biases,
    the nvfp4 tensors' block scales (codes and size unchanged) and the block exponents of MX tensors lowered from
    the anchor (codes encoded again, size unchanged) against the anchor on ``calib_text``
    (mfqat.export.refine.RefineConfig, DWQ's lever); ``"auto"`` (``mfqat export-mlx``'s default) refines the
    plan's affine and nvfp4 tensors with steps chosen by model size, and exports an MX plan (or widths the anchor
    already stores) unrefined. ``max_memory`` (bytes): the export check's budget (mfqat.export.verify: the whole-model
    logits check when it fits, else the check on the model's first layers), and the budget an HF source that must be
    loaded whole is checked against before it loads (default: the memory available; mfqat.memory.check_fits).
    ``gptq``: error-compensated codes for the plan's derived affine matrices on ``calib_text``, the grid kept (or searched)
    (mfqat.export.gptq.GPTQConfig), before any refine; those matrices are then held whole until written.
    ``sensitivity_blocks``: the calibration blocks of 128 tokens ``auto:BPW``'s sensitivity pass scores (default 4;
    its time grows with them). ``group_size``: several (64, 128) give ``auto:BPW:affine`` per-tensor groups
    (mfqat.export.recipes.split_groups).

    Uniform and seed recipes stream: the anchor is read lazily and each tensor is lowered, laid out,
    written and checked on its own (a PTQ source is quantized tensor by tensor too), so memory stays near one
    tensor whatever the model's size. ``--refine`` keeps the affine codes (a byte a weight) on disk in the
    staging folder and runs the model one module's weights at a time (mfqat.export.refine), and so does ``auto:``'s sensitivity pass
    (mfqat.export.sensitivity), and so do ``--scale-search``'s importance (mfqat.export.scale_search) and
    ``--awq``'s (mfqat.export.awq.streamed_awq). Returns the report.
    """
    import time

    t0 = time.perf_counter()
    refine = _refine_config(refine)
    src = Path(source)
    is_anchor = (src / "mfqat.json").is_file()
    if awq and is_anchor:
        raise ValueError(f"{source}: AWQ is a post-training step; pass the full-precision model, not an anchor "
                         "(rescaling an anchor would re-quantize the codes MF-QAT trained)")
    report = {"format_version": EXPORT_FORMAT_VERSION, "source": str(source), "recipe": recipe, "tensors": {}}
    with atomic_directory(out_dir, overwrite=overwrite, kind="mlx-export", protect=[src]) as tmp:
        if is_anchor:
            anchor, own_tok, scratch = read_anchor(src, lazy=True), src, None
        else:
            scratch = tmp / "ptq-anchor"
            anchor, own_tok = _ptq_anchor(source, scratch, awq, calib_text, report, ptq_anchor_format(recipe),
                                          imatrix_path, written=recipe.startswith("auto:") or (
                                              refine is not None and _may_refine(recipe, refine)), budget=max_memory)
        if (dropped := drop_towers(anchor)):  # a VL release's vision tower: not in mlx-lm's model (warns)
            report["dropped"] = dropped
        tok_dir = Path(tokenizer) if tokenizer else own_tok
        tok_files = tokenizer_files(anchor.meta, tok_dir, explicit=tokenizer is not None or not is_anchor)
        if not any(f in tok_files for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise AnchorError(f"{tok_dir}: no tokenizer files" + (" the anchor's manifest lists" if tokenizer is None
                              and (tok_dir / "mfqat.json").is_file() else "") + "; mlx_lm.load needs them: pass a "
                              "folder that has them (tokenizer=..., mfqat export-mlx --tokenizer DIR)")
        if not isinstance(anchor.config, dict):
            raise AnchorError(f"{src}: config.json is missing; an export needs the model's config")
        if scale_search or (imatrix_path is not None and not awq):  # an imatrix without AWQ: the search's importance
            from mfqat.export.scale_search import apply_scale_search
            report["scale_search"] = apply_scale_search(anchor, tok_dir, calib_text, imatrix_path=None if awq else imatrix_path)
        source_cfg = Path(source) / "config.json"
        dtype_config = json.loads(source_cfg.read_text()) if not is_anchor and source_cfg.is_file() else anchor.config
        scale_dtype = report["scale_dtype"] = resolve_scale_dtype(scale_dtype, dtype_config, tensor_infos(anchor.plain))
        plan = build_plan(anchor, recipe, base_bits=base_bits, calib_text=calib_text, derived_group=group_size,
                          scale_dtype=scale_dtype, max_shard_bytes=max_shard_bytes,
                          sensitivity_blocks=sensitivity_blocks)  # auto: budgets these bytes
        if "scale_search" in report and imatrix_path is not None and not awq:  # weighs nothing of this recipe?
            from mfqat.export.scale_search import check_imatrix_used
            check_imatrix_used(report["scale_search"], plan.formats.values(), imatrix_path, recipe)
        caveats = plan.family.export_caveats(anchor.config)
        if caveats:
            report["caveats"] = caveats
            for caveat in caveats:
                warnings.warn(f"{source}: {caveat}", stacklevel=2)
        if gptq is not None:
            from mfqat.export.gptq import apply_gptq_text
            report["gptq"] = apply_gptq_text(anchor, plan, tok_dir, calib_text, gptq, max_memory)
        if refine is not None:
            from mfqat.export.refine import apply_refine
            spilled = refine if refine.spill_dir is not None else dataclasses.replace(refine, spill_dir=tmp)
            report["refine"] = apply_refine(anchor, plan, tok_dir, calib_text, spilled)  # codes on disk in tmp
        stored = sorted({f for n, f in plan.formats.items() if n in anchor.quantized
                         and not isinstance(plan.learned_scales.get(n), (LearnedScales, LearnedExponents))
                         and pick(anchor.learned_scales, f, plan.group_of(f))})
        if stored:
            report["anchor_refined"] = stored  # the learned scales the anchor holds (on-disk key name kept)
        if all(get_format(f).family == "affine" for f in plan.formats.values()):
            report["scale_dtype"] = "bfloat16"  # derived affine formats are defined with bfloat16 scales
        written = _write(anchor, plan, anchor.config, tok_files, tmp, report, scale_dtype, max_shard_bytes)
        write_model_card(tmp, "mlx", str(source), sorted(set(plan.formats.values())),
                         note=f"Recipe `{recipe}`: codes stored as MLX quantized weights, bit-exact with PyTorch.",
                         name=Path(out_dir).name)
        if scratch is not None and scratch.exists():
            shutil.rmtree(scratch)  # the temporary PTQ anchor (or tokenizer) is not part of the export
        report.update(stored_size(tmp, anchor_parameters(anchor), plan.numels(anchor)))
        if verify:
            report["verify"] = verify_export(tmp, anchor, plan, prompt, max_memory, written)
        written[1].close()
        report["bits_per_weight"] = plan.bits_per_weight(anchor)
        if plan.sensitivity is not None:
            write_json(tmp / "sensitivity.json", plan.sensitivity)
        close_anchor(anchor)
        report["seconds"] = time.perf_counter() - t0
        write_json(tmp / "mfqat_export.json", seal(report, tmp, "mfqat_export.json"))
    return report


SEARCH_BLOCKS = 8  # the scale search's calibration blocks: the most an export reads without GPTQ or a refine


def calibration_blocks_needed(refine: Optional["RefineConfig"], gptq: Optional["GPTQConfig"],
                              sensitivity_blocks: int = SENSITIVITY_BLOCKS) -> int:
    """The most calibration blocks one step of :func:`to_mlx` reads with these settings (the sensitivity pass
    ``sensitivity_blocks``, AWQ 4, the scale search 8, the refine ``n_blocks + n_valid``, GPTQ ``n_blocks``): what
    ``mfqat.data.mix.mixed_text(..., n_blocks=)`` sizes ``--calib-text generated`` to."""
    need = [SEARCH_BLOCKS, sensitivity_blocks]
    need += [refine.n_blocks + refine.n_valid] if refine is not None else []
    need += [gptq.n_blocks] if gptq is not None else []
    return max(need)


def _refine_config(refine: Union["RefineConfig", str, None]) -> Optional["RefineConfig"]:
    """``refine`` as a RefineConfig: "auto" is an optional refine with steps by model size."""
    from mfqat.export.refine import RefineConfig

    if isinstance(refine, str):
        if refine != "auto":
            raise ValueError(f"refine={refine!r}: pass a RefineConfig, 'auto' or None")
        return RefineConfig(optional=True)
    return refine


def _may_refine(recipe: str, refine: "RefineConfig") -> bool:
    """Whether the recipe can plan affine tensors for ``refine`` to learn (an optional refine of an MX recipe
    learns nothing, so its PTQ anchor need not be written)."""
    return not refine.optional or "affine" in recipe


def _ptq_anchor(source, scratch: Path, awq: bool, calib_text: Optional[str], report: dict,
                fmt: str = "mxint8", imatrix_path: Optional[str] = None, written: bool = False,
                budget: Optional[int] = None) -> Tuple[Anchor, Path]:
    """(the post-training anchor of a plain HF model in ``fmt``, the folder of its tokenizer files).
    When its names map one to one (mfqat.anchor.stream), the anchor is never written: its tensors are
    quantized from the source's shards when the export asks for them (``folder_anchor``; with ``awq``, each
    rescaled first: mfqat.export.awq.streamed_awq), and only the tokenizer is saved into ``scratch`` - unless
    ``written`` (``--refine`` reads every tensor at every step: it reads the anchor's codes from ``scratch``
    rather than quantize the source again each time). Else the model is loaded (and AWQ applied to it, from
    ``imatrix_path`` if given) and its anchor saved at ``scratch`` and read back, after mfqat.memory.check_fits
    (``budget``: bytes, None: the memory available) has refused it up front if its float32 weights cannot fit."""
    from mfqat.anchor.stream import anchor_from_folder, folder_anchor, folder_numel, folder_tokenizer, inspect_folder
    from mfqat.data.sources import calibration_blocks, load_model
    from mfqat.memory import check_fits

    inspected = inspect_folder(source)  # the meta model, built once
    why = inspected[0]
    if why is None:
        transforms = None
        report["ptq"] = "tensor by tensor"
        if awq:
            from mfqat.export.awq import streamed_awq
            transforms, entry = streamed_awq(source, inspected, calib_text, imatrix_path)
            report.update(entry)
            report["ptq"] = "AWQ, tensor by tensor"
        if written:
            return read_anchor(anchor_from_folder(source, scratch, fmt, transforms=transforms, inspected=inspected),
                               lazy=True), scratch
        anchor = folder_anchor(source, fmt, inspected=inspected, transforms=transforms)
        tok = folder_tokenizer(source)
        scratch.mkdir(parents=True)
        if tok is not None:
            tok.save_pretrained(scratch)
        return anchor, scratch
    report["ptq"] = "AWQ on the loaded model" if awq else f"loaded model ({why})"
    check_fits(f"export-mlx: {source} does not map tensor by tensor ({why}), and loading it whole in float32",
               4 * folder_numel(source), budget, "export on a machine with that much memory, pass a larger "
               "--max-memory if more is free, or once, where the memory is, load it and save_pretrained it in "
               "bfloat16 (float safetensors whose names match the model stream tensor by tensor)")
    model, tok = load_model(str(source))
    if awq:
        from mfqat.export.awq import apply_awq, awq_pairs
        if imatrix_path is not None:
            from mfqat.export.imatrix import imatrix_for_model
            imatrix = imatrix_for_model(model, imatrix_path, [c[0] for _, c in awq_pairs(model)])
            report["awq"] = apply_awq(model, None, imatrix=imatrix)
            report["imatrix"] = str(imatrix_path)
        else:
            report["awq"] = apply_awq(model, calibration_blocks(tok, calib_text))
    path = save_anchor(model, scratch, fmt, tok)
    del model
    return read_anchor(path, lazy=True), path


def _pieces(plan: Plan, name: str, parts: Dict[str, object]) -> Dict[str, object]:
    """One tensor's MLX arrays (``weight`` [+ ``scales``, ``biases``]) under their mlx-lm names: a split
    expert parameter gives each piece its rows (axis -2) of every array, so every code is kept."""
    rows = parts["weight"].shape[-2] if parts["weight"].ndim > 1 else 1
    out = {}
    for piece, lo, hi in plan.family.mlx_pieces(name, rows):
        module = piece[: -len(".weight")]
        for kind, arr in parts.items():
            out[f"{module}.{kind}"] = arr if (lo, hi) == (0, rows) else arr[..., lo:hi, :]
    return out


def tokenizer_files(meta: dict, folder: Path, explicit: bool = False,
                    remedy: str = "pass --tokenizer DIR (tokenizer=...) to ship it") -> Dict[str, bytes]:
    """The tokenizer files an export (or ``mfqat convert``) ships, {name: bytes}; ``meta``: the anchor's mfqat.json.

    From the anchor's own folder only the files its manifest lists, each checked against its sha256
    (a file added after the anchor was saved, e.g. a ``chat_template.jinja``, is left out with a
    warning naming it: the export's manifest would otherwise seal it as if it had been verified). A
    version-1 anchor has no manifest: its files are copied with a warning that nothing checked them.
    From a folder the user named (``explicit``, ``--tokenizer DIR``) every tokenizer file is taken as is.
    """
    present = [f for f in TOKENIZER_FILES if (folder / f).is_file()]
    manifest = meta.get("manifest") if not explicit else None
    if explicit or manifest is None:
        if not explicit and present:
            warnings.warn(f"{folder}: version-1 anchor without a manifest: its tokenizer files {present} are copied "
                          "unchecked", stacklevel=3)
        return {f: (folder / f).read_bytes() for f in present}
    unlisted = [f for f in present if f not in manifest]
    if unlisted:
        warnings.warn(f"{folder}: {', '.join(unlisted)} not in the anchor's manifest (added after the anchor was "
                      f"saved?): not copied into the output; {remedy}",
                      stacklevel=3)
    out = {}
    for f in present:
        if f in manifest:
            data = (folder / f).read_bytes()
            if hashlib.sha256(data).hexdigest() != manifest[f]:
                raise AnchorError(f"{folder / f}: sha256 mismatch with the anchor's manifest: the file was "
                                  "modified; re-save the anchor or pass --tokenizer DIR")
            out[f] = data
    return out


def _storage_parts(st: MLXTensor, scale_dtype: str, derived: bool) -> Dict[str, object]:
    """The arrays one tensor is written as (torch, in the dtypes MLX reads): packed words, scales and
    biases (bfloat16 for affine tensors with bfloat16 scales, and for the derived affine formats, which
    are defined with them), or the bfloat16 weight of a tensor stored unquantized."""
    if st.mode is None:
        return {"weight": torch.from_numpy(st.weight).to(torch.bfloat16)}
    cast = torch.bfloat16 if (st.mode == "affine" and (scale_dtype == "bfloat16" or derived)) else None
    parts = {"weight": np.ascontiguousarray(st.weight)}  # uint32 words
    for kind, arr in (("scales", st.scales), ("biases", st.biases)):
        if arr is not None:
            t = torch.from_numpy(np.ascontiguousarray(arr))
            parts[kind] = t.to(cast) if cast is not None else t
    return parts


def _write_chunked(writer: ShardWriter, plan: Plan, anchor: Anchor, name: str, rows: int,
                   scale_dtype: str, record: WriteRecord) -> MLXTensor:
    """Write one large matrix in row chunks (lowered, laid out and written ``rows`` rows at a time; its
    small scales and biases gathered and written after); returns the last chunk's storage (mode, bits)."""
    module = plan.family.mlx_name(name)[: -len(".weight")]
    derived = is_derived(plan.formats[name])
    small: Dict[str, list] = {}
    last: list = []

    def weights():
        for lo, _, q in plan.tensor_chunks(anchor, name, rows):
            record.add_chunk(plan, name, q, lo)
            st = to_mlx_storage(q, scale_dtype)
            parts = _storage_parts(st, scale_dtype, derived)
            for kind in ("scales", "biases"):
                if kind in parts:
                    small.setdefault(kind, []).append(parts[kind])
            last[:] = [st]
            yield parts["weight"]
    chunks = weights()
    first = next(chunks)
    dtype = first.dtype if isinstance(first, torch.Tensor) else DTYPES[NUMPY_NAMES[first.dtype]]
    writer.add_chunks(f"{module}.weight", dtype, (anchor.shape(name)[0],) + tuple(first.shape[1:]),
                      itertools.chain([first], chunks))
    for kind, parts in small.items():
        writer.add(f"{module}.{kind}", torch.cat(parts) if isinstance(parts[0], torch.Tensor) else np.concatenate(parts))
    return last[0]


def _write(anchor: Anchor, plan: Plan, config: dict, tok_files: Dict[str, bytes], tmp: Path, report: dict,
           scale_dtype: str = "float32", max_shard_bytes: int = MAX_SHARD_BYTES) -> Tuple[Dict[str, str], WriteRecord]:
    """Write the export's weights tensor by tensor (one in memory at a time; shards assembled as they fill),
    then config.json and the tokenizer files. Returns what the cut export check needs: the sha256 of every
    tensor's bytes and the sampled rows' PyTorch values (mfqat.export.verify.WriteRecord)."""
    family = plan.family
    writer = ShardWriter(tmp, max_shard_bytes, {"format": "mlx"}, digests=True)
    record = WriteRecord(tmp)
    try:
        for name in progress([n for n in anchor.plain if n not in plan.formats], desc="export: plain tensors",
                             unit="tensor", leave=False):
            v = anchor.plain[name]
            if v.is_floating_point():
                v = family.mlx_value(name, v.float()).contiguous()
                v = v if family.float32_on_export(name) else v.to(torch.bfloat16)
            writer.add(family.mlx_name(name), v)
        for name in sorted(plan.kept16):
            if name in anchor.quantized:
                weight = anchor.quantized[name].dequantize(torch.float32).to(torch.bfloat16)
                for k, arr in _pieces(plan, name, {"weight": weight}).items():
                    writer.add(k, arr)
                report["tensors"][name] = {"source": anchor.format, "mlx": "bfloat16", "bits_per_weight": 16,
                                           "exact": False}
        for name in progress(list(plan.formats), desc="export: quantized tensors", unit="tensor"):
            rows = plan.chunk_rows(anchor, name)
            if rows is None:
                q = plan.tensor(anchor, name)
                record.add_tensor(plan, name, q)
                st = to_mlx_storage(q, scale_dtype)
                for k, arr in _pieces(plan, name, _storage_parts(st, scale_dtype, is_derived(plan.formats[name]))).items():
                    writer.add(k, arr)
                del q
            else:
                st = _write_chunked(writer, plan, anchor, name, rows, scale_dtype, record)
            fmt = plan.formats[name]
            report["tensors"][name] = {"source": fmt, "origin": plan.origin[name], "mlx": st.mode or "bfloat16",
                                       "bits": st.bits, "group_size": plan.group_of(fmt),
                                       "bits_per_weight": get_format(fmt).bits_per_weight(plan.group_of(fmt)),
                                       "exact": st.exact}
            if family.mlx_name(name) != name or family.expert_param(name):
                report["tensors"][name]["mlx_names"] = [n for n, _, _ in family.mlx_pieces(name, anchor.shape(name)[-2])]
            del st
        writer.close()
    except BaseException:
        writer.abort()
        raise
    (tmp / "config.json").write_text(json.dumps(_config_for_mlx(config, plan, anchor), indent=2))
    for f, data in tok_files.items():
        (tmp / f).write_bytes(data)
    return writer.digests, record
