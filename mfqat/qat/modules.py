"""MF-QAT modules: drop-in nn.Linear / nn.Embedding that fake-quantize their weights.

The full-precision master weights stay the module's own ``weight`` / ``bias`` parameters, so
state_dict keys are unchanged and DDP, FSDP, PEFT LoRA wrapping, gradient checkpointing,
autocast and torch.compile see an ordinary Linear.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..quant.api import fake_quantize


class MFQATMixin:
    """Shared state: the active weight format (None = full precision) and quantizer options."""

    fmt: Optional[str]
    block_size: int
    scale_rule: str
    mask_saturated: bool
    anchor_format: Optional[str]

    def _init_qat(self, block_size: int, scale_rule: str, mask_saturated: bool,
                  anchor_format: Optional[str] = None) -> None:
        self.fmt = None
        self.block_size = block_size
        self.scale_rule = scale_rule
        self.mask_saturated = mask_saturated
        self.anchor_format = anchor_format

    def quantized_weight(self) -> torch.Tensor:
        """The weight as the forward pass sees it (fake-quantized in the active format).

        With an ``anchor_format`` (train-through-anchor) format f sees exactly what deployment
        gets by Slice-and-Scale of the anchor: ``qdq_f(qdq_anchor(W))`` (the second rounding uses
        the floor rule, as Slice-and-Scale does); the gradient passes straight through both.
        """
        w = self.weight  # type: ignore[attr-defined]
        if self.fmt is None:
            return w
        if self.anchor_format is None:
            return fake_quantize(w, self.fmt, self.block_size, self.scale_rule, self.mask_saturated)
        w = fake_quantize(w, self.anchor_format, self.block_size, self.scale_rule, self.mask_saturated)
        if self.fmt == self.anchor_format:
            return w
        return fake_quantize(w, self.fmt, self.block_size, "floor", self.mask_saturated)


class MFQATLinear(nn.Linear, MFQATMixin):
    """nn.Linear whose forward uses the MX fake-quantized weight of the active format."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, block_size: int = 32,
                 scale_rule: str = "floor", mask_saturated: bool = False,
                 activation_format: Optional[str] = None, anchor_format: Optional[str] = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_qat(block_size, scale_rule, mask_saturated, anchor_format)
        self.activation_format = activation_format

    @classmethod
    def from_linear(cls, lin: nn.Linear, block_size: int = 32, scale_rule: str = "floor",
                    mask_saturated: bool = False, activation_format: Optional[str] = None,
                    anchor_format: Optional[str] = None) -> "MFQATLinear":
        """Wrap an existing Linear, sharing its parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        new._init_qat(block_size, scale_rule, mask_saturated, anchor_format)
        new.activation_format = activation_format
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this module's parameters."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_format is not None and self.fmt is not None:
            x = fake_quantize(x, self.activation_format, self.block_size, self.scale_rule)
        w = self.quantized_weight()
        if x.dtype != w.dtype and not torch.is_autocast_enabled():
            w = w.to(x.dtype)
        return F.linear(x, w, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fmt={self.fmt}, block_size={self.block_size}"


class MFQATEmbedding(nn.Embedding, MFQATMixin):
    """nn.Embedding whose lookup uses the fake-quantized table (blocks along the hidden axis)."""

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, block_size: int = 32, scale_rule: str = "floor",
                       mask_saturated: bool = False, anchor_format: Optional[str] = None) -> "MFQATEmbedding":
        """Wrap an existing Embedding, sharing its weight."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for k in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                  "scale_grad_by_freq", "sparse"):
            setattr(new, k, getattr(emb, k))
        new.weight = emb.weight
        new._init_qat(block_size, scale_rule, mask_saturated, anchor_format)
        return new

    def to_embedding(self) -> nn.Embedding:
        """A plain nn.Embedding sharing this module's weight."""
        emb = nn.Embedding.__new__(nn.Embedding)
        nn.Module.__init__(emb)
        for k in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                  "scale_grad_by_freq", "sparse"):
            setattr(emb, k, getattr(self, k))
        emb.weight = self.weight
        return emb

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.quantized_weight(), self.padding_idx, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse)
