"""Derived formats: MLX's own affine layout and NVFP4, re-quantized from an MX anchor.

MLX stores a k-bit affine weight as codes plus a bfloat16 scale and bias per group of 64 (what
``mlx_lm.convert`` writes for a bfloat16 model: 4.5 bits/weight at k = 4). An MXINT8 / MXFP8 anchor
gives such a model without re-training by *re-quantizing its dequantized values*:

    W_affine_k = dequantize(mx.quantize(bfloat16(dequantize(anchor)), group_size=g, bits=k))

where ``mx.quantize`` is MLX's affine rule (reproduced bit for bit by ``affine{k}`` in
mfqat.quant.reference) and the dequantization is MLX's too (``code * scale + bias`` in bfloat16
arithmetic). The bfloat16 cast of an MXINT8 / MXFP8 value is exact. MF-QAT trains through this
derivation (``formats: [mxint8, affine4, affine3]``), so the exported codes are the ones it learnt,
stored at exactly mlx_lm's cost (docs/numerics.md, "Derived affine").

``nvfp4`` is derived the same way (its E4M3 scale is no power of two, so no slicing reaches it):
``W_nvfp4 = dequantize(quantize_nvfp4(dequantize(anchor)))`` in blocks of 16, mfqat's nvfp4 rule
(mfqat.quant.nvfp4), float32 values (an MXFP8 / MXINT8 value is exact there); the group is always 16.
"""
from __future__ import annotations

import torch

from mfqat.formats import NVFP4_BLOCK, FormatLike, check_sliceable, get_format
from mfqat.quant.api import fake_quantize, quantize
from mfqat.quant.mxtensor import MXTensor

DERIVED_GROUP_SIZE = 64  # mlx_lm.convert's default group size
DERIVED_DTYPE = torch.bfloat16  # the scale / bias dtype mlx_lm.convert writes for a bf16 model


def is_derived(fmt: FormatLike) -> bool:
    """True for the affine formats and nvfp4, which an MX anchor reaches by re-quantization, not slicing."""
    return get_format(fmt).family in ("affine", "nvfp4")


def derived_group(fmt: FormatLike, group_size: int = DERIVED_GROUP_SIZE) -> int:
    """The group a derived format is re-quantized in: ``group_size`` for affine, a grouped affine format's own
    (``affine3@g128``: 128), always 16 for nvfp4."""
    f = get_format(fmt)
    return NVFP4_BLOCK if f.family == "nvfp4" else (f.group or group_size)


def check_reachable(anchor_fmt: FormatLike, fmt: FormatLike, name: str = "tensor") -> None:
    """Raise ValueError unless ``fmt`` comes from an ``anchor_fmt`` anchor: by Slice-and-Scale (same
    MX family, at or below its bits) or by affine derivation (from any MX anchor)."""
    if is_derived(fmt):
        if not get_format(anchor_fmt).is_mx:
            raise ValueError(f"{name}: {get_format(fmt).name} is derived from an MX anchor, not from {anchor_fmt}")
        return
    check_sliceable(anchor_fmt, fmt, name=name)


def derive_affine(values: torch.Tensor, fmt: FormatLike, group_size: int = DERIVED_GROUP_SIZE) -> MXTensor:
    """The affine codes, bfloat16 scales and biases MLX would store for ``values`` (an anchor's
    dequantized weights); ``.dequantize()`` gives what mx.dequantize gives."""
    return quantize(values.to(DERIVED_DTYPE), fmt, derived_group(fmt, group_size))


def fake_derive_affine(w: torch.Tensor, fmt: FormatLike, group_size: int = DERIVED_GROUP_SIZE) -> torch.Tensor:
    """``derive_affine(w, fmt).dequantize()`` in w's dtype, straight-through gradient (for MF-QAT)."""
    return fake_quantize(w.to(DERIVED_DTYPE), fmt, derived_group(fmt, group_size)).to(w.dtype)


def derive(values: torch.Tensor, fmt: FormatLike, group_size: int = DERIVED_GROUP_SIZE) -> MXTensor:
    """A derived format of an anchor's dequantized values: affine (:func:`derive_affine`) or nvfp4
    (float32 values, blocks of 16, mfqat's rule)."""
    if get_format(fmt).family == "nvfp4":
        return quantize(values.to(torch.float32), fmt, NVFP4_BLOCK)
    return derive_affine(values, fmt, group_size)


def fake_derive(w: torch.Tensor, fmt: FormatLike, group_size: int = DERIVED_GROUP_SIZE) -> torch.Tensor:
    """``derive(w, fmt).dequantize()`` in w's dtype, straight-through gradient (for MF-QAT)."""
    if get_format(fmt).family == "nvfp4":
        return fake_quantize(w.to(torch.float32), fmt, NVFP4_BLOCK).to(w.dtype)
    return fake_derive_affine(w, fmt, group_size)
