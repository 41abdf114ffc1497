"""Anchor checkpoints: one MXINT8 / MXFP8 model on disk, any lower format on load (DESIGN.md §4).

Directory layout (what ``from_pretrained`` users recognise, plus mfqat's own metadata)::

    config.json  tokenizer files  mfqat.json
    model.safetensors   (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)

Quantized tensors are stored as ``{name}.codes`` (packed uint8) and ``{name}.scales`` (E8M0
uint8); everything else as plain tensors. ``mfqat.json`` records the format version, anchor
format, block size, scale rule, every quantized tensor (format, shape, dtype), tied aliases,
the training schedule and step, and a sha256 per weight file.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from . import __version__
from .formats import canonical_name, get_format
from .io import PathLike, atomic_directory, sha256_file, write_json
from .qat.config import DEFAULT_TARGETS
from .qat.prepare import qat_modules
from .quant.api import quantize
from .quant.mxtensor import MXTensor
from .slice import check_sliceable, slice_and_scale

ANCHOR_FORMAT_VERSION = 1
META_FILE = "mfqat.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024 ** 3


class AnchorError(ValueError):
    """An anchor directory is missing, corrupt, or does not match what was asked."""


@dataclass
class Anchor:
    """An anchor read from disk: quantized tensors (MXTensor), plain tensors, metadata."""

    path: Path
    meta: dict
    quantized: Dict[str, MXTensor] = field(default_factory=dict)
    plain: Dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def format(self) -> str:
        """The anchor's own format."""
        return self.meta["anchor_format"]

    def in_format(self, fmt: Optional[str]) -> Dict[str, MXTensor]:
        """Every quantized tensor converted to ``fmt`` by Slice-and-Scale (None: the anchor's)."""
        if fmt is None:
            return dict(self.quantized)
        fmt = canonical_name(fmt)
        check_sliceable(self.format, fmt, name=str(self.path))
        return {k: slice_and_scale(q, fmt) for k, q in self.quantized.items()}

    def state_dict(self, fmt: Optional[str] = None, dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
        """A full state dict with quantized weights dequantized in ``fmt``."""
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.plain.items()}
        for k, q in self.in_format(fmt).items():
            sd[k] = q.dequantize(dtype)
        return sd


def default_targets(model: nn.Module, block_size: int) -> List[str]:
    """PTQ targets for a plain model: decoder-block Linear weights whose rows divide into blocks."""
    pat = re.compile(DEFAULT_TARGETS)
    return [f"{n}.weight" for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and pat.search(n) and m.in_features % block_size == 0]


def _unique_state_dict(model: nn.Module) -> tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """State dict without tied duplicates, plus {alias: kept name}."""
    seen: Dict[int, str] = {}
    out: Dict[str, torch.Tensor] = {}
    tied: Dict[str, str] = {}
    for k, v in model.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        ptr = hash(key)
        if ptr in seen:
            tied[k] = seen[ptr]
            continue
        seen[ptr] = k
        out[k] = v.detach()
    return out, tied


def _shard(tensors: Dict[str, torch.Tensor], max_bytes: int) -> List[Dict[str, torch.Tensor]]:
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in tensors.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > max_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    return shards


def write_safetensors(folder: Path, tensors: Dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES,
                      metadata: Optional[dict] = None) -> List[str]:
    """Write tensors as model.safetensors, or shards + index beyond ``max_shard_bytes``."""
    shards = _shard({k: v.contiguous() for k, v in tensors.items()}, max_shard_bytes)
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS_FILE), metadata=meta)
        return [WEIGHTS_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata=meta)
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def save_anchor(model: nn.Module, path: PathLike, fmt: str = "mxint8", tokenizer=None,
                block_size: int = 32, scale_rule: str = "floor", targets: Optional[List[str]] = None,
                step: Optional[int] = None, schedule: Optional[dict] = None,
                max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
    """Write an anchor checkpoint (atomic: a crash never leaves a half anchor that loads).

    Quantizes the MF-QAT modules' master weights of a prepared model, or (plain model,
    post-training quantization) every decoder-block Linear weight, to ``fmt``.
    """
    f = get_format(fmt)
    if not f.is_mx:
        raise ValueError(f"anchors are stored in an MX format (mxint8 or mxfp8 recommended), not '{f.name}'")
    sd, tied = _unique_state_dict(model)
    if any("lora_" in k for k in sd):
        raise ValueError("the model holds LoRA adapters: merge them first (peft: model.merge_and_unload())")
    if targets is None:
        prepared = [f"{n}.weight" for n, m in qat_modules(model)]
        targets = prepared or default_targets(model, block_size)
        block_size = next((m.block_size for _, m in qat_modules(model)), block_size)
    tensors: Dict[str, torch.Tensor] = {}
    entries: Dict[str, dict] = {}
    for k, v in sd.items():
        if k in targets:
            if not torch.isfinite(v).all():
                raise ValueError(f"{k}: the weight holds NaN or Inf values; refusing to save an anchor of it")
            q = quantize(v.float(), f, block_size, scale_rule)
            tensors[f"{k}.codes"], tensors[f"{k}.scales"] = q.pack(), q.scales
            entries[k] = {"format": f.name, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
        else:
            tensors[k] = v
    missing = [t for t in targets if t not in entries and t not in tied]
    if missing:
        raise ValueError(f"targets not found in the model's state dict: {missing[:5]}")
    with atomic_directory(path) as tmp:
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        files = write_safetensors(tmp, tensors, max_shard_bytes)
        write_json(tmp / META_FILE, {
            "format_version": ANCHOR_FORMAT_VERSION,
            "mfqat_version": __version__,
            "anchor_format": f.name,
            "block_size": block_size,
            "scale_rule": scale_rule,
            "tensors": entries,
            "tied": tied,
            "schedule": schedule,
            "step": step,
            "files": {name: sha256_file(tmp / name) for name in files},
        })
    return Path(path)


def read_meta(path: PathLike) -> dict:
    """Read and validate mfqat.json (version, format, files present)."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise AnchorError(f"{path}: not an mfqat anchor ({META_FILE} is missing)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise AnchorError(f"{meta_path}: corrupt JSON ({e}); re-save the anchor") from e
    version = meta.get("format_version")
    if not isinstance(version, int) or version > ANCHOR_FORMAT_VERSION:
        raise AnchorError(
            f"{meta_path}: anchor format version {version!r} is newer than this mfqat supports "
            f"({ANCHOR_FORMAT_VERSION}); upgrade mfqat (written by mfqat {meta.get('mfqat_version')})"
        )
    try:
        get_format(meta["anchor_format"])
    except (KeyError, ValueError) as e:
        raise AnchorError(f"{meta_path}: bad anchor_format: {e}") from e
    for name in meta.get("files", {}):
        if not (path / name).is_file():
            raise AnchorError(f"{path / name}: weight file listed in {META_FILE} is missing")
    return meta


def read_anchor(path: PathLike, verify: bool = True) -> Anchor:
    """Read an anchor: check hashes, shapes and formats; name the file or tensor that is wrong."""
    path = Path(path)
    meta = read_meta(path)
    if verify:
        for name, digest in meta["files"].items():
            if sha256_file(path / name) != digest:
                raise AnchorError(f"{path / name}: sha256 mismatch: the file is truncated or was modified; "
                                  f"re-save or re-download the anchor")
    raw: Dict[str, torch.Tensor] = {}
    for name in meta["files"]:
        try:
            with safe_open(str(path / name), framework="pt") as fh:
                for k in fh.keys():
                    raw[k] = fh.get_tensor(k)
        except Exception as e:
            raise AnchorError(f"{path / name}: cannot read safetensors ({e})") from e
    anchor = Anchor(path, meta)
    bs = meta["block_size"]
    for k, e in meta["tensors"].items():
        if f"{k}.codes" not in raw or f"{k}.scales" not in raw:
            raise AnchorError(f"{path}: tensor {k}: codes or scales missing from the weight files")
        f = get_format(e["format"])
        shape = tuple(e["shape"])
        codes, scales = raw.pop(f"{k}.codes"), raw.pop(f"{k}.scales")
        want_scales = shape[:-1] + (shape[-1] // bs,)
        if tuple(scales.shape) != want_scales or tuple(codes.shape) != shape[:-1] + (shape[-1] * f.bits // 8,):
            raise AnchorError(f"{path}: tensor {k}: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} "
                              f"do not match shape {shape} in {f.name} with block {bs}")
        dtype = getattr(torch, e.get("dtype", "float32"))
        anchor.quantized[k] = MXTensor.unpack(codes, scales, f, bs, shape, dtype, scale_rule=meta["scale_rule"])
    anchor.plain = raw
    return anchor


def load_anchor(path: PathLike, fmt: Optional[str] = None, device: Union[str, torch.device] = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """A ready Hugging Face model whose quantized weights hold ``fmt`` values (Slice-and-Scale).

    ``fmt=None`` gives the anchor's own format. Any format of the anchor's family at or below
    its bits can be asked for; others raise AnchorError / ValueError with the reason.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    anchor = read_anchor(path)
    sd = anchor.state_dict(fmt, dtype)
    config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = set(anchor.meta.get("tied", {}))
    real_missing = [k for k in missing if k not in tied]
    if real_missing or unexpected:
        raise AnchorError(f"{path}: weights do not match config.json: missing {real_missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    model.tie_weights()
    model = model.to(device).eval()
    model.mfqat_format = fmt or anchor.format
    return model
