"""MXTensor: unpacked codes + block scales + format, with dense packing."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from mfqat.formats import ElementFormat, FormatLike, get_format
from mfqat.quant.packing import pack_codes, unpack_codes
from mfqat.quant.nvfp4 import nvfp4_dequantize_blocks
from mfqat.quant.reference import dequantize_blocks


@dataclass
class MXTensor:
    """A block-quantized tensor.

    Attributes:
        codes: unpacked integer codes with the original shape (int8 for MXINT, uint8 otherwise).
        scales: per block: E8M0 bytes (uint8) for MX formats, E4M3 bytes (uint8) for nvfp4, float32 absmax (nf4, int8_absmax; for
            nf4_dq the decoded double-quantized absmax) or scale (affine).
            Shape ``shape[:-1] + (shape[-1] // block_size,)``.
        fmt: the element format.
        block_size: elements per block along the last axis.
        dtype: the original floating dtype (``dequantize()`` returns it by default).
        biases: affine biases (float32, same shape as scales), else None.
        scale_rule: "floor", "ceil" or "search", how the MX scales were chosen.
        slice_rules: {format: rule} of an anchor's tensor: the scale rule of each lower format
            Slice-and-Scale gives (mfqat.quant.scale_rules; read from the anchor); None = floor.
        importance: per input column (last axis), the weights of a ``search`` slice's error
            (mfqat.quant.scale_search; set by ``export-mlx --scale-search``); None = plain MSE.
        global_scale: nvfp4 only: the optional float32 per-tensor scale (mfqat.quant.nvfp4); None = none.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: ElementFormat
    block_size: int
    dtype: torch.dtype = torch.float32
    biases: Optional[torch.Tensor] = None
    scale_rule: str = "floor"
    slice_rules: Optional[Dict[str, str]] = None
    importance: Optional[torch.Tensor] = None
    global_scale: Optional[torch.Tensor] = None

    @property
    def shape(self) -> torch.Size:
        """Shape of the quantized tensor."""
        return self.codes.shape

    def rows(self, lo: int, hi: int) -> "MXTensor":
        """Rows lo:hi of a quantized matrix (blocks run along the last axis, so its rows are independent): the
        codes, scales and biases sliced, every other field the same."""
        return dataclasses.replace(self, codes=self.codes[lo:hi], scales=self.scales[lo:hi],
                                   biases=None if self.biases is None else self.biases[lo:hi])

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Decode to a float tensor (the original dtype unless ``dtype`` is given)."""
        bs = self.block_size
        codes = self.codes.reshape(*self.shape[:-1], self.shape[-1] // bs, bs)
        if self.fmt.family == "nvfp4":
            out = nvfp4_dequantize_blocks(codes, self.scales, self.global_scale)
        elif self.fmt.is_mx:
            from mfqat.quant.kernels import mx_dequantize_dispatch

            out = mx_dequantize_dispatch(self.codes, self.scales, self.fmt, bs)
        else:
            out = dequantize_blocks(codes, self.scales, self.biases, self.fmt, self.dtype)
        return out.reshape(self.shape).to(dtype or self.dtype)

    def pack(self) -> torch.Tensor:
        """Dense uint8 storage of the codes: shape ``shape[:-1] + (shape[-1] * bits // 8,)``."""
        return pack_codes(self.codes, self.fmt.bits)

    @classmethod
    def unpack(cls, packed: torch.Tensor, scales: torch.Tensor, fmt: FormatLike, block_size: int,
               shape: Tuple[int, ...], dtype: torch.dtype = torch.float32,
               biases: Optional[torch.Tensor] = None, scale_rule: str = "floor") -> "MXTensor":
        """Rebuild an MXTensor from :meth:`pack` output and its scales."""
        f = get_format(fmt)
        codes = unpack_codes(packed, f.bits, shape[-1], signed=f.family in ("mxint", "absmax"))
        return cls(codes.reshape(shape), scales, f, block_size, dtype, biases, scale_rule)

    def to(self, device: torch.device | str) -> "MXTensor":
        """Move codes and scales to a device."""
        b = None if self.biases is None else self.biases.to(device)
        return MXTensor(self.codes.to(device), self.scales.to(device), self.fmt, self.block_size,
                        self.dtype, b, self.scale_rule, self.slice_rules,
                        None if self.importance is None else self.importance.to(device),
                        None if self.global_scale is None else self.global_scale.to(device))

    def __repr__(self) -> str:
        return (f"MXTensor(fmt={self.fmt.name}, shape={tuple(self.shape)}, "
                f"block_size={self.block_size}, dtype={self.dtype})")
