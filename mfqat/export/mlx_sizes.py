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
from typing import Dict, Iterable, Optional, Tuple

import torch

MLX_GROUP_SIZES: Dict[str, Tuple[int, ...]] = {"affine": (32, 64, 128), "mxfp4": (32,), "mxfp8": (32,), "nvfp4": (16,)}
SCALE_DTYPES = ("auto", "float32", "bfloat16")


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


def model_dtype(config: dict, weights: Iterable[torch.Tensor] = ()) -> Optional[str]:
    """The dtype ``mlx_lm.convert`` quantizes a model in: config.json's ``torch_dtype`` (transformers 5
    writes ``dtype``), else that of the weights themselves."""
    for key in ("torch_dtype", "dtype"):
        if isinstance(config.get(key), str):
            return config[key]
    for w in weights:
        if w.is_floating_point():
            return str(w.dtype).replace("torch.", "")
    return None


def resolve_scale_dtype(scale_dtype: str, config: dict, weights: Iterable[torch.Tensor] = ()) -> str:
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


def anchor_parameters(anchor) -> int:
    """Parameter count of the whole model an anchor holds (tied tensors once)."""
    return sum(int(torch.Size(anchor.shape(k)).numel()) for k in list(anchor.quantized) + list(anchor.plain))
