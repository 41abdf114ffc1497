"""Per-block scale search: the MX shared exponent with the lowest (importance-weighted) squared error.

Any E8M0 exponent is a legal MX block, so besides the OCP floor exponent s0 = floor(log2 amax) - emax
a block may take s0 - 1 (finer grid, the largest elements saturate) or s0 + 1 (the ceil side, coarser
grid, nothing saturates). :func:`mx_search_exponent` tries ``s0 + d`` for d in ``offsets`` and keeps,
per block, the one whose dequantized block has the lowest error

    err(s) = sum_j w_j * (x_j - qdq_s(x)_j)^2,     w_j = importance of input column j (or 1),

computed in float64 and summed in a fixed pairwise order (:func:`fixed_order_sum`), with ties (and
all-zero or non-finite blocks) kept at floor; so the chosen block's error is never above floor's. With ``importance`` = the mean squared input activation per
input channel (what ``--awq`` measures, mfqat.anchor.importance.importance_matrix) the error is the expected
squared error of the layer's output contribution under uncorrelated inputs: the "output-aware" choice.

:func:`mx_search_exponent` is the pure-PyTorch oracle. Post-training quantization and export use
:func:`quantize_search`; training (MFQATLinear, where a QATConfig's ``scale_rules`` names ``search``
for a format) uses :func:`search_exponents`, :func:`dequantize_with_exponents` and
:func:`straight_through` on the anchor's values (docs/numerics.md, "Scale rules"). Those three
entry points run MXINT and MXFP through a kernel bit-exact with the oracle (tests/test_search_kernel.py,
tests/test_search_kernel_mxfp.py): the C++ ops (``csrc/mx_search.cpp``, ``csrc/mx_decode.cpp``) on
CPU, Triton (``kernels/triton_search.py``) on CUDA.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from mfqat.formats import ElementFormat, FormatLike, get_format
from mfqat.quant.api import fake_quantize
from mfqat.quant.kernels import (decode_exponents_dispatch, decode_exponents_through_dispatch, search_dispatch,
                      search_through_dispatch)
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.reference import (dtype_max_exponent, exp2i, mx_encode_blocks, mx_round_elements, mx_shared_exponent,
                        to_blocks)

SEARCH_OFFSETS: Tuple[int, ...] = (-1, 1)
CHUNK_ELEMENTS = 1 << 18  # elements searched at once (measured fastest on 2 cores: about 2x one pass)


def block_weights(importance: Optional[torch.Tensor], k: int, block_size: int, device) -> Optional[torch.Tensor]:
    """Importance per input column (shape (k,)) as float64 (k // block_size, block_size) weights."""
    if importance is None:
        return None
    imp = importance.detach().to(device=device, dtype=torch.float64).reshape(-1)
    if imp.numel() != k:
        raise ValueError(f"importance has {imp.numel()} entries but the tensor's last axis has {k}; pass the "
                         f"importance of this layer's input channels")
    if not torch.isfinite(imp).all() or (imp < 0).any():
        raise ValueError("importance must be finite and non-negative (a mean squared activation per channel)")
    return imp.reshape(k // block_size, block_size)


def block_error(blocks: torch.Tensor, fmt: ElementFormat, s: torch.Tensor,
                weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per block: sum_j w_j (x_j - qdq_s(x)_j)^2 in float64 for shared exponents s (finite blocks)."""
    y = blocks * exp2i(-s).unsqueeze(-1)
    if fmt.family == "mxint":  # mx_round_elements' MXINT rounding, without its saturation mask
        step = float(2 ** fmt.int_shift)
        q = torch.round(y * step).clamp_(fmt.code_min, fmt.code_max).div_(step)
    else:
        q, _ = mx_round_elements(y, fmt)
    # q * 2^s and x - q * 2^s are exact in float32 (q has at most 8 significant bits and lies within a
    # few binades of x / 2^s, so the difference is a multiple of ulp(x) below 2|x|); squares and sums in float64
    err = torch.sub(blocks, q.mul_(exp2i(s).unsqueeze(-1))).to(torch.float64).square_()
    if weights is not None:
        err.mul_(weights)
    return fixed_order_sum(err)


def fixed_order_sum(e: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in a fixed pairwise order, so a kernel can add in the same order bit for
    bit: while n > 1, element i (i < h = n // 2) becomes e_i + e_(i+h), and an odd last element is
    carried as element h."""
    while e.shape[-1] > 1:
        n, h = e.shape[-1], e.shape[-1] // 2
        head = e[..., :h] + e[..., h:2 * h]
        e = torch.cat([head, e[..., 2 * h:]], -1) if n % 2 else head
    return e[..., 0]


def mx_search_exponent(blocks: torch.Tensor, fmt: ElementFormat, importance: Optional[torch.Tensor] = None,
                       max_exp: int = 127, offsets: Sequence[int] = SEARCH_OFFSETS
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent per block by search (see module docs) and the mask of non-finite blocks.

    ``blocks``: float32 (..., n_blocks, block_size) whose last two axes are one row's input columns;
    ``importance``: (n_blocks * block_size,) per input column, or None (plain squared error).
    Candidates are clamped to [-127, min(127, max_exp - emax)] (ceil's overflow cap, so a finite
    input stays finite). Rows are searched in chunks of about :data:`CHUNK_ELEMENTS` elements (the
    temporaries stay in cache; every block's result is the same as in one pass).
    """
    weights = block_weights(importance, blocks.shape[-2] * blocks.shape[-1], blocks.shape[-1], blocks.device)
    rows = blocks.reshape(-1, *blocks.shape[-2:])
    step = max(1, CHUNK_ELEMENTS // max(1, blocks.shape[-2] * blocks.shape[-1]))
    parts = [_search_rows(rows[i:i + step], fmt, weights, max_exp, offsets) for i in range(0, rows.shape[0], step)]
    if not parts:  # no rows at all
        return mx_shared_exponent(blocks, fmt, "floor", max_exp)
    s, nonfinite = (torch.cat([p[k] for p in parts]).reshape(blocks.shape[:-1]) for k in (0, 1))
    return s, nonfinite


def _search_rows(blocks: torch.Tensor, fmt: ElementFormat, weights: Optional[torch.Tensor], max_exp: int,
                 offsets: Sequence[int] = SEARCH_OFFSETS) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`mx_search_exponent` on a chunk of rows (rows, n_blocks, block_size)."""
    s0, nonfinite = mx_shared_exponent(blocks, fmt, "floor", max_exp)
    finite = torch.where(nonfinite.unsqueeze(-1), torch.zeros_like(blocks), blocks)
    best_s, best_err = s0, block_error(finite, fmt, s0, weights)
    hi = min(127, max_exp - fmt.emax)
    for d in offsets:
        s = (s0 + d).clamp(-127, hi)
        err = block_error(finite, fmt, s, weights)
        better = err < best_err
        best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)
    return best_s, nonfinite


def quantize_search(x: torch.Tensor, fmt: FormatLike, block_size: Optional[int] = None,
                    importance: Optional[torch.Tensor] = None) -> MXTensor:
    """Quantize ``x`` (..., K) to an MX format choosing each block's exponent by :func:`mx_search_exponent`.

    ``importance``: (K,) weights per input column (e.g. the AWQ importance of this Linear), or None.
    The result is an ordinary :class:`MXTensor` (``scale_rule="search"``): every reader decodes it as
    any MX tensor.
    """
    f = get_format(fmt)
    if not f.is_mx:
        raise ValueError(f"scale search applies to MX formats only, not '{f.name}'")
    bs = f.resolve_block_size(block_size)
    if x.dim() == 0 or x.shape[-1] % bs:
        raise ValueError(f"tensor of shape {tuple(x.shape)}: last dimension is not a multiple of block_size={bs}")
    blocks = to_blocks(x.detach(), bs)
    s, nonfinite = search_exponents(x, f, bs, importance)
    codes, scales = mx_encode_blocks(blocks, f, s, nonfinite)
    return MXTensor(codes.reshape(x.shape), scales, f, bs, x.dtype, None, "search")


def search_exponents(x: torch.Tensor, fmt: FormatLike, block_size: int,
                     importance: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(shared exponent per block, non-finite mask) that :func:`quantize_search` picks for ``x``
    (the C++ op on CPU, the Triton kernel on CUDA, else :func:`mx_search_exponent`)."""
    f = get_format(fmt)
    if x.dim() and x.shape[-1] % block_size == 0:
        weights = block_weights(importance, x.shape[-1], block_size, x.device)
        fast = search_dispatch(x.detach(), f, block_size, None if weights is None else weights.reshape(-1),
                               SEARCH_OFFSETS)
        if fast is not None:
            return fast
    return mx_search_exponent(to_blocks(x.detach(), block_size), f, importance, dtype_max_exponent(x.dtype))


def dequantize_with_exponents(x: torch.Tensor, fmt: FormatLike, block_size: int,
                              exponents: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x`` quantized to ``fmt`` with the given per-block exponents (:func:`search_exponents`),
    dequantized to x's dtype: bit for bit ``quantize_search(x, ...).dequantize()`` for its exponents."""
    f = get_format(fmt)
    fast = decode_exponents_dispatch(x.detach(), f, block_size, exponents)
    if fast is not None:
        return fast
    blocks = to_blocks(x.detach(), block_size)
    if f.family == "mxint":  # the decoded values directly (see _mxint_values)
        return _mxint_values(blocks, f, *exponents).reshape(x.shape).to(x.dtype)
    codes, scales = mx_encode_blocks(blocks, f, *exponents)
    return MXTensor(codes.reshape(x.shape), scales, f, block_size, x.dtype, None, "search").dequantize(x.dtype)


def dequantize_through_with_exponents(x: torch.Tensor, anchor: FormatLike, anchor_rule: str, fmt: FormatLike,
                                      block_size: int, exponents: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``dequantize_with_exponents(fake_quantize(x, anchor, block_size, anchor_rule), fmt, block_size,
    exponents)`` bit for bit: the weight a searched format trains on (the search runs on the anchor's
    values). One pass over ``x`` with the C++ op, else the two steps."""
    a, f = get_format(anchor), get_format(fmt)
    fast = decode_exponents_through_dispatch(x.detach(), a, anchor_rule, f, block_size, exponents)
    if fast is not None:
        return fast
    return dequantize_with_exponents(fake_quantize(x.detach(), a, block_size, anchor_rule), f, block_size, exponents)


def search_through_anchor(x: torch.Tensor, anchor: FormatLike, anchor_rule: str, fmt: FormatLike, block_size: int,
                          importance: Optional[torch.Tensor] = None
                          ) -> Tuple[Tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(:func:`search_exponents`, :func:`dequantize_with_exponents`) of ``fake_quantize(x, anchor,
    block_size, anchor_rule)`` for ``fmt``, bit for bit: the exponents a searched format keeps for the
    step and the weight it trains on. One pass over ``x`` with the C++ op, else the three steps."""
    a, f = get_format(anchor), get_format(fmt)
    if x.dim() and x.shape[-1] % block_size == 0:
        weights = block_weights(importance, x.shape[-1], block_size, x.device)
        fast = search_through_dispatch(x.detach(), a, anchor_rule, f, block_size,
                                       None if weights is None else weights.reshape(-1), SEARCH_OFFSETS)
        if fast is not None:
            return fast[:2], fast[2]
    base = fake_quantize(x.detach(), a, block_size, anchor_rule)
    exps = search_exponents(base, f, block_size, importance)
    return exps, dequantize_with_exponents(base, f, block_size, exps)


def _mxint_values(blocks: torch.Tensor, f: ElementFormat, s: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """MXINT blocks encoded with exponents ``s`` and decoded, in a few in-place passes: the integer
    code c = clamp(round_half_even(x * 2^-s * 2^k)) (k = the format's fraction bits) times
    2^(s - k), which is exact (s - k >= -133), so the one rounding of the product is the decoder's
    (c / 2^k) * 2^s; + 0.0 turns a rounded -0 into the decoder's +0; non-finite blocks decode to NaN."""
    y = blocks * exp2i(-s).unsqueeze(-1)
    any_nonfinite = bool(nonfinite.any())
    if any_nonfinite:
        y = torch.where(nonfinite.unsqueeze(-1), torch.zeros_like(y), y)
    c = torch.round(y.mul_(float(2 ** f.int_shift))).clamp_(f.code_min, f.code_max).add_(0.0)
    scale = exp2i(s - f.int_shift)
    if any_nonfinite:
        scale = torch.where(nonfinite, torch.full_like(scale, float("nan")), scale)
    return c.mul_(scale.unsqueeze(-1))


class _StraightThrough(torch.autograd.Function):
    """Forward: ``y`` (computed without grad); backward: the gradient passes to ``x`` unchanged."""

    @staticmethod
    def forward(ctx, x, y):  # type: ignore[override]
        return y

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


def straight_through(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` forward, the gradient passed to ``x`` unchanged (``y`` itself when no gradient is needed)."""
    return _StraightThrough.apply(x, y) if x.requires_grad and torch.is_grad_enabled() else y
