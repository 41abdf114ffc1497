"""Triton kernel of Slice-and-Scale: MX codes + E8M0 scales of one format -> those of a lower one
of the same family, one block per row (MXINT: a rounded right shift of the codes, scale kept;
MXFP: decode, new shared exponent from the block's largest value, re-round, encode). Bit-exact with
:func:`mfqat.quant.slice.slice_reference` (tests/test_kernels.py).
"""
from __future__ import annotations

from typing import Tuple

import torch

from mfqat.formats import ElementFormat
from mfqat.quant.kernels.triton_mx import AVAILABLE, _rows_per_program

if AVAILABLE:
    import triton
    import triton.language as tl

    from mfqat.quant.kernels.triton_mx import _encode_fp, _exp2i, _exp2i_normal, _rne, _round_elements

    @triton.jit
    def _slice_kernel(codes_ptr, scales_ptr, out_codes_ptr, out_scales_ptr, n_blocks,
                      BS: tl.constexpr, ROWS: tl.constexpr, IS_INT: tl.constexpr, INV_SHIFT: tl.constexpr,
                      SRC_EMIN: tl.constexpr, SRC_MBITS: tl.constexpr, SRC_EBITS: tl.constexpr,
                      SRC_BIAS: tl.constexpr, DST_EMAX: tl.constexpr, DST_EMIN: tl.constexpr,
                      DST_MBITS: tl.constexpr, DST_EBITS: tl.constexpr, DST_BIAS: tl.constexpr,
                      CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr, MAX_NORMAL: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BS)
        offs = rows[:, None].to(tl.int64) * BS + cols[None, :]
        row_ok = rows < n_blocks
        valid = row_ok[:, None]
        c = tl.load(codes_ptr + offs, mask=valid, other=0).to(tl.int32) & 0xFF
        sc = tl.load(scales_ptr + rows, mask=row_ok, other=127).to(tl.int32) & 0xFF
        if IS_INT:  # rounded right shift of the signed codes; the scale is unchanged
            signed = tl.where(c >= 128, c - 256, c).to(tl.float32)
            q = tl.minimum(tl.maximum(_rne(signed * INV_SHIFT), CODE_MIN), CODE_MAX)
            tl.store(out_codes_ptr + offs, (q.to(tl.int32) & 0xFF).to(tl.uint8), mask=valid)
            tl.store(out_scales_ptr + rows, sc.to(tl.uint8), mask=row_ok)
        else:
            sign = (c >> (SRC_EBITS + SRC_MBITS)) & 1
            exp_field = (c >> SRC_MBITS) & ((1 << SRC_EBITS) - 1)
            mant = c & ((1 << SRC_MBITS) - 1)
            sub = exp_field == 0
            e = tl.where(sub, SRC_EMIN, exp_field - SRC_BIAS)
            v = tl.where(sub, mant, mant + (1 << SRC_MBITS)).to(tl.float32) * _exp2i_normal(e - SRC_MBITS)
            v = tl.where(sign == 1, -v, v)
            nan_block = sc == 255
            s_high = sc - 127
            amax = tl.max(tl.abs(v), axis=1)
            s_low = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 + s_high - DST_EMAX
            s_low = tl.minimum(tl.maximum(s_low, -127), 127)
            s_low = tl.where(amax == 0.0, -127, s_low)
            y = v * _exp2i(tl.minimum(tl.maximum(s_high - s_low, -149), 127))[:, None]
            q = _round_elements(y, False, DST_EMIN, DST_MBITS, 1.0, CODE_MIN, CODE_MAX, MAX_NORMAL)
            code = tl.where(nan_block[:, None], 0, _encode_fp(q, DST_EMIN, DST_MBITS, DST_EBITS, DST_BIAS))
            tl.store(out_codes_ptr + offs, (code & 0xFF).to(tl.uint8), mask=valid)
            tl.store(out_scales_ptr + rows, tl.where(nan_block, sc, s_low + 127).to(tl.uint8), mask=row_ok)


def slice_triton(codes: torch.Tensor, scales: torch.Tensor, src: ElementFormat, dst: ElementFormat,
                 block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slice-and-Scale of unpacked codes + E8M0 scales from ``src`` to ``dst`` (same family)."""
    c = codes.contiguous().view(torch.uint8)
    sc = scales.contiguous()
    out_c, out_s = torch.empty_like(c), torch.empty_like(sc)
    n_blocks = c.numel() // block_size
    rows = _rows_per_program(block_size)
    is_int = dst.family == "mxint"
    _slice_kernel[(triton.cdiv(n_blocks, rows),)](
        c, sc, out_c, out_s, n_blocks, BS=block_size, ROWS=rows, IS_INT=is_int,
        INV_SHIFT=2.0 ** -(src.bits - dst.bits), SRC_EMIN=src.emin, SRC_MBITS=src.mbits, SRC_EBITS=src.ebits,
        SRC_BIAS=src.bias, DST_EMAX=dst.emax, DST_EMIN=dst.emin, DST_MBITS=dst.mbits, DST_EBITS=dst.ebits,
        DST_BIAS=dst.bias, CODE_MIN=float(dst.code_min), CODE_MAX=float(dst.code_max),
        MAX_NORMAL=float(dst.max_normal))
    return (out_c.view(torch.int8) if is_int else out_c), out_s
