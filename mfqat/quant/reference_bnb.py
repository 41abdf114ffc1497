"""Pure-PyTorch reference for the bitsandbytes baselines: NF4, INT8 absmax and NF4 double quantization.

* ``nf4`` (QLoRA): per block, absmax and the nearest entry of the NF4 code book (ties to the lower
  entry, as bitsandbytes' threshold comparisons decide).

* ``int8_absmax`` (LLM.int8's vector-wise rule): per block, codes = round(x * (127 / absmax))
  (half to even) in [-127, 127]; values = codes * absmax * (1/127), multiplied in that order as
  bitsandbytes' ``int8_vectorwise_dequant`` does. All-zero blocks give codes 0.
* Double quantization (QLoRA, ``quantize_4bit(compress_statistics=True)``): the float32 NF4
  absmax of a whole tensor, minus their mean (the *offset*), are quantized in groups of
  :data:`~mfqat.formats.DQ_GROUP` = 256 with bitsandbytes' signed 8-bit *dynamic* code book:
  each value is divided by its group's absmax and takes the nearest code-book entry (ties to the
  lower entry, the rule of bitsandbytes' pure-PyTorch backend). Decoding: code * group absmax +
  offset, in float32. The NF4 codes themselves are chosen with the exact absmax (as bitsandbytes
  does); only decoding sees the compressed one.

tests/test_bnb_formats.py checks this against bitsandbytes 0.50 on CPU: the code book, offset,
group absmax, every decode and all INT8 values are bit-exact. The 8-bit *code choice* of bnb's
native CPU kernel is not: it picks the farther of two neighbouring entries for values within
~1e-5 of a midpoint (about 0.2% of the values); we keep the exact nearest entry.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Tuple

import torch

from mfqat.formats import DQ_GROUP, NF4_CODEBOOK

INT8_QMAX = 127.0
INT8_INV_QMAX = 7.874015718698502e-3  # 1/127 as bitsandbytes multiplies by it (not a division)


@lru_cache(maxsize=None)
def dynamic_code_book() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map (256 sorted float32 values in [-1, 1]).

    Seven exponent levels 10^-6 .. 10^0; level i holds 2^i + 1 linearly spaced boundaries in
    [0.1, 1] whose midpoints, times 10^(i-6), give 2^i values of each sign; plus 0 and 1.
    """
    values: list[float] = []
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += ((10 ** (i - 6)) * means).tolist()
        values += (-(10 ** (i - 6)) * means).tolist()
    values += [0.0, 1.0]
    values.sort()
    return torch.tensor(values, dtype=torch.float32)


def int8_absmax_quantize_blocks(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 blocks -> (int8 codes, float32 absmax per block)."""
    absmax = blocks.abs().amax(dim=-1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = torch.round(blocks * (INT8_QMAX / safe).unsqueeze(-1)).clamp(-127, 127)
    return codes.to(torch.int8), absmax


def int8_absmax_dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """int8 codes and absmax -> float32 blocks (codes * absmax * (1/127))."""
    return codes.to(torch.float32) * absmax.unsqueeze(-1) * INT8_INV_QMAX


def _groups(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(flat, DQ_GROUP))


def dynamic_code_index(normed: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the dynamic-map entry nearest to each value in [-1, 1]; ties: lower entry."""
    book = dynamic_code_book().to(normed.device)
    left = (torch.searchsorted(book, normed, right=True) - 1).clamp(0, book.numel() - 1)
    right = (left + 1).clamp(max=book.numel() - 1)
    closer = (normed - book[right]).abs() < (normed - book[left]).abs()
    return torch.where(closer, right, left).to(torch.uint8)


def double_quantize_absmax(absmax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 NF4 absmax (any shape; one tensor's) -> (uint8 codes (same shape), float32 absmax per
    group of 256 of the flattened values, float32 offset (0-dim))."""
    flat = absmax.reshape(-1).to(torch.float32)
    offset = flat.mean()
    centred = flat - offset
    codes, group_max = [], []
    for g in _groups(centred):
        m = g.abs().amax()
        codes.append(dynamic_code_index(g / m if m > 0 else torch.zeros_like(g)))
        group_max.append(m)
    return torch.cat(codes).reshape(absmax.shape), torch.stack(group_max), offset


def double_dequantize_absmax(codes: torch.Tensor, group_max: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`double_quantize_absmax`: float32 absmax with ``codes``' shape."""
    book = dynamic_code_book().to(codes.device)
    vals = book[codes.reshape(-1).long()]
    out = torch.cat([v * m for v, m in zip(_groups(vals), group_max)])
    return (out + offset).reshape(codes.shape)


def nf4_double_quant_absmax(absmax: torch.Tensor) -> torch.Tensor:
    """The absmax NF4 decoding sees under double quantization (quantize, then decode)."""
    return double_dequantize_absmax(*double_quantize_absmax(absmax))


# ----------------------------------------------------------------------------- NF4


def _nf4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODEBOOK, dtype=torch.float32, device=device)


def nf4_quantize_blocks(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """NF4 (QLoRA): absmax per block, nearest code-book entry (bitsandbytes' decision tree).

    Returns (codes uint8 in [0, 15], absmax float32). Ties go to the lower entry, as in
    bitsandbytes' threshold comparisons.
    """
    absmax = blocks.abs().amax(dim=-1)
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    y = blocks * inv.unsqueeze(-1)
    table = _nf4_table(blocks.device)
    mids = (table[1:] + table[:-1]) / 2
    codes = torch.bucketize(y, mids, right=False)
    return codes.to(torch.uint8), absmax


def nf4_dequantize_blocks(codes: torch.Tensor, absmax: torch.Tensor) -> torch.Tensor:
    """NF4 codes and absmax -> float32 blocks."""
    return _nf4_table(codes.device)[codes.long()] * absmax.unsqueeze(-1)
