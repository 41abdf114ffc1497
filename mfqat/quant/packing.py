"""Dense bit-stream packing of element codes along the last axis.

Codes of ``bits`` bits are laid out LSB-first: element i occupies bits [i*bits, (i+1)*bits) of
the row's byte stream, so two 4-bit codes share a byte with element 0 in the low nibble and four
6-bit codes fill three bytes (docs/numerics.md). Read as little-endian uint32 words this is also the
MLX affine layout.
"""
from __future__ import annotations

import math

import torch


def _check_row(n: int, bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits={bits!r}: codes are packed at 1 to 8 bits")
    if (n * bits) % 8:
        raise ValueError(f"cannot pack a last dimension of {n} codes of {bits} bits into whole bytes")


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (..., n) -> uint8 (..., n * bits // 8); only the low ``bits`` bits are kept."""
    n = codes.shape[-1]
    _check_row(n, bits)
    if bits == 8 and codes.dtype in (torch.int8, torch.uint8):  # the low 8 bits are the byte itself
        return codes.contiguous().view(torch.uint8).clone()
    if bits in (2, 4) and codes.dtype in (torch.int8, torch.uint8):  # whole codes a byte: stay in uint8
        return _pack_bytes(codes.contiguous().view(torch.uint8), bits)
    c = codes.to(torch.int32) & ((1 << bits) - 1)
    if bits == 8:
        return c.to(torch.uint8)
    if bits == 4:
        pairs = c.reshape(*c.shape[:-1], n // 2, 2)
        return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return _pack_words(c, bits)


def _group(bits: int) -> int:
    """Codes per whole-byte group: the fewest codes of ``bits`` bits that fill whole bytes (4 of 6 bits: 3 bytes)."""
    return 8 // math.gcd(bits, 8)


def _pack_words(c: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes` of masked int32 codes: each group of :func:`_group` codes gathered in one int64 word
    (code i at bit i * bits, at most 56 bits), whose low bytes are the group's bytes. A few bytes of work per code
    (a bit-by-bit stream took ~100: 15 GB for one 49152 x 3072 embedding at 6 bits)."""
    g = _group(bits)
    nbytes = g * bits // 8
    cg = c.reshape(*c.shape[:-1], c.shape[-1] // g, g)
    word = cg[..., 0].to(torch.int64)
    for i in range(1, g):
        word |= cg[..., i].to(torch.int64) << (i * bits)
    out = torch.empty(*word.shape, nbytes, dtype=torch.uint8, device=c.device)
    for j in range(nbytes):
        out[..., j] = (word >> (8 * j)) & 0xFF
    return out.reshape(*c.shape[:-1], c.shape[-1] * bits // 8)


def _unpack_words(p: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack_words`: uint8 (..., n * bits // 8) -> int32 codes (..., n)."""
    g = _group(bits)
    nbytes = g * bits // 8
    pg = p.reshape(*p.shape[:-1], n // g, nbytes)
    word = pg[..., 0].to(torch.int64) & 0xFF  # & 0xFF: bytes held in a signed dtype are not sign-extended
    for j in range(1, nbytes):
        word |= (pg[..., j].to(torch.int64) & 0xFF) << (8 * j)
    out = torch.empty(*word.shape, g, dtype=torch.int32, device=p.device)
    for i in range(g):
        out[..., i] = (word >> (i * bits)) & ((1 << bits) - 1)
    return out.reshape(*p.shape[:-1], n)


def _pack_bytes(c: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes` of uint8 codes whose width divides 8, in uint8 arithmetic (an int32 copy of a
    billion codes is 4 GB of memory traffic): element i of each group of ``8 // bits`` at bit i * bits."""
    per = 8 // bits
    mask = (1 << bits) - 1
    out = c[..., 0::per] & mask
    for i in range(1, per):
        out |= (c[..., i::per] & mask) << (i * bits)
    return out


def unpack_codes(packed: torch.Tensor, bits: int, n: int, signed: bool) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 (..., n * bits // 8) -> codes (..., n).

    Signed codes (MXINT) are sign-extended and returned as int8; others as uint8.
    """
    _check_row(n, bits)
    if packed.shape[-1] != n * bits // 8:
        raise ValueError(
            f"packed last dimension is {packed.shape[-1]} bytes, expected {n * bits // 8} "
            f"for {n} codes of {bits} bits"
        )
    if bits == 8 and packed.dtype == torch.uint8:  # a byte a code: sign-extending is reading it as int8
        return packed.contiguous().view(torch.int8).clone() if signed else packed.clone()
    if bits == 8:
        c = packed.to(torch.int32) & 0xFF
    elif bits == 4:
        p = packed.to(torch.int32) & 0xFF
        c = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], n)
    else:
        c = _unpack_words(packed, bits, n)
    if signed:
        c = torch.where(c >= (1 << (bits - 1)), c - (1 << bits), c)
        return c.to(torch.int8)
    return c.to(torch.uint8)
