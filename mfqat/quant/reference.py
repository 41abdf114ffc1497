"""The pure-PyTorch reference quantizer: the single source of truth for mfqat's numerics.

Everything here works on float32 blocks of shape ``(..., n_blocks, block_size)`` and is exact:
powers of two are built from exponent bits, floor(log2) comes from the float's exponent bits,
and every multiplication by a power of two is exact in float32 (docs/numerics.md). Other paths
(Triton, C++, MLX, the exporter) are tested bit for bit against these functions.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from mfqat.formats import ElementFormat
from mfqat.quant.reference_bnb import (int8_absmax_dequantize_blocks, int8_absmax_quantize_blocks, nf4_dequantize_blocks,
                            nf4_double_quant_absmax, nf4_quantize_blocks)

E8M0_BIAS = 127
E8M0_NAN = 255
SCALE_RULES = ("floor", "ceil")


def exp2i(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer tensors e in [-149, 127] (subnormals included)."""
    e = e.to(torch.int32)
    normal_bits = (e.clamp(min=-126) + 127) << 23
    sub_bits = torch.ones_like(e) << (e.clamp(-149, -127) + 149)
    bits = torch.where(e >= -126, normal_bits, sub_bits)
    return bits.view(torch.float32)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2|a|) from the float32 exponent bits; -127 for zeros and subnormals.

    Subnormal inputs give -127 (an upper bound of their true exponent); every caller clamps
    to an exponent range that lies above it, so the result is exact where it matters.
    """
    bits = a.to(torch.float32).view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127


# ----------------------------------------------------------------------------- MX scales


def dtype_max_exponent(dtype: torch.dtype) -> int:
    """floor(log2) of the largest finite value of a float dtype: 15 for float16, 127 for bf16/fp32."""
    return math.frexp(torch.finfo(dtype).max)[1] - 1


def mx_shared_exponent(blocks: torch.Tensor, fmt: ElementFormat, scale_rule: str = "floor",
                       max_exp: int = 127) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent s per block and a mask of non-finite blocks.

    floor (OCP): s = floor(log2(amax)) - emax. ceil: the smallest s with amax / 2^s <= max_normal
    (the block maximum never saturates), capped at ``max_exp - emax`` where ``max_exp`` is
    floor(log2) of the input dtype's largest finite value (:func:`dtype_max_exponent`).

    The ceil cap keeps finite inputs finite: ``max_normal * 2^(max_exp - emax)`` is at most the
    dtype's maximum for every format and dtype (max_normal / 2^emax <= 1.984375, the largest
    mantissa 1.9921875 of bfloat16 is above it), whereas one more step up would overflow. So
    ceil's exponent is lowered by one exactly when ``2^s * max_normal`` would overflow the
    input dtype, and that block saturates (as under floor) instead of rounding up to inf. The
    floor exponent never exceeds the cap. s is then clamped to [-127, 127]; all-zero blocks
    get -127.
    """
    amax = blocks.abs().amax(dim=-1)
    nonfinite = ~torch.isfinite(amax)
    amax = torch.where(nonfinite, torch.zeros_like(amax), amax)
    s = floor_log2(amax) - fmt.emax
    if scale_rule == "ceil":
        scaled = amax * exp2i((-s).clamp(-149, 127))
        s = s + (scaled > fmt.max_normal).to(torch.int32)
        s = s.clamp(max=max_exp - fmt.emax)
    elif scale_rule != "floor":
        raise ValueError(f"unknown scale_rule '{scale_rule}'; choose one of {SCALE_RULES}")
    s = s.clamp(-127, 127)
    return s, nonfinite


def e8m0_from_exponent(s: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (s + 127; 255 = NaN) from shared exponents."""
    byte = (s + E8M0_BIAS).to(torch.int32)
    byte = torch.where(nonfinite, torch.full_like(byte, E8M0_NAN), byte)
    return byte.to(torch.uint8)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 value of E8M0 bytes; 255 decodes to NaN."""
    s = scales.to(torch.int32) - E8M0_BIAS
    x = exp2i(s.clamp(max=127))
    return torch.where(scales.to(torch.int32) == E8M0_NAN, torch.full_like(x, float("nan")), x)


# ----------------------------------------------------------------------------- MX elements


def mx_round_elements(y: torch.Tensor, fmt: ElementFormat) -> Tuple[torch.Tensor, torch.Tensor]:
    """Round scaled elements y = V / X to the element grid (half to even, saturating).

    Returns (values on the element grid as float32, mask of elements that saturated).
    """
    a = y.abs()
    saturated = a > fmt.max_normal
    if fmt.family == "mxint":
        step = float(2 ** fmt.int_shift)
        q = torch.round(y * step).clamp(fmt.code_min, fmt.code_max) / step
        return q, saturated
    e = floor_log2(a).clamp(min=fmt.emin)
    quantum = exp2i(e - fmt.mbits)
    q = torch.round(a / quantum) * quantum
    q = torch.minimum(q, torch.full_like(q, fmt.max_normal))
    return torch.copysign(q, y), saturated


def mx_values_to_codes(q: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Element-grid values -> stored codes (int8 for MXINT, uint8 bit patterns for MXFP)."""
    if fmt.family == "mxint":
        return (q * float(2 ** fmt.int_shift)).to(torch.int8)
    a = q.abs()
    sign = torch.signbit(q).to(torch.int32)
    e = floor_log2(a).clamp(min=fmt.emin)
    subnormal = a < 2.0 ** fmt.emin
    exp_field = torch.where(subnormal, torch.zeros_like(e), e + fmt.bias)
    mant = a / exp2i(e - fmt.mbits)  # exact integer in [0, 2^(mbits+1))
    mant = torch.where(subnormal, mant, mant - 2 ** fmt.mbits).to(torch.int32)
    code = (sign << (fmt.ebits + fmt.mbits)) | (exp_field << fmt.mbits) | mant
    return code.to(torch.uint8)


def mx_codes_to_values(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Stored codes -> element values as float32 (exact)."""
    if fmt.family == "mxint":
        return codes.to(torch.float32) / float(2 ** fmt.int_shift)
    c = codes.to(torch.int32)
    sign = (c >> (fmt.ebits + fmt.mbits)) & 1
    exp_field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = c & ((1 << fmt.mbits) - 1)
    subnormal = exp_field == 0
    e = torch.where(subnormal, torch.full_like(exp_field, fmt.emin), exp_field - fmt.bias)
    sig = torch.where(subnormal, mant, mant + (1 << fmt.mbits)).to(torch.float32)
    v = sig * exp2i(e - fmt.mbits)
    return torch.where(sign.bool(), -v, v)


def mx_quantize_blocks(blocks: torch.Tensor, fmt: ElementFormat, scale_rule: str = "floor",
                       max_exp: int = 127) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks -> (codes, E8M0 scale bytes). Non-finite blocks get scale 255, codes 0.

    ``max_exp``: :func:`dtype_max_exponent` of the dtype the blocks came from (the ceil cap).
    """
    s, nonfinite = mx_shared_exponent(blocks, fmt, scale_rule, max_exp)
    return mx_encode_blocks(blocks, fmt, s, nonfinite)


def mx_encode_blocks(blocks: torch.Tensor, fmt: ElementFormat, s: torch.Tensor, nonfinite: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks and given shared exponents s (int32 in [-127, 127], one per block) -> (codes,
    E8M0 bytes); any exponent is a legal MX block (elements beyond the grid saturate)."""
    y = blocks * exp2i(-s).unsqueeze(-1)
    y = torch.where(nonfinite.unsqueeze(-1), torch.zeros_like(y), y)
    q, _ = mx_round_elements(y, fmt)
    return mx_values_to_codes(q, fmt), e8m0_from_exponent(s, nonfinite)


def mx_dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """(codes, E8M0 bytes) -> float32 blocks."""
    return mx_codes_to_values(codes, fmt) * e8m0_to_float(scales).unsqueeze(-1)


def mx_fake_quantize_blocks(blocks: torch.Tensor, fmt: ElementFormat, scale_rule: str = "floor",
                            max_exp: int = 127) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize-dequantize float32 blocks without materialising codes.

    Returns (dequantized float32 blocks, mask of saturated elements). Equal, bit for bit, to
    ``mx_dequantize_blocks(*mx_quantize_blocks(blocks))``. ``max_exp`` as in :func:`mx_quantize_blocks`.
    """
    s, nonfinite = mx_shared_exponent(blocks, fmt, scale_rule, max_exp)
    y = blocks * exp2i(-s).unsqueeze(-1)
    q, saturated = mx_round_elements(y, fmt)
    out = q * exp2i(s).unsqueeze(-1)
    out = torch.where(nonfinite.unsqueeze(-1), torch.full_like(out, float("nan")), out)
    return out, saturated & ~nonfinite.unsqueeze(-1)


# ----------------------------------------------------------------------------- affine


AFFINE_EPS = 1e-7  # MLX's floor on the affine scale


def affine_quantize_blocks(blocks: torch.Tensor, fmt: ElementFormat, dtype: torch.dtype = torch.float32
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLX's affine rule (``mx.quantize(w, group_size, bits)``, mode affine), bit for bit.

    In float32: s = max((max - min) / (2^k - 1), 1e-7); the edge of larger magnitude (min when
    |min| > |max|, else max, with s negated) is made exact: q0 = round(edge / s) and, when q0 != 0,
    s = edge / q0 and bias = edge (else bias = 0). Codes are round((w - bias) / s) clamped to
    [0, 2^k - 1]; scale and bias are then rounded to the input ``dtype`` (MLX returns them in it),
    held here as float32. Returns (codes uint8, scales float32, biases float32); scales may be
    negative (the max edge case), exactly as MLX stores them.
    """
    n_bins = float(2 ** fmt.bits - 1)
    wmin, wmax = blocks.amin(dim=-1), blocks.amax(dim=-1)
    use_min = wmin.abs() > wmax.abs()
    scale = torch.clamp_min((wmax - wmin) / n_bins, AFFINE_EPS)
    scale = torch.where(use_min, scale, -scale)
    edge = torch.where(use_min, wmin, wmax)
    q0 = torch.round(edge / scale)
    scale = torch.where(q0 != 0, edge / q0, scale)
    bias = torch.where(q0 != 0, edge, torch.zeros_like(edge))
    q = torch.round((blocks - bias.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, n_bins)
    return q.to(torch.uint8), scale.to(dtype).float(), bias.to(dtype).float()


def affine_dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Affine codes -> float32 blocks, computed as ``mx.dequantize`` does for scales of ``dtype``:
    ``code * scale + bias`` in that dtype's arithmetic (bfloat16: two roundings, product then sum;
    they differ from one float32 evaluation in up to a third of the elements)."""
    if dtype == torch.float32:
        return codes.to(torch.float32) * scales.unsqueeze(-1) + biases.unsqueeze(-1)
    return (codes.to(dtype) * scales.to(dtype).unsqueeze(-1) + biases.to(dtype).unsqueeze(-1)).float()


# ----------------------------------------------------------------------------- whole tensors


def to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(..., K) any float dtype -> float32 (..., K // block_size, block_size)."""
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def quantize_blocks(blocks: torch.Tensor, fmt: ElementFormat, scale_rule: str = "floor",
                    dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Dispatch on the family: (codes, scales, biases or None) for float32 blocks of a ``dtype``
    tensor (affine scales and biases are rounded to ``dtype``, as MLX does; the MX ceil cap
    follows ``dtype``'s largest exponent)."""
    if fmt.is_mx:
        codes, scales = mx_quantize_blocks(blocks, fmt, scale_rule, dtype_max_exponent(dtype))
        return codes, scales, None
    if fmt.family == "nf4":
        codes, absmax = nf4_quantize_blocks(blocks)
        return codes, (nf4_double_quant_absmax(absmax) if fmt.double_quant else absmax), None
    if fmt.family == "absmax":
        codes, absmax = int8_absmax_quantize_blocks(blocks)
        return codes, absmax, None
    _refuse_nvfp4(fmt)
    return affine_quantize_blocks(blocks, fmt, dtype)


def _refuse_nvfp4(fmt: ElementFormat) -> None:
    """nvfp4 has its own reference (mfqat.quant.nvfp4, which builds on this module's helpers; callers
    dispatch to it: api.quantize, MXTensor.dequantize, the kernels' fake-quant dispatch)."""
    if fmt.family == "nvfp4":
        raise ValueError("nvfp4 is quantized by mfqat.quant.nvfp4 (nvfp4_quantize_blocks), not here")


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, biases: Optional[torch.Tensor],
                      fmt: ElementFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dispatch on the family: float32 blocks from stored codes (affine: in the arithmetic of the
    ``dtype`` its scales were made for, as MLX dequantizes)."""
    if fmt.is_mx:
        return mx_dequantize_blocks(codes, scales, fmt)
    _refuse_nvfp4(fmt)
    if fmt.family == "nf4":
        return nf4_dequantize_blocks(codes, scales)
    if fmt.family == "absmax":
        return int8_absmax_dequantize_blocks(codes, scales)
    return affine_dequantize_blocks(codes, scales, biases, dtype)


def fake_quantize_reference(x: torch.Tensor, fmt: ElementFormat, block_size: int,
                            scale_rule: str = "floor") -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize-dequantize x (any float dtype, last axis blocked) -> (x's dtype, saturated mask)."""
    blocks = to_blocks(x, block_size)
    if fmt.is_mx:
        out, saturated = mx_fake_quantize_blocks(blocks, fmt, scale_rule, dtype_max_exponent(x.dtype))
    else:
        codes, scales, biases = quantize_blocks(blocks, fmt, scale_rule, x.dtype)
        out = dequantize_blocks(codes, scales, biases, fmt, x.dtype)
        saturated = torch.zeros_like(out, dtype=torch.bool)
    return out.reshape(x.shape).to(x.dtype), saturated.reshape(x.shape)


def quantize_reference(x: torch.Tensor, fmt: ElementFormat, block_size: int, scale_rule: str = "floor"
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX codes (x's shape) and E8M0 bytes (..., K // block_size) of x in any float dtype."""
    codes, scales = mx_quantize_blocks(to_blocks(x, block_size), fmt, scale_rule, dtype_max_exponent(x.dtype))
    return codes.reshape(x.shape), scales
