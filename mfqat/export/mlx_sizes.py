"""What an MLX export really stores: the group sizes MLX accepts, the scale dtype ``mlx_lm.convert``
would write for the same model, and the bytes on disk per weight (the honest size).

MLX quantized modes and their group sizes (``mx.quantize``): affine 32/64/128; mxfp4 and mxfp8 32
only; nvfp4 16 only. An anchor's block size becomes the MLX group size; a block size MLX cannot carry code-for-code
is refused before anything is written.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, Iterable, Optional, Tuple, Union

import torch

from mfqat.storage.tensor_files import TensorInfo

MLX_GROUP_SIZES: Dict[str, Tuple[int, ...]] = {"affine": (32, 64, 128), "mxfp4": (32,), "mxfp8": (32,), "nvfp4": (16,)}
SCALE_DTYPES = ("auto", "float32", "bfloat16")
EXPORT_METADATA = {"format": "mlx"}  # the __metadata__ every export shard's header carries (mlx_export._write)


def check_mlx_group_size(block_size: int, storages: Iterable[Tuple[str, Optional[Tuple[str, int]]]]) -> int:
    """The MLX group size for an anchor of ``block_size`` whose tensors go to ``storages``
    ((name, (mode, bits) or None for 16-bit)); ValueError naming the tensor and the reason otherwise."""
    for name, storage in storages:
        if storage is None:
            continue
        mode = storage[0]
        if block_size not in MLX_GROUP_SIZES[mode]:
            raise ValueError(
                f"{name}: the anchor's block size {block_size} cannot be exported code-for-code: MLX mode "
                f"'{mode}' takes group sizes {list(MLX_GROUP_SIZES[mode])} only; save the anchor with "
                f"block_size={MLX_GROUP_SIZES[mode][0]}" + (" (or 64/128 for MXINT)" if mode != "affine" else ""))
    return block_size


def model_dtype(config: dict, weights: Iterable[Union[torch.Tensor, TensorInfo]] = ()) -> Optional[str]:
    """The dtype ``mlx_lm.convert`` quantizes a model in: config.json's ``torch_dtype`` (transformers 5
    writes ``dtype``), else that of the weights themselves (the first floating one; tensors or, to read
    nothing from a lazily read anchor, their headers: mfqat.anchor.lazy.tensor_infos)."""
    for key in ("torch_dtype", "dtype"):
        if isinstance(config.get(key), str):
            return config[key]
    for w in weights:
        if w.dtype.is_floating_point:
            return str(w.dtype).replace("torch.", "")
    return None


def resolve_scale_dtype(scale_dtype: str, config: dict,
                        weights: Iterable[Union[torch.Tensor, TensorInfo]] = ()) -> str:
    """``auto``: the affine scale dtype ``mlx_lm.convert`` writes for this model (its dtype): bfloat16
    for a bfloat16 model, float32 for a float32 one. A float16 model gets bfloat16 (same size; float16
    cannot hold every power-of-two MX scale). Power-of-two scales are exact in both."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype '{scale_dtype}': choose one of {SCALE_DTYPES}")
    if scale_dtype != "auto":
        return scale_dtype
    return "float32" if model_dtype(config, weights) == "float32" else "bfloat16"


def tensor_bytes(folder: Path) -> Dict[str, int]:
    """{tensor name: bytes of its data} read from the safetensors headers of an export."""
    out: Dict[str, int] = {}
    for f in sorted(Path(folder).glob("model*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                out[name] = end - start
    return out


def stored_size(folder: Path, n_parameters: int, quantized: Dict[str, int]) -> dict:
    """Honest size of an export: 8 x bytes of its safetensors files / the model's parameter count, and
    for the quantized matrices alone (``{weight name: element count}``) their weight+scales+biases bytes
    / their element count."""
    folder = Path(folder)
    file_bytes = sum(f.stat().st_size for f in folder.glob("model*.safetensors"))
    sizes = tensor_bytes(folder)
    q_bytes = 0
    for name in quantized:
        module = name[: -len(".weight")]
        q_bytes += sum(sizes.get(k, 0) for k in (name, f"{module}.scales", f"{module}.biases"))
    q_count = sum(quantized.values())
    return {"stored_bytes": file_bytes, "parameters": n_parameters,
            "stored_bits_per_weight": 8.0 * file_bytes / max(n_parameters, 1),
            "stored_bits_per_weight_quantized": 8.0 * q_bytes / max(q_count, 1)}


def stored_bits(storage: Optional[Tuple[str, int]], group: int, scale_dtype: str, derived: bool = False) -> float:
    """Bits per weight a tensor takes in an export's safetensors data when written in ``storage`` ((MLX mode,
    bits), or None: bfloat16) with ``group``-sized groups: its packed codes, plus per group an affine scale and
    bias (bfloat16 for the ``derived`` affine formats or a bfloat16 ``scale_dtype``, else float32) or one
    8-bit scale (mxfp4, mxfp8, nvfp4), as mfqat.export.mlx_export writes them."""
    if storage is None:
        return 16.0
    mode, bits = storage
    if mode != "affine":
        return bits + 8.0 / group
    scale_bits = 16 if derived or scale_dtype == "bfloat16" else 32
    return bits + 2.0 * scale_bits / group


def header_entry_bound(name: str, shape: Iterable[int], offset_digits: int) -> int:
    """At most the bytes tensor ``name``'s entry (comma included) takes in an export shard's compact JSON
    header, for any dtype, a shape whose dimensions have no more digits than ``shape``'s, and data offsets of
    at most ``offset_digits`` digits."""
    entry = {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, 0]}  # BF16: the longest name written
    return len(json.dumps({name: entry}, separators=(",", ":"))) - 2 - 2 + 2 * offset_digits + 1


def shard_overhead_bound(data_bytes: int, max_shard_bytes: int, metadata: dict = EXPORT_METADATA) -> int:
    """At most the bytes an export's safetensors files add to ``data_bytes`` of tensor data besides the
    tensors' own header entries: per file the 8-byte header length, ``{"__metadata__": ...}`` and the padding
    to 8 bytes, for at most ``1 + 2 * data_bytes // max_shard_bytes`` files (the writer fills shards greedily,
    so two neighbouring shards always hold more than ``max_shard_bytes``)."""
    files = 1 + 2 * (data_bytes // max(max_shard_bytes, 1))
    return files * (8 + len(json.dumps({"__metadata__": metadata}, separators=(",", ":"))) + 7)


def anchor_parameters(anchor) -> int:
    """Parameter count of the whole model an anchor holds (tied tensors once)."""
    return sum(int(torch.Size(anchor.shape(k)).numel()) for k in list(anchor.quantized) + list(anchor.plain))
