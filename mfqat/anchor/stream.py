"""A plain Hugging Face checkpoint folder to an anchor, tensor by tensor (post-training quantization at any size).

``save_anchor(model, ...)`` needs the model in memory. :func:`anchor_from_folder` never builds it: the
model's structure comes from its config on PyTorch's ``meta`` device (no memory), the weights are read
from the source's safetensors shards one tensor at a time (in their stored dtype: a bfloat16 checkpoint's
norms and embeddings stay bfloat16), each target is quantized as it is read, and the anchor's shards are
written as they fill (mfqat.storage.tensor_files). Peak memory: one tensor and its quantization.

The same anchor as ``save_anchor(load_model(folder)[0], ...)`` (same targets, codes, scales, metadata),
except that plain tensors keep the checkpoint's dtype. Released MoE checkpoints, whose experts are stored one
by one and stacked into fused parameters on load, and keys transformers renames on load, stream too: the
source is read under the model's names by transformers' own conversion mapping (mfqat.anchor.source), one
fused parameter at a time. FP8 releases (e4m3 weights with block scales) stream too, each weight dequantized
to float32 as it is read (recorded as float32, as the float32 model loaded from them holds it). Other
pre-quantized checkpoints (MXFP4) and any checkpoint whose names or shapes still differ from the model's do
not map tensor by tensor: :func:`streamable` says why, and the caller loads the model instead.
"""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch

from mfqat._build import __version__
from mfqat.anchor.config import model_config, quantization_config, write_anchor_config
from mfqat.anchor.meta import BASE_FORMAT_VERSION
from mfqat.anchor.source import SourceCheckpoint
from mfqat.anchor.tensors import default_targets, full_precision
from mfqat.formats import get_format
from mfqat.models import family_for
from mfqat.progress import progress
from mfqat.quant.api import quantize
from mfqat.quant.scale_rules import anchor_rules
from mfqat.storage.io import PathLike, atomic_directory, sha256_file, write_json
from mfqat.storage.manifest import seal
from mfqat.storage.model_card import write_model_card
from mfqat.storage.shard_files import INDEX_FILE, MAX_SHARD_BYTES, WEIGHTS_FILE
from mfqat.storage.sharded import unique_state_dict
from mfqat.storage.tensor_files import ShardWriter

__all__ = ["SourceCheckpoint", "anchor_from_folder", "close_anchor", "folder_anchor", "folder_numel",
           "folder_tokenizer", "inspect_folder", "meta_model", "model_and_targets_numel", "streamable"]

# Rows quantized at once: bounds the float32 working copy of a large matrix (an embedding) to ~64 MB a chunk.
CHUNK_ELEMENTS = 16 * 1024 ** 2


def meta_model(folder: PathLike):
    """(model on the meta device, its config): the structure from config.json, no weights, no memory; the
    class that builds the whole checkpoint (a vision-language release's, vision tower included)."""
    import transformers
    from transformers import AutoConfig

    transformers.logging.set_verbosity_error()
    config = AutoConfig.from_pretrained(str(folder))
    auto = getattr(transformers, family_for(config.model_type).hf_auto_class)
    with torch.device("meta"):
        model = auto.from_config(config)
    return model, config


def folder_numel(folder: PathLike) -> int:
    """Elements of the weights an HF folder stores, read from the safetensors headers; without any (a
    ``pytorch_model.bin`` checkpoint), the parameters of the model its config builds; 0 when neither is known."""
    try:
        with SourceCheckpoint(folder) as src:
            stored = sum(int(torch.Size(info.shape).numel()) for _, info in src.where.values())
        if stored:
            return stored
    except ValueError:
        pass
    try:
        model, _ = meta_model(folder)
    except Exception:  # no config, or one transformers cannot build: the load reports it
        return 0
    return sum(p.numel() for p in model.parameters())


def model_and_targets_numel(folder: PathLike) -> int:
    """Elements of the model built from an HF folder's config plus its PTQ targets once more (``eval`` holds the
    model and a copy of its targets); 0 when the config cannot be built (the load reports it)."""
    try:
        model, _ = meta_model(folder)
    except Exception:
        return 0
    params = dict(model.named_parameters())
    return sum(p.numel() for p in params.values()) + sum(params[k].numel() for k in default_targets(model, 32)
                                                         if k in params)


def streamable(folder: PathLike) -> Optional[str]:
    """None when ``folder`` can be quantized tensor by tensor, else why not (the caller loads the model)."""
    return inspect_folder(folder)[0]


def inspect_folder(folder: PathLike) -> Tuple[Optional[str], Any, Any]:
    """(:func:`streamable`'s answer, the meta model, its config) - the model built once (None when refused)."""
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        return "no config.json", None, None
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError:
        return "config.json is not JSON", None, None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(cfg, dict) or (qc is not None and not (isinstance(qc, dict) and qc.get("quant_method") == "fp8")):
        return "a pre-quantized checkpoint (dequantized by transformers on load)", None, None  # FP8: read dequantized
    if not (folder / INDEX_FILE).is_file() and not (folder / WEIGHTS_FILE).is_file():
        return "no safetensors weights", None, None
    try:
        model, config = meta_model(folder)
    except Exception as e:  # an architecture transformers cannot build from its config
        return f"transformers cannot build the model from its config ({type(e).__name__})", None, None
    with SourceCheckpoint(folder) as src:
        src.map_to(model)
        held = set(src.names)
        sd, _ = unique_state_dict(model, model.state_dict())
        missing = [k for k in sd if k not in held]
        aliases = dict(model.named_parameters(remove_duplicate=False))  # tied names the state dict dropped
        extra = [k for k in src.names if k not in sd and k not in aliases]
        wrong = [k for k in sd if k in held and src.shape(k) != tuple(sd[k].shape)]
    ignored = [k for k in extra if unused_on_load(model, k)]
    unknown = [k for k in extra if k not in ignored]
    if missing or wrong or unknown:
        first = (missing or wrong or unknown)[0]
        return f"its tensor names or shapes differ from the model's (e.g. {first}: renamed or fused on load)", None, None
    if ignored:  # every model tensor is there as it is; the rest are what from_pretrained drops without a word
        warnings.warn(f"{folder}: {len(ignored)} stored tensor(s) the model does not use are ignored, as transformers "
                      f"ignores them on load (e.g. {', '.join(ignored[:3])})", stacklevel=2)
    return None, model, config


# What from_pretrained drops without a warning whatever the model (modeling_utils: older checkpoints' rotary and
# position-id buffers); each model class adds its own _keys_to_ignore_on_load_unexpected (e.g. MTP layers).
UNUSED_ON_LOAD = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")


def unused_on_load(model, name: str) -> bool:
    """Whether transformers ignores the stored tensor ``name`` on load by rule (its patterns, searched as it
    searches them). Any other stored tensor the model lacks (a scale of another name, a tower the class does not
    build) stops the stream: the model is loaded, and transformers decides."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) | set(UNUSED_ON_LOAD)
    return any(re.search(p, name) for p in patterns)


def folder_tokenizer(folder: PathLike):
    """The tokenizer of an HF folder (pad token = eos when it has none, as load_model sets it), or None."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError):
        return None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _finite(part: torch.Tensor) -> bool:
    """True when ``part`` holds no NaN or Inf: one reduction pass (NaN propagates through min/max), no mask."""
    lo, hi = torch.aminmax(part)
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


def _quantized(value: torch.Tensor, f, block_size: int, scale_rule: str, name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ``value`` quantized in row chunks (the rows of a matrix are independent); the
    codes unpacked (int8 MXINT, uint8 MXFP), each of ``value``'s shape but the scales' last axis."""
    rows = value.reshape(-1, value.shape[-1])
    step = max(1, CHUNK_ELEMENTS // max(rows.shape[1], 1))
    codes, scales = [], []
    for lo in range(0, rows.shape[0], step):
        part = rows[lo:lo + step]
        if scale_rule != "floor" or not part.is_floating_point():  # floor: a bf16/fp16 block quantizes as its float32
            part = part.float()
        if not _finite(part):
            raise ValueError(f"{name}: the weight holds NaN or Inf values; refusing to save an anchor of it")
        q = quantize(part, f, block_size, scale_rule)
        codes.append(q.codes)
        scales.append(q.scales)
    lead = tuple(value.shape[:-1])
    one = lambda parts: parts[0] if len(parts) == 1 else torch.cat(parts)  # noqa: E731 (no copy of a single chunk)
    return one(codes).reshape(*lead, -1), one(scales).reshape(*lead, -1)


def _saved_config(config, fmt: str, block_size: int, rule: str, recorded: Dict[str, str]) -> dict:
    """The model's config exactly as an anchor of it would hold it (written and read back, less mfqat's
    quantization_config: what ``read_anchor(...).config`` gives)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mfqat-config-") as tmp:
        write_anchor_config(config, Path(tmp), fmt, block_size, rule, recorded)
        return model_config(json.loads((Path(tmp) / "config.json").read_text()))


def folder_anchor(folder: PathLike, fmt: str = "mxint8", block_size: int = 32, scale_rule: str = "floor",
                  inspected: Optional[Tuple[Optional[str], Any, Any]] = None,
                  transforms: Optional[Mapping[str, Callable[[torch.Tensor], torch.Tensor]]] = None):
    """The post-training anchor of the HF checkpoint ``folder``, not written: an :class:`Anchor` whose
    quantized tensors are quantized from the source's shards each time they are asked for (one tensor in
    memory at a time) and whose plain tensors are read from them. The same metadata, config, codes and
    scales as ``read_anchor(anchor_from_folder(folder, ...), lazy=True)`` (``meta["files"]`` empty: no
    weight file exists); what an export from an HF folder reads instead of a temporary anchor on disk.
    The source files stay open until ``anchor.materialize()`` or :func:`close_anchor`. Raises ValueError
    when :func:`streamable` refuses the folder. ``inspected``: :func:`inspect_folder`'s answer when the caller
    already has it (the meta model is built once). ``transforms``: {tensor name: a function of its value read from
    the source returning float32} applied before it is quantized or kept (AWQ's scaling, mfqat.export.awq: the
    same codes as ``save_anchor`` of the float32 model rescaled in place); a transformed tensor is recorded and
    kept as float32, as that model holds it."""
    from mfqat.anchor.checkpoint import Anchor
    from mfqat.anchor.lazy import LazyQuantized, LazyTensors
    from mfqat.quant.mxtensor import MXTensor
    from mfqat.quant.scale_rules import anchor_scale_rules

    f = get_format(fmt)
    if not f.is_mx:
        raise ValueError(f"anchors are stored in an MX format (mxint8 or mxfp8 recommended), not '{f.name}'")
    why, model, config = inspected or inspect_folder(folder)
    if why is not None:
        raise ValueError(f"{folder}: cannot be quantized tensor by tensor: {why}")
    sd, tied = unique_state_dict(model, model.state_dict())
    targets = set(default_targets(model, block_size))
    recorded = anchor_rules(f.name, scale_rule, None)
    rule = recorded[f.name]
    src = SourceCheckpoint(folder)
    src.map_to(model)
    transforms = dict(transforms or {})
    unknown = sorted(set(transforms) - set(sd))
    if unknown:
        raise ValueError(f"{folder}: no tensor {unknown[0]} to transform (the model's names: e.g. {next(iter(sd))})")
    dtype = lambda k: torch.float32 if k in transforms else src.dtype(k)  # noqa: E731
    entries = {k: {"format": f.name, "shape": list(v.shape), "dtype": str(dtype(k)).replace("torch.", "")}
               for k, v in sd.items() if k in targets}
    meta = {"format_version": BASE_FORMAT_VERSION, "mfqat_version": __version__, "anchor_format": f.name,
            "block_size": block_size, "scale_rule": rule, "scale_rules": recorded, "tensors": entries,
            "tied": tied, "full_precision": full_precision(model, sd, entries, block_size), "schedule": None,
            "step": None, "files": {}}
    rules = anchor_scale_rules(meta)

    def read(k: str) -> torch.Tensor:
        return transforms[k](src.read(k).float()) if k in transforms else src.read(k)

    def build(k: str) -> MXTensor:
        codes, scales = _quantized(read(k), f, block_size, rule, k)
        return MXTensor(codes, scales, f, block_size, dtype(k), scale_rule=rule, slice_rules=rules)

    anchor = Anchor(Path(folder), meta, config=_saved_config(config, f.name, block_size, rule, recorded))
    anchor.quantized = LazyQuantized({k: tuple(e["shape"]) for k, e in entries.items()}, build)
    plain = [k for k in sd if k not in entries]
    direct = {k: src.location(k) for k in plain if k not in transforms}
    anchor.plain = LazyTensors({k: v for k, v in direct.items() if v is not None},
                               stored={k: src.renamed[k] for k in plain if k in src.renamed})
    for k in plain:  # kept in full precision (no target) but built: fused, FP8 (dequantized), rescaled: held
        if direct.get(k) is None:
            anchor.plain[k] = read(k)
    anchor.files = {str(tf.where): tf for tf in src.files}
    anchor.source_order = list(sd)
    return anchor


def anchor_from_folder(folder: PathLike, path: PathLike, fmt: str = "mxint8", tokenizer=None, block_size: int = 32,
                       scale_rule: str = "floor", max_shard_bytes: int = MAX_SHARD_BYTES,
                       overwrite: bool = False,
                       transforms: Optional[Mapping[str, Callable[[torch.Tensor], torch.Tensor]]] = None,
                       inspected: Optional[Tuple[Optional[str], Any, Any]] = None) -> Path:
    """Post-training anchor of the HF checkpoint ``folder`` written to ``path``, tensor by tensor (module
    docstring; the tensors are :func:`folder_anchor`'s). ``tokenizer``: saved with it (default: the
    folder's, when it has one). Raises ValueError when :func:`streamable` refuses the folder. ``inspected``:
    :func:`inspect_folder`'s answer when the caller has it."""
    anchor = folder_anchor(folder, fmt, block_size, scale_rule, inspected=inspected, transforms=transforms)
    meta = anchor.meta
    try:
        if tokenizer is None:
            tokenizer = folder_tokenizer(folder)
        with atomic_directory(path, overwrite=overwrite, kind="anchor") as tmp:
            (tmp / "config.json").write_text(json.dumps(
                {**anchor.config, "quantization_config": quantization_config(
                    meta["anchor_format"], meta["block_size"], meta["scale_rule"], meta["scale_rules"])},
                indent=2, sort_keys=True) + "\n")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            write_model_card(tmp, "anchor", str(folder), [meta["anchor_format"]], name=Path(path).name)
            files = _write_tensors(anchor, tmp, max_shard_bytes)
            meta = {**meta, "files": {name: sha256_file(tmp / name) for name in files}}
            write_json(tmp / "mfqat.json", seal(meta, tmp, "mfqat.json"))
    finally:
        close_anchor(anchor)
    return Path(path)


def _write_tensors(anchor, folder: Path, max_shard_bytes: int) -> list:
    """Every tensor of a :func:`folder_anchor` written into ``folder``'s shards in the source's order
    (quantized ones as ``.codes`` / ``.scales``); the shard file names."""
    writer = ShardWriter(folder, max_shard_bytes)
    try:
        for k in progress(anchor.source_order, desc="anchor: quantize", unit="tensor"):
            if k in anchor.quantized:
                q = anchor.quantized[k]
                writer.add(f"{k}.codes", q.pack())
                writer.add(f"{k}.scales", q.scales)
            else:
                writer.add(k, anchor.plain[k])
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def close_anchor(anchor) -> None:
    """Release the files a lazily read anchor (or a :func:`folder_anchor`) reads from."""
    for tf in anchor.files.values():
        tf.close()
    anchor.files = {}
