"""Slice-and-Scale: turn an MX anchor into a lower format of the same family, no re-training.

MXINT a -> b (r = a - b): ``P_b = clamp(round_half_even(P_a / 2^r), ±(2^(b-1)-1))``, the shared
exponent unchanged (a rounded right shift). MXFP high -> low: ``s_low = s_high + (emax_high -
emax_low)`` and each element re-rounded to the low grid from ``P_high / 2^(emax_high - emax_low)``,
round half to even, saturating, subnormals kept (docs/numerics.md).

The contract every test checks: the result equals direct quantization (floor rule) of the
anchor's dequantized values, bit for bit. For MXFP this needs one refinement of the plain exponent-shift formula,
applied here: a block whose anchor exponent was clamped at -127 (values below 2^-127) takes the
exponent that direct quantization would, ``clamp(floor(log2 max|P_high|) + s_high - emax_low)``,
which equals ``s_high + emax_high - emax_low`` for every block that was not clamped.
"""
from __future__ import annotations

from typing import Optional

import torch

from mfqat.formats import FormatLike, check_sliceable, get_format  # noqa: F401 (check_sliceable re-exported)
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.reference import (E8M0_BIAS, E8M0_NAN, exp2i, floor_log2, mx_codes_to_values,
                              mx_round_elements, mx_values_to_codes)


def slice_and_scale(q: MXTensor, fmt: FormatLike, scale_rule: Optional[str] = None,
                    importance: Optional[torch.Tensor] = None) -> MXTensor:
    """Convert an MX tensor to a lower format of its family (see module docs); exact and vectorised.

    ``scale_rule``: the lower format's rule (default: ``q.slice_rules[fmt]``, recorded in the anchor,
    else floor). ``floor`` is the shift/re-rounding above. ``ceil`` gives, bit for bit, direct
    quantization of the anchor's (exactly) dequantized values under ceil, with ceil's overflow cap
    from ``q.dtype``: what train-through-anchor's second rounding computes. ``search`` picks each
    block's exponent by :func:`mfqat.quant.scale_search.mx_search_exponent` against the anchor's
    values (``importance``: per input column; default ``q.importance``, else plain squared error).
    The anchor's own format comes back
    unchanged (its rule was chosen when it was quantized).
    """
    dst = get_format(fmt)
    check_sliceable(q.fmt, dst)
    rule = scale_rule or (q.slice_rules or {}).get(dst.name, "floor")
    if rule == "search" and importance is None:
        importance = q.importance
    if dst != q.fmt and (rule != "floor" or importance is not None):
        return _slice_by_rule(q, dst, rule, importance)
    if dst == q.fmt:
        return MXTensor(q.codes.clone(), q.scales.clone(), dst, q.block_size, q.dtype, None, q.scale_rule)
    bs = q.block_size
    from mfqat.quant.kernels import slice_dispatch

    fast = slice_dispatch(q.codes, q.scales, q.fmt, dst, bs)
    if fast is not None:
        return MXTensor(fast[0].reshape(q.shape), fast[1].reshape(q.scales.shape), dst, bs, q.dtype, None, q.scale_rule)
    return slice_reference(q, dst)


def slice_reference(q: MXTensor, dst) -> MXTensor:
    """The pure-PyTorch Slice-and-Scale (the oracle of the C++ and Triton paths)."""
    bs = q.block_size
    codes = q.codes.reshape(*q.shape[:-1], q.shape[-1] // bs, bs)
    if dst.family == "mxint":
        r = q.fmt.bits - dst.bits
        new = torch.round(codes.to(torch.float32) / float(2 ** r)).clamp(dst.code_min, dst.code_max)
        return MXTensor(new.to(torch.int8).reshape(q.shape), q.scales.clone(), dst, bs, q.dtype, None, q.scale_rule)
    values = mx_codes_to_values(codes, q.fmt)
    nan_block = q.scales == E8M0_NAN
    s_high = q.scales.to(torch.int32) - E8M0_BIAS
    amax = values.abs().amax(dim=-1)
    s_low = (floor_log2(amax) + s_high - dst.emax).clamp(-127, 127)
    s_low = torch.where(amax == 0, torch.full_like(s_low, -127), s_low)
    s_low = torch.where(nan_block, s_high, s_low)
    y = values * exp2i((s_high - s_low).clamp(-149, 127)).unsqueeze(-1)
    rounded, _ = mx_round_elements(y, dst)
    new_codes = mx_values_to_codes(rounded, dst)
    new_codes = torch.where(nan_block.unsqueeze(-1), torch.zeros_like(new_codes), new_codes)
    scales = torch.where(nan_block, q.scales.to(torch.int32), s_low + E8M0_BIAS).to(torch.uint8)
    return MXTensor(new_codes.reshape(q.shape), scales, dst, bs, q.dtype, None, q.scale_rule)


def double_rounding_fraction(x: torch.Tensor, anchor_fmt: FormatLike, fmt: FormatLike,
                             block_size: int = 32) -> float:
    """Fraction of elements where Slice-and-Scale from an anchor differs from direct quantization of x."""
    from mfqat.quant.api import quantize

    sliced = slice_and_scale(quantize(x, anchor_fmt, block_size), fmt).dequantize(torch.float32)
    direct = quantize(x, fmt, block_size).dequantize(torch.float32)
    return (sliced != direct).float().mean().item()



def _slice_by_rule(q: MXTensor, dst, scale_rule: str, importance: Optional[torch.Tensor]) -> MXTensor:
    """Slice-and-Scale whose lower exponents follow ``scale_rule`` (see :func:`slice_and_scale`)."""
    from mfqat.quant.reference import SCALE_RULES, dtype_max_exponent, mx_shared_exponent
    from mfqat.quant.scale_search import search_exponents

    if scale_rule not in (*SCALE_RULES, "search"):
        raise ValueError(f"unknown scale_rule '{scale_rule}' for {dst.name}; choose one of {(*SCALE_RULES, 'search')}")
    bs = q.block_size
    blocks = q.dequantize(torch.float32).reshape(*q.shape[:-1], q.shape[-1] // bs, bs)  # exact
    max_exp = dtype_max_exponent(q.dtype)
    if scale_rule == "search":  # the anchor's values in its dtype (exact there): the C++ op where it applies
        s, nonfinite = search_exponents(q.dequantize(q.dtype), dst, bs, importance)
    else:
        s, nonfinite = mx_shared_exponent(blocks, dst, scale_rule, max_exp)
    return slice_at_exponents(q, dst, s, nonfinite, scale_rule, blocks)


def slice_at_exponents(q: MXTensor, fmt: FormatLike, s: torch.Tensor, nonfinite: torch.Tensor,
                       scale_rule: str = "search", blocks: Optional[torch.Tensor] = None) -> MXTensor:
    """``q`` lowered to ``fmt`` at the given shared exponents ``s`` (int32, one per block) with non-finite blocks
    ``nonfinite``: the anchor's exact values encoded again (``mx_encode_blocks``; any exponent is a legal MX
    block). ``blocks``: q's float32 blocks when the caller holds them. ``scale_rule`` labels the result."""
    from mfqat.quant.reference import mx_encode_blocks

    dst, bs = get_format(fmt), q.block_size
    if blocks is None:
        blocks = q.dequantize(torch.float32).reshape(*q.shape[:-1], q.shape[-1] // bs, bs)  # exact
    codes, scales = mx_encode_blocks(blocks, dst, s, nonfinite)
    return MXTensor(codes.reshape(q.shape), scales, dst, bs, q.dtype, None, scale_rule)
