"""Public quantize / dequantize / fake-quantize, with input checks and backend dispatch."""
from __future__ import annotations

import operator
from typing import Optional

import torch

from mfqat.formats import ElementFormat, FormatLike, get_format
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.nvfp4 import nvfp4_quantize_blocks
from mfqat.quant.reference import SCALE_RULES, quantize_blocks, to_blocks

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def validate(x: torch.Tensor, fmt: FormatLike, block_size: Optional[int], scale_rule: str = "floor",
             name: str = "tensor") -> tuple[ElementFormat, int]:
    """Check a quantization request; return (format, block size) or raise a clear error."""
    f = get_format(fmt)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{name}: dtype {x.dtype} is not supported; quantize float32, bfloat16 or float16 "
            f"tensors (convert with .float())"
        )
    if block_size is not None and (isinstance(block_size, bool) or not hasattr(block_size, "__index__")):
        raise TypeError(f"{name}: block_size={block_size!r} is not an integer; give the number of elements per "
                        f"block (e.g. {f.default_block_size})")
    bs = f.resolve_block_size(None if block_size is None else operator.index(block_size))
    if x.dim() == 0 or x.shape[-1] % bs:
        raise ValueError(
            f"{name}: shape {tuple(x.shape)} has a last dimension that is not a multiple of "
            f"block_size={bs}; pad it or choose a block size that divides it"
        )
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown scale_rule '{scale_rule}'; choose one of {SCALE_RULES}")
    if scale_rule != "floor" and not f.is_mx:
        raise ValueError(f"scale_rule '{scale_rule}' applies to MX formats only, not '{f.name}'")
    return f, bs


def quantize(x: torch.Tensor, fmt: FormatLike, block_size: Optional[int] = None,
             scale_rule: str = "floor") -> MXTensor:
    """Quantize ``x`` in blocks along its last axis.

    Args:
        x: float32 / bfloat16 / float16 tensor of any leading shape.
        fmt: format name (``mxint4``, ``mxfp4``, ``nf4``, ``affine4``, ...) or ElementFormat.
        block_size: elements per block (default: the format's, 32 for MX formats).
        scale_rule: ``floor`` (OCP, default) or ``ceil`` (the block max never saturates, except where
            rounding it up would overflow x's dtype: see reference.mx_shared_exponent).

    Returns:
        An :class:`MXTensor` with unpacked codes and per-block scales.
    """
    f, bs = validate(x, fmt, block_size, scale_rule)
    if f.is_mx:
        from mfqat.quant.kernels import mx_quantize_dispatch

        codes, scales = mx_quantize_dispatch(x.detach(), f, bs, scale_rule)
        return MXTensor(codes, scales, f, bs, x.dtype, None, scale_rule)
    if f.family == "nvfp4":
        return quantize_nvfp4(x)
    if f.family == "affine":
        from mfqat.quant.kernels import affine_quantize_dispatch

        codes, scales, biases = affine_quantize_dispatch(x.detach(), f, bs)
        return MXTensor(codes, scales, f, bs, x.dtype, biases, scale_rule)
    codes, scales, biases = quantize_blocks(to_blocks(x.detach(), bs), f, scale_rule, x.dtype)
    return MXTensor(codes.reshape(x.shape), scales, f, bs, x.dtype, biases, scale_rule)


def quantize_nvfp4(x: torch.Tensor, global_scale: Optional[torch.Tensor] = None, rule: str = "nvidia") -> MXTensor:
    """``x`` (last axis a multiple of 16) in nvfp4 (mfqat.quant.nvfp4), with its optional float32
    ``global_scale`` (None: single-level, what ``quantize(x, "nvfp4")`` gives); ``rule`` "nvidia"
    (mfqat's) or "mlx" (``mx.quantize``'s)."""
    f, bs = validate(x, "nvfp4", 16)
    codes, scales = nvfp4_quantize_blocks(to_blocks(x.detach(), bs), global_scale, rule, x.dtype)
    g = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32).reshape(())
    return MXTensor(codes.reshape(x.shape), scales, f, bs, x.dtype, global_scale=g)


def dequantize(q: MXTensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Decode an :class:`MXTensor` to floats (its original dtype unless ``dtype`` is given)."""
    return q.dequantize(dtype)


class _FakeQuantSTE(torch.autograd.Function):
    """Quantize-dequantize forward - through ``anchor`` first when it is given, in one fused pass where
    a kernel has it - and straight-through backward, zeroed where a rounding saturated when
    ``mask_saturated``."""

    @staticmethod
    def forward(ctx, x, anchor, fmt, block_size, anchor_rule, scale_rule, mask_saturated):  # type: ignore[override]
        from mfqat.quant.kernels import fake_quantize_dispatch, fake_quantize_through_dispatch

        if anchor is None:
            out, saturated = fake_quantize_dispatch(x, fmt, block_size, scale_rule, need_mask=mask_saturated)
        else:
            out, saturated = fake_quantize_through_dispatch(x, anchor, fmt, block_size, anchor_rule, scale_rule,
                                                            need_mask=mask_saturated)
        if mask_saturated:
            ctx.save_for_backward(saturated)
        ctx.mask_saturated = mask_saturated
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        if ctx.mask_saturated:
            (saturated,) = ctx.saved_tensors
            grad = grad.masked_fill(saturated, 0)
        return grad, None, None, None, None, None, None


def fake_quantize(x: torch.Tensor, fmt: FormatLike, block_size: Optional[int] = None,
                  scale_rule: str = "floor", mask_saturated: bool = False) -> torch.Tensor:
    """Quantize then dequantize ``x`` (same shape and dtype), differentiable by the STE.

    The backward pass is the identity (straight-through estimator); with
    ``mask_saturated=True`` the gradient of elements that saturated is zeroed.
    """
    f, bs = validate(x, fmt, block_size, scale_rule)
    return _FakeQuantSTE.apply(x, None, f, bs, "floor", scale_rule, mask_saturated)


def fake_quantize_through(x: torch.Tensor, anchor_fmt: FormatLike, fmt: FormatLike, block_size: Optional[int] = None,
                          anchor_rule: str = "floor", scale_rule: str = "floor",
                          mask_saturated: bool = False) -> torch.Tensor:
    """Train-through-anchor: ``fake_quantize(fake_quantize(x, anchor_fmt, bs, anchor_rule), fmt, bs,
    scale_rule)`` bit for bit, in one fused pass on the C++ / Triton backends.

    That is the weight Slice-and-Scale deploys in ``fmt`` from an anchor saved in ``anchor_fmt``
    (with ``scale_rule="floor"``, the rule Slice-and-Scale uses). The gradient is straight-through
    both roundings; with ``mask_saturated=True`` it is zeroed where either stage saturated.
    """
    a, bs = validate(x, anchor_fmt, block_size, anchor_rule, name="tensor (anchor format)")
    f, bs_f = validate(x, fmt, bs, scale_rule)
    return _FakeQuantSTE.apply(x, a, f, bs_f, anchor_rule, scale_rule, mask_saturated)
