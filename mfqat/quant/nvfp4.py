"""NVFP4: the pure-PyTorch reference (the oracle of every other nvfp4 path).

NVIDIA's 4-bit float: blocks of 16 consecutive elements along the last axis; each block stores one
E4M3 (``float8_e4m3fn``) scale byte, each element an E2M1 code (the mxfp4 grid 0, 0.5, 1, 1.5, 2, 3,
4, 6 with a sign); an optional float32 per-tensor ``global_scale`` ``g`` (MLX's convention: ``g`` is
about the tensor's amax, the tensor's encode factor is ``enc = 448 * 6 / g``).

mfqat's rule (``rule="nvidia"``, the default), all in float32 on the exactly cast input::

    amax_b = max_i |x_i|                                    (per block of 16)
    s_b    = E4M3(amax_b / 6 [* enc])                       round half to even, saturating at 448,
                                                            subnormal scales kept (0 below 2^-10)
    P_i    = E2M1(x_i / s_b [* enc])                        round half to even, saturating at +-6,
                                                            the sign of zero kept; s_b = 0: P_i = 0
    x^_i   = P_i * s_b                 (with g: P_i * (s_b * (g / 2688)), float32)

``enc = fl32(2688 / g)``; every ``/`` and ``*`` above is one float32 operation. ``x / s_b`` is one
correctly rounded division, so its E2M1 rounding is the exact round-to-nearest-even of the true
quotient (24 >= 2 * 2 + 2 bits: the double rounding is innocuous). A block holding NaN or Inf gets
the NaN scale byte 0x7F and zero codes, and dequantizes to NaN (as mfqat's MX formats do).

``rule="mlx"`` reproduces ``mx.quantize(w, mode="nvfp4")`` of MLX 0.32 (CPU) bit for bit: the same
formulas, but ``amax / 6`` and ``x / s_b`` rounded to the input's dtype (the products with ``enc`` in
float32), and the element is MLX's ``argmin_j |y - LUT[j]|`` (float32 distances), first index on ties: ties go towards zero (0.75 -> 0.5, 5 -> 4), a negative value that rounds
to zero gets +0, and an element so large that ``|y - 6|`` rounds to ``|y|`` gets code 0; a non-finite
block gets scale 448 (MLX's ``to_fp8(nan)``) and its finite elements are rounded against it.
Dequantization is the same for both rules (docs/numerics.md, "NVFP4").
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from mfqat.formats import NVFP4_BLOCK, get_format
from mfqat.quant.reference import mx_codes_to_values, mx_round_elements, mx_values_to_codes

E4M3 = get_format("mxfp8_e4m3")  # the scale's grid: bias 7, max 448, subnormals down to 2^-9
E2M1 = get_format("mxfp4_e2m1")  # the element grid
E4M3_NAN = 0x7F
E4M3_MAX_BYTE = 0x7E  # 448
NVFP4_RANGE = 448.0 * 6.0  # E4M3 max x E2M1 max: the global scale's constant
NVFP4_RULES = ("nvidia", "mlx")
LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> E4M3 bytes: round half to even, saturating at 448 (inf too), subnormals kept.
    A negative or NaN scale has no byte here (a NaN block gets 0x7F from its caller): ValueError."""
    v = v.to(torch.float32)
    bad = (v < 0) | torch.isnan(v)
    if bool(bad.any()):
        raise ValueError(f"e4m3_encode: block scales must be non-negative and not NaN, got "
                         f"{v[bad].flatten()[0].item()} ({int(bad.sum())} of {v.numel()})")
    q, _ = mx_round_elements(v, E4M3)
    return mx_values_to_codes(q, E4M3)


def e4m3_decode(scales: torch.Tensor) -> torch.Tensor:
    """E4M3 bytes (uint8) -> float32 (0x7F / 0xFF: NaN)."""
    if scales.dtype != torch.uint8:
        raise TypeError(f"e4m3_decode: nvfp4 scales are E4M3 bytes (uint8), got {scales.dtype}")
    v = mx_codes_to_values(scales, E4M3)
    return torch.where((scales.to(torch.int32) & 0x7F) == E4M3_NAN, torch.full_like(v, float("nan")), v)


def _encode_factors(global_scale: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(enc = fl32(2688 / g), dec = fl32(g / 2688)) as float32 scalars, or (None, None) without g."""
    if global_scale is None:
        return None, None
    try:
        g = torch.as_tensor(global_scale, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"nvfp4 global_scale must be a float32 number, got {type(global_scale).__name__}") from None
    if g.numel() != 1:
        raise ValueError(f"nvfp4 global_scale must be one number per tensor, got shape {tuple(g.shape)}")
    g = g.reshape(())
    enc = torch.tensor(NVFP4_RANGE) / g
    if not (torch.isfinite(g) and g > 0 and torch.isfinite(enc)):
        raise ValueError(f"nvfp4 global_scale must be a finite positive float32 whose encode factor "
                         f"{NVFP4_RANGE:g} / global_scale is finite, got {g.item()}")
    return enc, g / torch.tensor(NVFP4_RANGE)


def nvfp4_quantize_blocks(blocks: torch.Tensor, global_scale: Optional[torch.Tensor] = None, rule: str = "nvidia",
                          dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks (..., n, 16) of a ``dtype`` tensor -> (E2M1 codes uint8, E4M3 scale bytes uint8)."""
    if blocks.shape[-1] != NVFP4_BLOCK:
        raise ValueError(f"nvfp4 blocks hold {NVFP4_BLOCK} elements, got {blocks.shape[-1]}")
    if rule == "mlx":
        return _quantize_mlx(blocks, global_scale, dtype)
    if rule != "nvidia":
        raise ValueError(f"unknown nvfp4 rule '{rule}'; choose one of {NVFP4_RULES}")
    codes, byte, _ = _quantize_nvidia(blocks, global_scale)
    return codes, byte


def _quantize_nvidia(blocks: torch.Tensor, global_scale: Optional[torch.Tensor]
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mfqat's rule (module docs) -> (codes, scale bytes, mask of elements that saturated at +-6)."""
    enc, _ = _encode_factors(global_scale)
    amax = blocks.abs().amax(dim=-1)
    nonfinite = ~torch.isfinite(amax)
    sb = torch.where(nonfinite, torch.zeros_like(amax), amax) / 6.0
    if enc is not None:
        sb = sb * enc
    byte = e4m3_encode(sb)
    s = e4m3_decode(byte).unsqueeze(-1)
    y = blocks / s
    if enc is not None:
        y = y * enc
    q, saturated = mx_round_elements(y, E2M1)
    codes = mx_values_to_codes(torch.where(torch.isfinite(y), q, torch.zeros_like(q)), E2M1)
    zero = (s == 0) | nonfinite.unsqueeze(-1)
    codes = torch.where(zero, torch.zeros_like(codes), codes)
    return codes, torch.where(nonfinite, torch.full_like(byte, E4M3_NAN), byte), saturated & ~zero


def _quantize_mlx(blocks: torch.Tensor, global_scale: Optional[torch.Tensor], dtype: torch.dtype
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``mx.quantize(w, mode="nvfp4")`` (MLX 0.32, CPU): its op graph in ``dtype``, argmin elements."""
    enc, _ = _encode_factors(global_scale)
    x = blocks.to(dtype)
    sb = (x.abs().amax(dim=-1) / torch.tensor(6.0, dtype=dtype)).float()  # in dtype
    if enc is not None:
        sb = sb * enc  # a float32 scalar: MLX promotes to float32
    byte = e4m3_encode(torch.where(torch.isnan(sb), torch.full_like(sb, 448.0), sb))  # to_fp8(nan) = 448
    y = (x / e4m3_decode(byte).to(dtype).unsqueeze(-1)).float()  # in dtype
    if enc is not None:
        y = y * enc
    lut = torch.tensor(LUT, dtype=torch.float32)  # float32: the distances are float32 in MLX
    codes = (y.unsqueeze(-1) - lut).abs().argmin(dim=-1)  # first index on ties, as MLX's argmin
    return codes.to(torch.uint8), byte


def nvfp4_dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor,
                            global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(E2M1 codes, E4M3 bytes) -> float32 blocks: ``P * s`` (with g: ``P * (s * fl32(g / 2688))``), as
    ``mx.dequantize(mode="nvfp4")`` computes it."""
    _, dec = _encode_factors(global_scale)
    s = e4m3_decode(scales)
    if dec is not None:
        s = s * dec
    return mx_codes_to_values(codes, E2M1) * s.unsqueeze(-1)


def nvfp4_fake_quantize_blocks(blocks: torch.Tensor, global_scale: Optional[torch.Tensor] = None
                               ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize-dequantize float32 blocks under mfqat's rule -> (float32 blocks, mask of the elements
    that saturated at +-6 x scale; only a block whose scale saturated at 448 has them)."""
    codes, scales, saturated = _quantize_nvidia(blocks, global_scale)
    return nvfp4_dequantize_blocks(codes, scales, global_scale), saturated
