"""The C++ CPU path (``csrc/mx_cpu.cpp``, built by setup.py as ``mfqat._C``), and the CUDA op
(``csrc/cuda/``: CUDA kernels of ``fake_quant_mx`` and ``fake_quant_mx_through``, in the same library
when it was built against a CUDA torch; :data:`CUDA_AVAILABLE`).

The ops are ``torch.ops.mfqat.fake_quant_mx``, ``fake_quant_mx_through`` (train-through-anchor:
the anchor's then the target format's quantize-dequantize in one pass), ``quantize_mx`` and
``slice_mx`` (mx_cpu.cpp), ``quantize_affine`` (MLX's affine rule, affine_cpu.cpp), ``dequantize_mx`` (mx_dequant.cpp), ``search_mx``, ``decode_mx_exponents`` and their train-through-anchor forms
``search_mx_through`` / ``decode_mx_exponents_through`` (the MX scale search, mx_search.cpp and
mx_decode.cpp); fake (meta)
implementations are registered here so that ``torch.compile`` traces them. Importing this module
never fails: :data:`AVAILABLE` says whether the extension loaded, :data:`LOAD_ERROR` why not.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from mfqat.formats import ElementFormat

AVAILABLE = False
CUDA_AVAILABLE = False
THROUGH_AVAILABLE = False
SEARCH_AVAILABLE = False
SEARCH_THROUGH_AVAILABLE = False
AFFINE_AVAILABLE = False
DEQUANT_AVAILABLE = False
LOAD_ERROR: Optional[str] = None
try:  # the extension is optional: a missing compiler at install time leaves the reference path
    from mfqat._build import load_extension

    load_extension()  # registers the ops

    AVAILABLE = hasattr(torch.ops.mfqat, "fake_quant_mx")
    THROUGH_AVAILABLE = hasattr(torch.ops.mfqat, "fake_quant_mx_through")  # False for an older build
    # the search ops take the target format's full arguments (MXINT and MXFP) since 0.1.0's session 11;
    # an older build (MXINT-only arguments) leaves them to the reference
    SEARCH_AVAILABLE = hasattr(torch.ops.mfqat, "search_mx") and \
        "mbits" in str(torch.ops.mfqat.search_mx.default._schema)
    SEARCH_THROUGH_AVAILABLE = SEARCH_AVAILABLE and hasattr(torch.ops.mfqat, "search_mx_through")
    AFFINE_AVAILABLE = hasattr(torch.ops.mfqat, "quantize_affine")  # affine_cpu.cpp; False for an older build
    DEQUANT_AVAILABLE = hasattr(torch.ops.mfqat, "dequantize_mx")  # mx_dequant.cpp; False for an older build
    # the CUDA op (csrc/cuda/): CUDA kernels of fake_quant_mx and fake_quant_mx_through, built by setup.py
    # only when torch had CUDA and nvcc was found
    CUDA_AVAILABLE = AVAILABLE and THROUGH_AVAILABLE and all(
        torch._C._dispatch_has_kernel_for_dispatch_key(f"mfqat::{op}", "CUDA")
        for op in ("fake_quant_mx", "fake_quant_mx_through"))
except Exception as exc:  # pragma: no cover - depends on the build
    LOAD_ERROR = f"{type(exc).__name__}: {exc}"


def _format_args(fmt: ElementFormat, scale_rule: str) -> tuple:
    """The format as the op's scalar arguments (is_int ... ceil_rule)."""
    return (fmt.family == "mxint", fmt.emax, fmt.emin, fmt.mbits, fmt.int_shift if fmt.family == "mxint" else 0,
            fmt.code_min, fmt.code_max, float(fmt.max_normal), scale_rule == "ceil")


if AVAILABLE:
    @torch.library.register_fake("mfqat::fake_quant_mx")
    def _fake_quant_mx_meta(x, block_size, is_int, emax, emin, mbits, int_shift, code_min, code_max,
                            max_normal, ceil_rule, need_mask):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        mask = x.new_empty(x.shape if need_mask else (0,), dtype=torch.bool)
        return out, mask

    @torch.library.register_fake("mfqat::quantize_mx")
    def _quantize_mx_meta(x, block_size, is_int, emax, emin, mbits, int_shift, code_min, code_max,
                          max_normal, ceil_rule, bias, ebits):
        codes = x.new_empty(x.shape, dtype=torch.int8 if is_int else torch.uint8)
        scales = x.new_empty((*x.shape[:-1], x.shape[-1] // block_size), dtype=torch.uint8)
        return codes, scales

    if AFFINE_AVAILABLE:
        @torch.library.register_fake("mfqat::quantize_affine")
        def _quantize_affine_meta(x, block_size, bits):
            small = (*x.shape[:-1], x.shape[-1] // block_size)
            return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(small, dtype=torch.float32), \
                x.new_empty(small, dtype=torch.float32), True

    if DEQUANT_AVAILABLE:
        @torch.library.register_fake("mfqat::dequantize_mx")
        def _dequantize_mx_meta(codes, scales, block_size, *rest):
            return codes.new_empty(codes.shape, dtype=torch.float32)

    @torch.library.register_fake("mfqat::slice_mx")
    def _slice_mx_meta(codes, scales, block_size, is_int, *rest):
        return codes.new_empty(codes.shape, dtype=torch.int8 if is_int else torch.uint8), torch.empty_like(scales)

if THROUGH_AVAILABLE:
    @torch.library.register_fake("mfqat::fake_quant_mx_through")
    def _fake_quant_mx_through_meta(x, block_size, *formats_and_need_mask):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        mask = x.new_empty(x.shape if formats_and_need_mask[-1] else (0,), dtype=torch.bool)
        return out, mask

if SEARCH_AVAILABLE:
    @torch.library.register_fake("mfqat::search_mx")
    def _search_mx_meta(x, weights, block_size, *rest):
        shape = (*x.shape[:-1], x.shape[-1] // block_size)
        return x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.bool)

    @torch.library.register_fake("mfqat::decode_mx_exponents")
    def _decode_mx_exponents_meta(x, s, nonfinite, block_size, *rest):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

if SEARCH_THROUGH_AVAILABLE:
    @torch.library.register_fake("mfqat::decode_mx_exponents_through")
    def _decode_mx_exponents_through_meta(x, s, nonfinite, block_size, *rest):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("mfqat::search_mx_through")
    def _search_mx_through_meta(x, weights, block_size, *rest):
        shape = (*x.shape[:-1], x.shape[-1] // block_size)
        return (x.new_empty(shape, dtype=torch.int32), x.new_empty(shape, dtype=torch.bool),
                torch.empty_like(x, memory_format=torch.contiguous_format))


def fake_quantize_cpp(x: torch.Tensor, fmt: ElementFormat, block_size: int, scale_rule: str = "floor",
                      need_mask: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Fused quantize-dequantize of an MX format on CPU (or CUDA, by the CUDA op) -> (output in x's dtype,
    mask or None)."""
    out, mask = torch.ops.mfqat.fake_quant_mx(x, block_size, *_format_args(fmt, scale_rule), need_mask)
    return out, (mask if need_mask else None)


def fake_quantize_through_cpp(x: torch.Tensor, anchor: ElementFormat, fmt: ElementFormat, block_size: int,
                              anchor_rule: str = "floor", scale_rule: str = "floor", need_mask: bool = False
                              ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """qdq in ``fmt`` of (qdq in ``anchor`` of x, rounded to x's dtype), one pass on CPU (or CUDA) ->
    (output in x's dtype, union of both stages' saturation masks or None)."""
    out, mask = torch.ops.mfqat.fake_quant_mx_through(x, block_size, *_format_args(anchor, anchor_rule),
                                                      *_format_args(fmt, scale_rule), need_mask)
    return out, (mask if need_mask else None)


def quantize_cpp(x: torch.Tensor, fmt: ElementFormat, block_size: int, scale_rule: str = "floor"
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX codes (int8 MXINT / uint8 MXFP bit patterns, x's shape) and E8M0 scale bytes."""
    return torch.ops.mfqat.quantize_mx(x, block_size, *_format_args(fmt, scale_rule), fmt.bias, fmt.ebits)


def quantize_affine_cpp(x: torch.Tensor, fmt: ElementFormat, block_size: int
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """MLX's affine rule on CPU (affine_cpu.cpp): uint8 codes (x's shape), the float32 scales and biases
    before their rounding to x's dtype, and whether x was all finite (when not, the rest is incomplete:
    the reference's NaN rules apply, the caller's job)."""
    return torch.ops.mfqat.quantize_affine(x, block_size, fmt.bits)


def dequantize_mx_cpp(codes: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat, block_size: int
                      ) -> torch.Tensor:
    """MX codes (any shape, last axis blocked) and E8M0 bytes -> float32 values (mx_dequant.cpp)."""
    return torch.ops.mfqat.dequantize_mx(codes, scales, block_size, fmt.family == "mxint",
                                         fmt.int_shift if fmt.family == "mxint" else 0, fmt.ebits, fmt.mbits,
                                         fmt.bias, fmt.emin)


def slice_cpp(codes: torch.Tensor, scales: torch.Tensor, src: ElementFormat, dst: ElementFormat, block_size: int
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Slice-and-Scale of unpacked codes + E8M0 scales from ``src`` to ``dst`` (same family)."""
    return torch.ops.mfqat.slice_mx(codes, scales, block_size, dst.family == "mxint", src.bits - dst.bits,
                                    src.emax, src.emin, src.mbits, src.ebits, src.bias,
                                    dst.emax, dst.emin, dst.mbits, dst.ebits, dst.bias,
                                    dst.code_min, dst.code_max, float(dst.max_normal))


def search_cpp(x: torch.Tensor, fmt: ElementFormat, block_size: int, weights: Optional[torch.Tensor],
               offsets: Tuple[int, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX scale search on CPU -> (int32 exponent per block, non-finite mask); ``weights``: float64
    (K,) importance per input column or None (mfqat.quant.scale_search.mx_search_exponent's result)."""
    w = weights if weights is not None else x.new_empty(0, dtype=torch.float64)
    return torch.ops.mfqat.search_mx(x, w, block_size, *_format_args(fmt, "floor")[:-1], list(offsets))


def decode_exponents_cpp(x: torch.Tensor, fmt: ElementFormat, block_size: int, s: torch.Tensor,
                         nonfinite: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to ``fmt`` with the given exponents and dequantized, in x's dtype."""
    return torch.ops.mfqat.decode_mx_exponents(x, s, nonfinite, block_size, *_format_args(fmt, "floor")[:-1])


def decode_exponents_through_cpp(x: torch.Tensor, anchor: ElementFormat, anchor_rule: str, fmt: ElementFormat,
                                 block_size: int, s: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """:func:`decode_exponents_cpp` of ``x`` quantize-dequantized in ``anchor`` first, in one pass."""
    return torch.ops.mfqat.decode_mx_exponents_through(x, s, nonfinite, block_size, *_format_args(anchor, anchor_rule),
                                                       *_format_args(fmt, "floor")[:-1])


def search_through_cpp(x: torch.Tensor, anchor: ElementFormat, anchor_rule: str, fmt: ElementFormat, block_size: int,
                       weights: Optional[torch.Tensor], offsets: Tuple[int, ...]
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`search_cpp` of ``x`` quantize-dequantized in ``anchor``, with the values those exponents
    decode to: (exponents, non-finite mask, values in x's dtype), one pass over ``x``."""
    w = weights if weights is not None else x.new_empty(0, dtype=torch.float64)
    return torch.ops.mfqat.search_mx_through(x, w, block_size, *_format_args(anchor, anchor_rule),
                                             *_format_args(fmt, "floor")[:-1], list(offsets))
