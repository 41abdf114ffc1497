"""MX / NF4 / affine quantization in MLX ops, bit-exact with :mod:`mfqat.quant.reference`.

The same recipe as the PyTorch oracle, op for op: powers of two built from exponent bits,
floor(log2) read from the float32 exponent field, ``mx.round`` (half to even, sign of zero kept),
saturation by clamping. tests/test_mlx.py checks codes, scales and fake-quant outputs against the
PyTorch reference on adversarial and hypothesis inputs (MLX CPU backend; the same ops run on Metal).

The straight-through estimator is an ``mx.custom_function`` whose forward is exactly
``qdq(w)`` and whose VJP passes the cotangent through. The usual formulation writes it as
``w + mx.stop_gradient(qdq(w) - w)``; that form is the same gradient but its forward rounds twice
(``w + (q - w)`` need not equal ``q`` in float arithmetic), which would break bit-exactness with
the PyTorch forward, so mfqat uses the custom function.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Tuple

import mlx.core as mx

from mfqat.formats import NF4_CODEBOOK, ElementFormat, FormatLike, get_format

E8M0_NAN = 255
AFFINE_EPS = 1e-7  # MLX's floor on the affine scale


def _bits(x: mx.array) -> mx.array:
    return mx.view(x.astype(mx.float32), mx.int32)


def exp2i(e: mx.array) -> mx.array:
    """Exact float32 2**e for int32 e in [-149, 127] (subnormals included)."""
    e = e.astype(mx.int32)
    normal = (mx.maximum(e, -126) + 127) << 23
    sub = mx.left_shift(mx.ones_like(e), mx.clip(e, -149, -127) + 149)
    return mx.view(mx.where(e >= -126, normal, sub), mx.float32)


def floor_log2(a: mx.array) -> mx.array:
    """floor(log2|a|) from the exponent bits; -127 for zeros and subnormals (as the reference)."""
    return ((_bits(a) >> 23) & 0xFF) - 127


def to_blocks(x: mx.array, block_size: int) -> mx.array:
    """(..., K) -> float32 (..., K // block_size, block_size)."""
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise ValueError(f"shape {tuple(x.shape)}: last dimension is not a multiple of block_size={block_size}")
    return x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // block_size, block_size)


def max_exponent(dtype) -> int:
    """floor(log2) of the largest finite value of an MLX float dtype (reference: dtype_max_exponent)."""
    return 15 if dtype == mx.float16 else 127


def shared_exponent(blocks: mx.array, fmt: ElementFormat, scale_rule: str = "floor", max_exp: int = 127
                    ) -> Tuple[mx.array, mx.array]:
    """Per-block shared exponent (clamped to [-127, 127]) and the non-finite-block mask.

    Under ceil, s is capped at ``max_exp - emax`` (the input dtype's, see the reference's
    mx_shared_exponent) so that finite inputs stay finite."""
    finite = mx.isfinite(blocks)
    nonfinite = mx.logical_not(finite.all(axis=-1))  # NaN or Inf anywhere in the block
    amax = mx.where(finite, mx.abs(blocks), 0.0).max(axis=-1)
    s = floor_log2(amax) - fmt.emax
    if scale_rule == "ceil":
        scaled = amax * exp2i(mx.clip(-s, -149, 127))
        s = mx.minimum(s + (scaled > fmt.max_normal).astype(mx.int32), max_exp - fmt.emax)
    elif scale_rule != "floor":
        raise ValueError(f"unknown scale_rule '{scale_rule}'; choose floor or ceil")
    return mx.clip(s, -127, 127), nonfinite


def round_elements(y: mx.array, fmt: ElementFormat) -> Tuple[mx.array, mx.array]:
    """Round scaled elements to the element grid -> (grid values float32, saturated mask)."""
    a = mx.abs(y)
    saturated = a > fmt.max_normal
    if fmt.family == "mxint":
        step = float(2 ** fmt.int_shift)
        q = mx.clip(mx.round(y * step), fmt.code_min, fmt.code_max) / step
        return q, saturated
    e = mx.maximum(floor_log2(a), fmt.emin)
    quantum = exp2i(e - fmt.mbits)
    q = mx.round(a / quantum) * quantum
    q = mx.minimum(q, fmt.max_normal)
    sign = _bits(y) < 0
    return mx.where(sign, -q, q), saturated


def values_to_codes(q: mx.array, fmt: ElementFormat) -> mx.array:
    """Element-grid values -> codes (int8 MXINT, uint8 bit patterns MXFP)."""
    if fmt.family == "mxint":
        return (q * float(2 ** fmt.int_shift)).astype(mx.int8)
    a = mx.abs(q)
    sign = (_bits(q) < 0).astype(mx.int32)
    e = mx.maximum(floor_log2(a), fmt.emin)
    subnormal = a < 2.0 ** fmt.emin
    exp_field = mx.where(subnormal, mx.zeros_like(e), e + fmt.bias)
    mant = a / exp2i(e - fmt.mbits)
    mant = mx.where(subnormal, mant, mant - 2 ** fmt.mbits).astype(mx.int32)
    code = (sign << (fmt.ebits + fmt.mbits)) | (exp_field << fmt.mbits) | mant
    return code.astype(mx.uint8)


def codes_to_values(codes: mx.array, fmt: ElementFormat) -> mx.array:
    """Codes -> element values (float32, exact)."""
    if fmt.family == "mxint":
        return codes.astype(mx.float32) / float(2 ** fmt.int_shift)
    c = codes.astype(mx.int32)
    sign = (c >> (fmt.ebits + fmt.mbits)) & 1
    exp_field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mant = c & ((1 << fmt.mbits) - 1)
    subnormal = exp_field == 0
    e = mx.where(subnormal, mx.full(exp_field.shape, fmt.emin, mx.int32), exp_field - fmt.bias)
    sig = mx.where(subnormal, mant, mant + (1 << fmt.mbits)).astype(mx.float32)
    v = sig * exp2i(e - fmt.mbits)
    return mx.where(sign.astype(mx.bool_), -v, v)


def _nf4(blocks: mx.array) -> Tuple[mx.array, mx.array]:
    absmax = mx.abs(blocks).max(axis=-1)
    inv = mx.where(absmax > 0, 1.0 / absmax, mx.zeros_like(absmax))
    y = blocks * inv[..., None]
    table = mx.array(NF4_CODEBOOK, dtype=mx.float32)
    mids = (table[1:] + table[:-1]) / 2
    above = (y[..., None] > mids) | mx.isnan(y)[..., None]  # ties -> lower entry; NaN last (bucketize)
    codes = above.astype(mx.uint8).sum(axis=-1).astype(mx.uint8)
    return codes, absmax


def _affine(blocks: mx.array, fmt: ElementFormat, dtype=mx.float32) -> Tuple[mx.array, mx.array, mx.array]:
    """MLX's own affine rule in MLX ops (see :func:`mfqat.quant.reference.affine_quantize_blocks`);
    scales and biases rounded to ``dtype`` and returned as float32."""
    n_bins = float(2 ** fmt.bits - 1)
    wmin, wmax = blocks.min(axis=-1), blocks.max(axis=-1)
    use_min = mx.abs(wmin) > mx.abs(wmax)
    scale = mx.maximum((wmax - wmin) / n_bins, AFFINE_EPS)
    scale = mx.where(use_min, scale, -scale)
    edge = mx.where(use_min, wmin, wmax)
    q0 = mx.round(edge / scale)
    scale = mx.where(q0 != 0, edge / q0, scale)
    bias = mx.where(q0 != 0, edge, 0.0)
    q = mx.clip(mx.round((blocks - bias[..., None]) / scale[..., None]), 0, n_bins)
    return q.astype(mx.uint8), scale.astype(dtype).astype(mx.float32), bias.astype(dtype).astype(mx.float32)


def _blocked(x: mx.array, fmt: FormatLike, block_size: Optional[int]) -> Tuple[ElementFormat, int, mx.array]:
    """(format, checked block size, float32 blocks of x)."""
    f = get_format(fmt)
    bs = f.resolve_block_size(block_size)
    _check_mlx_format(f)
    return f, bs, to_blocks(x, bs)


def _check_mlx_format(f: ElementFormat) -> None:
    if f.family == "absmax" or f.double_quant:
        raise ValueError(f"format '{f.name}' is a bitsandbytes baseline for PyTorch only; MLX takes "
                         f"MX, nf4 and affine formats")
    if f.family == "nvfp4":
        raise ValueError("format 'nvfp4' is not implemented in mfqat's MLX numerics (train and quantize it in "
                         "PyTorch; export-mlx --recipe uniform:nvfp4 writes MLX's own nvfp4 layout)")


def quantize(x: mx.array, fmt: FormatLike, block_size: Optional[int] = None, scale_rule: str = "floor"
             ) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
    """(codes with x's shape, per-block scales, biases or None) - the same values as
    ``mfqat.quantize(x)``: E8M0 bytes for MX formats, absmax for NF4, scale/min for affine."""
    f, bs, blocks = _blocked(x, fmt, block_size)
    if f.is_mx:
        s, nonfinite = shared_exponent(blocks, f, scale_rule, max_exponent(x.dtype))
        y = mx.where(nonfinite[..., None], 0.0, blocks * exp2i(-s)[..., None])
        q, _ = round_elements(y, f)
        scales = mx.where(nonfinite, E8M0_NAN, s + 127).astype(mx.uint8)
        return values_to_codes(q, f).reshape(x.shape), scales, None
    if f.family == "nf4":
        codes, absmax = _nf4(blocks)
        return codes.reshape(x.shape), absmax, None
    codes, scale, bias = _affine(blocks, f, x.dtype)
    return codes.reshape(x.shape), scale, bias


def dequantize(codes: mx.array, scales: mx.array, fmt: FormatLike, block_size: Optional[int] = None,
               biases: Optional[mx.array] = None, dtype=mx.float32) -> mx.array:
    """Codes and scales (from :func:`quantize`) -> values in ``dtype`` (affine: computed in ``dtype``'s
    arithmetic, as ``mx.dequantize`` does with scales of that dtype)."""
    f = get_format(fmt)
    bs = f.resolve_block_size(block_size)
    _check_mlx_format(f)
    c = codes.reshape(*codes.shape[:-1], codes.shape[-1] // bs, bs)
    if f.is_mx:
        sc = scales.astype(mx.int32)
        scale = mx.where(sc == E8M0_NAN, mx.nan, exp2i(mx.minimum(sc - 127, 127)))
        out = codes_to_values(c, f) * scale[..., None]
    elif f.family == "nf4":
        out = mx.array(NF4_CODEBOOK, dtype=mx.float32)[c.astype(mx.int32)] * scales[..., None]
    else:
        out = c.astype(dtype) * scales.astype(dtype)[..., None] + biases.astype(dtype)[..., None]
    return out.reshape(codes.shape).astype(dtype)


def qdq(x: mx.array, fmt: FormatLike, block_size: Optional[int] = None, scale_rule: str = "floor"
        ) -> mx.array:
    """Quantize-dequantize (no gradient); x's shape and dtype."""
    f, bs, blocks = _blocked(x, fmt, block_size)
    if f.is_mx:
        s, nonfinite = shared_exponent(blocks, f, scale_rule, max_exponent(x.dtype))
        q, _ = round_elements(blocks * exp2i(-s)[..., None], f)
        out = mx.where(nonfinite[..., None], mx.nan, q * exp2i(s)[..., None])
        return out.reshape(x.shape).astype(x.dtype)
    codes, scales, biases = quantize(x, f, bs, scale_rule)
    return dequantize(codes, scales, f, bs, biases, x.dtype)


@lru_cache(maxsize=None)
def _ste(fmt_name: str, block_size: int, scale_rule: str):
    @mx.custom_function
    def fq(w):
        return qdq(w, fmt_name, block_size, scale_rule)

    @fq.vjp
    def fq_vjp(primals, cotangent, output):
        return cotangent

    return fq


def fake_quantize(x: mx.array, fmt: FormatLike, block_size: Optional[int] = None, scale_rule: str = "floor"
                  ) -> mx.array:
    """Quantize-dequantize with the straight-through gradient (identity backward)."""
    f = get_format(fmt)
    return _ste(f.name, f.resolve_block_size(block_size), scale_rule)(x)
