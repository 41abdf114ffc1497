"""Triton kernels (NVIDIA GPUs; ``TRITON_INTERPRET=1`` runs them on CPU for the tests).

One fused pass per block row: block max from the absolute float32 bit patterns (an integer max, so
NaN/Inf blocks are found from the same value), the E8M0 exponent from its exponent bits, element
rounding half-to-even with the 1.5*2^23 trick (the element grids keep |t| < 2^22), sign of zero
restored from the input's sign bit, dequantization by exact powers of two built from bits. Bit-exact
with :mod:`mfqat.quant.reference` (tests/test_kernels.py).

Importing this module never fails: :data:`AVAILABLE` is False when Triton is missing.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from mfqat.formats import ElementFormat
from mfqat.quant.reference import dtype_max_exponent

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except Exception:  # pragma: no cover - triton is an optional extra
    AVAILABLE = False

ROUND_MAGIC = 12582912.0  # 1.5 * 2^23


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def usable_on(device: torch.device) -> bool:
    """Triton can run on ``device``: a CUDA device, or any device under the interpreter."""
    return AVAILABLE and (device.type == "cuda" or (interpreting() and device.type == "cpu"))


if AVAILABLE:
    @triton.jit
    def _exp2i(e):
        """Exact float32 2**e for int32 e in [-149, 127]."""
        normal = (tl.maximum(e, -126) + 127) << 23
        sub = tl.full(e.shape, 1, tl.int32) << (tl.minimum(tl.maximum(e, -149), -127) + 149)
        return tl.where(e >= -126, normal, sub).to(tl.float32, bitcast=True)

    @triton.jit
    def _exp2i_normal(e):
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _rne(t):
        """Round half to even for |t| < 2^22, keeping the sign of t (also for zeros)."""
        r = (t + 12582912.0) - 12582912.0
        rb = r.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        sign = t.to(tl.int32, bitcast=True) & -2147483648
        return (rb | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def _load_f32(ptr, offs, valid, BF16: tl.constexpr):
        """Load as float32. bfloat16 arrives as int16 bits and widens by a shift (exact, subnormals
        included; the interpreter's own bf16 conversion flushes subnormals)."""
        if BF16:
            bits = tl.load(ptr + offs, mask=valid, other=0).to(tl.int32) & 0xFFFF
            return (bits << 16).to(tl.float32, bitcast=True)
        return tl.load(ptr + offs, mask=valid, other=0.0).to(tl.float32)

    @triton.jit
    def _store_from_f32(ptr, offs, v, valid, BF16: tl.constexpr):
        """Store float32 v in the output dtype; bfloat16 by round-half-even on the bits, NaN -> 0x7fc0
        (c10's rule, so the result equals tensor.to(torch.bfloat16))."""
        if BF16:
            b = v.to(tl.int32, bitcast=True)
            r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
            r = tl.where(v != v, 0x7FC0, r)
            tl.store(ptr + offs, r.to(tl.int16), mask=valid)
        else:
            tl.store(ptr + offs, v.to(ptr.dtype.element_ty), mask=valid)

    @triton.jit
    def _block_exponent(x, EMAX: tl.constexpr, MAX_NORMAL: tl.constexpr, CEIL: tl.constexpr,
                        MAX_EXP: tl.constexpr):
        """Shared exponent s (clamped to [-127, 127]) and non-finite flag per block row; under ceil,
        s is capped at MAX_EXP - EMAX so that 2^s * max_normal stays finite in the input dtype."""
        abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        max_bits = tl.max(abs_bits, axis=1)
        nonfinite = max_bits >= 0x7F800000
        amax_bits = tl.where(nonfinite, 0, max_bits)
        s = (amax_bits >> 23) - 127 - EMAX
        if CEIL:
            amax = amax_bits.to(tl.float32, bitcast=True)
            scaled = amax * _exp2i(tl.minimum(tl.maximum(-s, -149), 127))
            s = s + (scaled > MAX_NORMAL).to(tl.int32)
            s = tl.minimum(s, MAX_EXP - EMAX)
        s = tl.minimum(tl.maximum(s, -127), 127)
        return s, nonfinite

    @triton.jit
    def _round_elements(y, IS_INT: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                        STEP: tl.constexpr, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr,
                        MAX_NORMAL: tl.constexpr):
        """Element-grid value of scaled elements y (reference: mx_round_elements)."""
        if IS_INT:
            r = _rne(y * STEP)
            r = tl.minimum(tl.maximum(r, CODE_MIN), CODE_MAX)
            q = r * (1.0 / STEP)
        else:
            a = tl.abs(y)
            e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
            e = tl.maximum(e, EMIN)
            qa = _rne(a * _exp2i_normal(MBITS - e)) * _exp2i_normal(e - MBITS)
            qa = tl.minimum(qa, MAX_NORMAL)
            sign = y.to(tl.int32, bitcast=True) & -2147483648
            q = (qa.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return q

    @triton.jit
    def _encode_fp(q, EMIN: tl.constexpr, MBITS: tl.constexpr, EBITS: tl.constexpr, BIAS: tl.constexpr):
        """Element-grid values -> MXFP bit patterns (reference: mx_values_to_codes)."""
        sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
        a = tl.abs(q)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
        subnormal = a < _exp2i_normal(tl.full(e.shape, EMIN, tl.int32))
        exp_field = tl.where(subnormal, 0, e + BIAS)
        mant = (a * _exp2i_normal(MBITS - e)).to(tl.int32)
        mant = tl.where(subnormal, mant, mant - (1 << MBITS))
        return (sign << (EBITS + MBITS)) | (exp_field << MBITS) | mant

    @triton.jit
    def _qdq_blocks(x, IS_INT: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                    STEP: tl.constexpr, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr,
                    MAX_NORMAL: tl.constexpr, CEIL: tl.constexpr, MAX_EXP: tl.constexpr):
        """One MX quantize-dequantize of a tile of blocks (a block per row), in float32, and which
        elements saturated (beyond the format's largest normal; never in a NaN/Inf block)."""
        s, nonfinite = _block_exponent(x, EMAX, MAX_NORMAL, CEIL, MAX_EXP)
        y = x * _exp2i(-s)[:, None]
        q = _round_elements(y, IS_INT, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL)
        out = tl.where(nonfinite[:, None], float("nan"), q * _exp2i(s)[:, None])
        return out, (tl.abs(y) > MAX_NORMAL) & (~nonfinite[:, None])

    @triton.jit
    def _fake_quant_kernel(x_ptr, out_ptr, mask_ptr, n_blocks,
                           BS: tl.constexpr, ROWS: tl.constexpr, IS_INT: tl.constexpr,
                           EMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                           STEP: tl.constexpr, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr,
                           MAX_NORMAL: tl.constexpr, CEIL: tl.constexpr, MAX_EXP: tl.constexpr,
                           NEED_MASK: tl.constexpr, BF16: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BS)
        offs = rows[:, None].to(tl.int64) * BS + cols[None, :]
        valid = (rows < n_blocks)[:, None]
        x = _load_f32(x_ptr, offs, valid, BF16)
        out, sat = _qdq_blocks(x, IS_INT, EMAX, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL, CEIL, MAX_EXP)
        _store_from_f32(out_ptr, offs, out, valid, BF16)
        if NEED_MASK:
            tl.store(mask_ptr + offs, sat.to(tl.int8), mask=valid)

    @triton.jit
    def _fake_quant_through_kernel(x_ptr, out_ptr, mask_ptr, n_blocks,
                                   BS: tl.constexpr, ROWS: tl.constexpr,
                                   A_IS_INT: tl.constexpr, A_EMAX: tl.constexpr, A_EMIN: tl.constexpr,
                                   A_MBITS: tl.constexpr, A_STEP: tl.constexpr, A_CODE_MIN: tl.constexpr,
                                   A_CODE_MAX: tl.constexpr, A_MAX_NORMAL: tl.constexpr, A_CEIL: tl.constexpr,
                                   IS_INT: tl.constexpr, EMAX: tl.constexpr, EMIN: tl.constexpr,
                                   MBITS: tl.constexpr, STEP: tl.constexpr, CODE_MIN: tl.constexpr,
                                   CODE_MAX: tl.constexpr, MAX_NORMAL: tl.constexpr, CEIL: tl.constexpr,
                                   MAX_EXP: tl.constexpr, NEED_MASK: tl.constexpr, BF16: tl.constexpr):
        """Train-through-anchor: qdq in the anchor format (A_*), then qdq of that in the target format;
        the mask is the union of both stages' saturation masks."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BS)
        offs = rows[:, None].to(tl.int64) * BS + cols[None, :]
        valid = (rows < n_blocks)[:, None]
        x = _load_f32(x_ptr, offs, valid, BF16)
        mid, sat_a = _qdq_blocks(x, A_IS_INT, A_EMAX, A_EMIN, A_MBITS, A_STEP, A_CODE_MIN, A_CODE_MAX,
                                 A_MAX_NORMAL, A_CEIL, MAX_EXP)  # exact in the dtype (csrc/mx_cpu.cpp)
        out, sat = _qdq_blocks(mid, IS_INT, EMAX, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL, CEIL, MAX_EXP)
        _store_from_f32(out_ptr, offs, out, valid, BF16)
        if NEED_MASK:
            tl.store(mask_ptr + offs, (sat_a | sat).to(tl.int8), mask=valid)

    @triton.jit
    def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, n_blocks,
                         BS: tl.constexpr, ROWS: tl.constexpr, IS_INT: tl.constexpr,
                         EMAX: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, EBITS: tl.constexpr,
                         BIAS: tl.constexpr, STEP: tl.constexpr, CODE_MIN: tl.constexpr,
                         CODE_MAX: tl.constexpr, MAX_NORMAL: tl.constexpr, CEIL: tl.constexpr,
                         MAX_EXP: tl.constexpr, BF16: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BS)
        offs = rows[:, None].to(tl.int64) * BS + cols[None, :]
        row_ok = rows < n_blocks
        valid = row_ok[:, None]
        x = _load_f32(x_ptr, offs, valid, BF16)
        s, nonfinite = _block_exponent(x, EMAX, MAX_NORMAL, CEIL, MAX_EXP)
        y = x * _exp2i(-s)[:, None]
        y = tl.where(nonfinite[:, None], 0.0, y)
        q = _round_elements(y, IS_INT, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL)
        if IS_INT:
            code = (q * STEP).to(tl.int32)
        else:
            code = _encode_fp(q, EMIN, MBITS, EBITS, BIAS)
        tl.store(codes_ptr + offs, (code & 0xFF).to(tl.uint8), mask=valid)
        scale = tl.where(nonfinite, 255, s + 127)
        tl.store(scales_ptr + rows, scale.to(tl.uint8), mask=row_ok)


def _rows_per_program(block_size: int) -> int:
    return max(1, 4096 // block_size)


def _bits_view(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 tensors travel as int16 bits (see _load_f32)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _constexprs(fmt: ElementFormat, scale_rule: str, dtype: torch.dtype) -> dict:
    """The format, scale rule and input dtype as the kernels' compile-time constants."""
    is_int = fmt.family == "mxint"
    return dict(IS_INT=is_int, EMAX=fmt.emax, EMIN=fmt.emin if not is_int else 0, MBITS=fmt.mbits,
                STEP=float(2 ** fmt.int_shift) if is_int else 1.0, CODE_MIN=float(fmt.code_min),
                CODE_MAX=float(fmt.code_max), MAX_NORMAL=float(fmt.max_normal), CEIL=scale_rule == "ceil",
                MAX_EXP=dtype_max_exponent(dtype))


def fake_quantize_triton(x: torch.Tensor, fmt: ElementFormat, block_size: int, scale_rule: str = "floor",
                         need_mask: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Fused MX quantize-dequantize -> (output in x's dtype and shape, saturation mask or None)."""
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n_blocks = xc.numel() // block_size
    mask = torch.empty(xc.shape, dtype=torch.int8, device=x.device) if need_mask else torch.empty(0, dtype=torch.int8, device=x.device)
    rows = _rows_per_program(block_size)
    grid = (triton.cdiv(n_blocks, rows),)
    _fake_quant_kernel[grid](_bits_view(xc), _bits_view(out), mask, n_blocks, BS=block_size, ROWS=rows,
                             NEED_MASK=need_mask, BF16=x.dtype == torch.bfloat16, **_constexprs(fmt, scale_rule, x.dtype))
    return out, (mask.bool() if need_mask else None)


def fake_quantize_through_triton(x: torch.Tensor, anchor: ElementFormat, fmt: ElementFormat, block_size: int,
                                 anchor_rule: str = "floor", scale_rule: str = "floor", need_mask: bool = False
                                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Train-through-anchor in one pass: qdq in ``fmt`` of (qdq in ``anchor`` of x, in x's dtype)
    -> (output in x's dtype and shape, union of both stages' saturation masks or None)."""
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n_blocks = xc.numel() // block_size
    mask = torch.empty(xc.shape if need_mask else (0,), dtype=torch.int8, device=x.device)
    rows = _rows_per_program(block_size)
    anchor_args = {f"A_{k}": v for k, v in _constexprs(anchor, anchor_rule, x.dtype).items() if k != "MAX_EXP"}
    _fake_quant_through_kernel[(triton.cdiv(n_blocks, rows),)](
        _bits_view(xc), _bits_view(out), mask, n_blocks, BS=block_size, ROWS=rows, NEED_MASK=need_mask,
        BF16=x.dtype == torch.bfloat16, **anchor_args,
        **_constexprs(fmt, scale_rule, x.dtype))
    return out, (mask.bool() if need_mask else None)


def quantize_triton(x: torch.Tensor, fmt: ElementFormat, block_size: int, scale_rule: str = "floor"
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX codes (int8 MXINT / uint8 MXFP bit patterns, x's shape) and E8M0 scale bytes."""
    xc = x.contiguous()
    n_blocks = xc.numel() // block_size
    codes = torch.empty(xc.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*xc.shape[:-1], xc.shape[-1] // block_size), dtype=torch.uint8, device=x.device)
    rows = _rows_per_program(block_size)
    _quantize_kernel[(triton.cdiv(n_blocks, rows),)](_bits_view(xc), codes, scales, n_blocks, BS=block_size,
                                                     ROWS=rows, EBITS=fmt.ebits, BIAS=fmt.bias,
                                                     BF16=x.dtype == torch.bfloat16, **_constexprs(fmt, scale_rule, x.dtype))
    return (codes.view(torch.int8) if fmt.family == "mxint" else codes), scales
