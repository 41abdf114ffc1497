"""Triton kernels for the MX scale search, MXINT and MXFP (NVIDIA GPUs; ``TRITON_INTERPRET=1`` runs them on CPU).

The same search as the PyTorch oracle (:func:`mfqat.quant.scale_search.mx_search_exponent`) and the
C++ op (``csrc/mx_search.cpp``): per block, floor's exponent and floor -/+ 1 (clamped to
[-127, min(127, max_exp - emax)]), each candidate's error ``sum_j w_j (x_j - qdq_s(x)_j)^2`` with the
difference in float32 and the square, weighting and sum in float64, the sum in the oracle's fixed
pairwise order (a tile of blocks is reshaped to (rows, 2, n/2) and the pair summed, halving until one
is left: element i adds element i + n/2, as ``fixed_order_sum``); strictly lower error wins, so ties
keep floor. Block sizes are powers of two (every MX block size is). The decoder gives the values
for given exponents (oracle: ``_mxint_values`` for MXINT, the MXFP encode + decode). Bit-exact with
the oracle (tests/test_search_kernel.py, tests/test_search_kernel_mxfp.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from mfqat.formats import ElementFormat
from mfqat.quant.reference import dtype_max_exponent
from mfqat.quant.kernels.triton_mx import AVAILABLE, _bits_view, _constexprs, _rows_per_program

if AVAILABLE:
    import triton
    import triton.language as tl

    from mfqat.quant.kernels.triton_mx import _block_exponent, _exp2i, _load_f32, _rne, _round_elements, _store_from_f32

    @triton.jit
    def _pair_sum(e, ROWS: tl.constexpr, HALF: tl.constexpr):
        """(rows, 2 * HALF) -> (rows, HALF): element i + element i + HALF (one addition each)."""
        return tl.sum(tl.reshape(e, (ROWS, 2, HALF)), axis=1)

    @triton.jit
    def _fixed_order_sum(e, ROWS: tl.constexpr, BS: tl.constexpr):
        """Sum over axis 1 of (rows, BS) float64 in the oracle's pairwise order (BS a power of two)."""
        if BS >= 256:
            e = _pair_sum(e, ROWS, 128)
        if BS >= 128:
            e = _pair_sum(e, ROWS, 64)
        if BS >= 64:
            e = _pair_sum(e, ROWS, 32)
        if BS >= 32:
            e = _pair_sum(e, ROWS, 16)
        if BS >= 16:
            e = _pair_sum(e, ROWS, 8)
        if BS >= 8:
            e = _pair_sum(e, ROWS, 4)
        if BS >= 4:
            e = _pair_sum(e, ROWS, 2)
        if BS >= 2:
            e = _pair_sum(e, ROWS, 1)
        return tl.reshape(e, (ROWS,))

    @triton.jit
    def _candidate_error(x, w, s, ROWS: tl.constexpr, BS: tl.constexpr, IS_INT: tl.constexpr, EMIN: tl.constexpr,
                         MBITS: tl.constexpr, STEP: tl.constexpr, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr,
                         MAX_NORMAL: tl.constexpr, WEIGHTED: tl.constexpr):
        """Per block: sum_j w_j (x_j - qdq_s(x)_j)^2 (float64), x finite float32 (rows, BS)."""
        q = _round_elements(x * _exp2i(-s)[:, None], IS_INT, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL)
        d = x - q * _exp2i(s)[:, None]
        e = d.to(tl.float64) * d.to(tl.float64)
        if WEIGHTED:
            e = e * w
        return _fixed_order_sum(e, ROWS, BS)

    @triton.jit
    def _search_kernel(x_ptr, w_ptr, s_ptr, nonfinite_ptr, n_blocks, blocks_per_row,
                       BS: tl.constexpr, ROWS: tl.constexpr, IS_INT: tl.constexpr, EMAX: tl.constexpr,
                       EMIN: tl.constexpr, MBITS: tl.constexpr, STEP: tl.constexpr, CODE_MIN: tl.constexpr,
                       CODE_MAX: tl.constexpr, MAX_NORMAL: tl.constexpr, HI: tl.constexpr, MAX_EXP: tl.constexpr,
                       WEIGHTED: tl.constexpr, BF16: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BS)
        row_ok = rows < n_blocks
        valid = row_ok[:, None]
        x = _load_f32(x_ptr, rows[:, None].to(tl.int64) * BS + cols[None, :], valid, BF16)
        s0, nonfinite = _block_exponent(x, EMAX, MAX_NORMAL, False, MAX_EXP)
        x = tl.where(nonfinite[:, None], 0.0, x)
        w = x.to(tl.float64)  # a placeholder when not weighted (never read)
        if WEIGHTED:
            w = tl.load(w_ptr + (rows % blocks_per_row)[:, None].to(tl.int64) * BS + cols[None, :], mask=valid,
                        other=0.0)
        best = s0
        best_err = _candidate_error(x, w, s0, ROWS, BS, IS_INT, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL,
                                    WEIGHTED)
        s = tl.minimum(tl.maximum(s0 - 1, -127), HI)
        err = _candidate_error(x, w, s, ROWS, BS, IS_INT, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL, WEIGHTED)
        better = err < best_err
        best, best_err = tl.where(better, s, best), tl.where(better, err, best_err)
        s = tl.minimum(tl.maximum(s0 + 1, -127), HI)
        err = _candidate_error(x, w, s, ROWS, BS, IS_INT, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL, WEIGHTED)
        best = tl.where(err < best_err, s, best)
        best = tl.where(nonfinite, s0, best)
        tl.store(s_ptr + rows, best, mask=row_ok)
        tl.store(nonfinite_ptr + rows, nonfinite.to(tl.int8), mask=row_ok)

    @triton.jit
    def _decode_kernel(x_ptr, s_ptr, nonfinite_ptr, out_ptr, n_blocks, BS: tl.constexpr, ROWS: tl.constexpr,
                       IS_INT: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr, STEP: tl.constexpr,
                       INT_SHIFT: tl.constexpr, CODE_MIN: tl.constexpr, CODE_MAX: tl.constexpr,
                       MAX_NORMAL: tl.constexpr, BF16: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BS)
        row_ok = rows < n_blocks
        valid = row_ok[:, None]
        offs = rows[:, None].to(tl.int64) * BS + cols[None, :]
        x = _load_f32(x_ptr, offs, valid, BF16)
        s = tl.load(s_ptr + rows, mask=row_ok, other=0)
        nonfinite = tl.load(nonfinite_ptr + rows, mask=row_ok, other=0) != 0
        if IS_INT:
            c = tl.minimum(tl.maximum(_rne((x * _exp2i(-s)[:, None]) * STEP), CODE_MIN), CODE_MAX)
            c = tl.where(c == 0.0, 0.0, c)  # a rounded -0 decodes as +0
            v = c * _exp2i(s - INT_SHIFT)[:, None]
        else:  # the element rounding times 2^s, what encoding then decoding gives
            q = _round_elements(x * _exp2i(-s)[:, None], IS_INT, EMIN, MBITS, STEP, CODE_MIN, CODE_MAX, MAX_NORMAL)
            v = q * _exp2i(s)[:, None]
        out = tl.where(nonfinite[:, None], float("nan"), v)
        _store_from_f32(out_ptr, offs, out, valid, BF16)


def _format_constants(fmt: ElementFormat, dtype: torch.dtype, *keep: str) -> dict:
    """The target format's element-rounding constants (MXINT or MXFP, triton_mx's), plus ``keep``."""
    c = _constexprs(fmt, "floor", dtype)
    names = ("IS_INT", "EMIN", "MBITS", "STEP", "CODE_MIN", "CODE_MAX", "MAX_NORMAL", *keep)
    return {k: c[k] for k in names}


def applies(block_size: int, offsets: Tuple[int, ...]) -> bool:
    """Whether the Triton search handles this block size and candidate set."""
    return AVAILABLE and block_size & (block_size - 1) == 0 and block_size <= 256 and tuple(offsets) == (-1, 1)


def search_triton(x: torch.Tensor, fmt: ElementFormat, block_size: int, weights: Optional[torch.Tensor]
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX scale search -> (int32 exponent per block, non-finite mask), shape (..., K // block_size)."""
    xc = x.contiguous()
    shape = (*xc.shape[:-1], xc.shape[-1] // block_size)
    s = torch.empty(shape, dtype=torch.int32, device=x.device)
    nonfinite = torch.empty(shape, dtype=torch.int8, device=x.device)
    n_blocks = xc.numel() // block_size
    rows = _rows_per_program(block_size)
    w = weights.to(device=x.device, dtype=torch.float64).contiguous() if weights is not None else s
    max_exp = dtype_max_exponent(x.dtype)
    _search_kernel[(triton.cdiv(n_blocks, rows),)](
        _bits_view(xc), w, s, nonfinite, n_blocks, shape[-1], BS=block_size, ROWS=rows,
        **_format_constants(fmt, x.dtype, "EMAX", "MAX_EXP"), HI=min(127, max_exp - fmt.emax),
        WEIGHTED=weights is not None, BF16=x.dtype == torch.bfloat16)
    return s, nonfinite.bool()


def decode_exponents_triton(x: torch.Tensor, fmt: ElementFormat, block_size: int, s: torch.Tensor,
                            nonfinite: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to ``fmt`` with the given exponents and dequantized, in x's dtype."""
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n_blocks = xc.numel() // block_size
    rows = _rows_per_program(block_size)
    _decode_kernel[(triton.cdiv(n_blocks, rows),)](
        _bits_view(xc), s.contiguous(), nonfinite.contiguous().to(torch.int8), _bits_view(out), n_blocks,
        BS=block_size, ROWS=rows, **_format_constants(fmt, x.dtype), INT_SHIFT=fmt.int_shift,
        BF16=x.dtype == torch.bfloat16)
    return out
