"""MF-QAT on MLX: a fake-quantizing linear layer, prepare() over mlx-lm models, the same schedules.

Targets, exclusions, per-layer format sets and schedules come from :class:`mfqat.qat.QATConfig`
(the same code as the PyTorch side, no copy), so one YAML recipe trains the same way on both.
"""
from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mfqat.quant.derive import DERIVED_GROUP_SIZE, is_derived
from mfqat.formats import canonical_name
from mfqat.qat.config import QATConfig
from mfqat.qat.schedules import Schedule, ScheduleClock
from mfqat.quant.scale_rules import SEARCH_RULE, resolve_scale_rules, rule_of
from mfqat.mlx.observers import WindowMinMaxObserver
from mfqat.mlx.quant import fake_quantize


class MFQATLinear(nn.Module):
    """``nn.Linear`` whose weight is fake-quantized in the active format (None = full precision).

    ``scale_rules``: {format: rule} set by :func:`prepare` (a read-only mapping, so MLX does not
    take it for a parameter tree); None = ``scale_rule`` (floor for the second rounding).

    Holds the full-precision master weight (and bias) as its parameters, under the same names as
    ``nn.Linear``, so checkpoints and LoRA wrapping see an ordinary linear layer.
    """

    def __init__(self, weight: mx.array, bias: Optional[mx.array] = None, block_size: int = 32,
                 scale_rule: str = "floor", anchor_format: Optional[str] = None,
                 affine_group_size: int = DERIVED_GROUP_SIZE):
        super().__init__()
        self.weight = weight
        if bias is not None:
            self.bias = bias
        self.block_size = block_size
        self.scale_rule = scale_rule
        self.anchor_format = anchor_format
        self.affine_group_size = affine_group_size
        self.fmt: Optional[str] = None
        self.scale_rules: Optional[MappingProxyType] = None

    @classmethod
    def from_linear(cls, lin: nn.Linear, block_size: int = 32, scale_rule: str = "floor",
                    anchor_format: Optional[str] = None, affine_group_size: int = DERIVED_GROUP_SIZE
                    ) -> "MFQATLinear":
        return cls(lin.weight, lin.get("bias"), block_size, scale_rule, anchor_format, affine_group_size)

    def to_linear(self) -> nn.Linear:
        out_dims, in_dims = self.weight.shape
        lin = nn.Linear(in_dims, out_dims, bias="bias" in self)
        lin.weight = self.weight
        if "bias" in self:
            lin.bias = self["bias"]
        return lin

    def quantized_weight(self) -> mx.array:
        """The weight as the forward pass sees it (through the anchor when ``anchor_format`` is
        set: ``qdq_f(qdq_anchor(W))``, as the PyTorch module; each format's rule from ``scale_rules``)."""
        if self.fmt is None:
            return self.weight
        rules = self.scale_rules
        if self.anchor_format is None:
            return self._qdq(self.weight, self.fmt, rule_of(rules, self.fmt, self.scale_rule))
        w = fake_quantize(self.weight, self.anchor_format, self.block_size,
                          rule_of(rules, self.anchor_format, self.scale_rule))
        return w if self.fmt == self.anchor_format else self._qdq(w, self.fmt, rule_of(rules, self.fmt))

    def _qdq(self, w: mx.array, fmt: str, scale_rule: str) -> mx.array:
        """One quantize-dequantize: MX in blocks of ``block_size``; a derived affine format as MLX
        stores it (bfloat16 scale and bias per ``affine_group_size``, as mfqat.quant.derive)."""
        if is_derived(fmt):
            return fake_quantize(w.astype(mx.bfloat16), fmt, self.affine_group_size).astype(w.dtype)
        return fake_quantize(w, fmt, self.block_size, scale_rule)

    def __call__(self, x: mx.array) -> mx.array:
        if self.fmt is not None and "act_observer" in self:  # static activation observer (.observers)
            x = self.act_observer(x)
        w = self.quantized_weight()
        if "bias" in self:
            return mx.addmm(self["bias"], x, w.T)
        return x @ w.T

    def _extra_repr(self) -> str:
        return f"{self.weight.shape[1]}, {self.weight.shape[0]}, fmt={self.fmt}, block_size={self.block_size}"


class MFQATSwitchLinear(MFQATLinear):
    """mlx-lm's ``SwitchLinear`` (MoE experts, weight ``[E, out, in]``) with the weight fake-quantized in the
    active format: MX blocks along in_features, per expert, as the PyTorch experts (mfqat.qat.experts)."""

    @classmethod
    def from_switch(cls, lin: nn.Module, block_size: int = 32, scale_rule: str = "floor",
                    anchor_format: Optional[str] = None, affine_group_size: int = DERIVED_GROUP_SIZE
                    ) -> "MFQATSwitchLinear":
        return cls(lin.weight, lin.get("bias"), block_size, scale_rule, anchor_format, affine_group_size)

    def to_linear(self) -> nn.Module:
        from mlx_lm.models.switch_layers import SwitchLinear

        count, out_dims, in_dims = self.weight.shape
        lin = SwitchLinear(in_dims, out_dims, count, bias="bias" in self)
        lin.weight = self.weight
        if "bias" in self:
            lin.bias = self["bias"]
        return lin

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        x = mx.gather_mm(x, self.quantized_weight().swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x

    def _extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, " + super()._extra_repr()


def _family(model: nn.Module):
    """The mfqat.models family of an mlx-lm model (by its model_type)."""
    from mfqat.models import family_for

    return family_for(getattr(model, "model_type", None) or getattr(getattr(model, "args", None), "model_type", None))


class MLXController(ScheduleClock):
    """Each prepared layer's schedule; sets the active format per step (as the PyTorch controller)."""

    def scheduled(self, model: nn.Module) -> Iterator[Tuple[str, MFQATLinear]]:
        """(name, layer) for every MF-QAT layer of the model."""
        return qat_layers(model)


def qat_layers(model: nn.Module) -> Iterator[Tuple[str, MFQATLinear]]:
    """(name, layer) for every MF-QAT layer of the model."""
    for name, m in model.named_modules():
        if isinstance(m, MFQATLinear):
            yield name, m


def prepare(model: nn.Module, config: Optional[QATConfig] = None) -> nn.Module:
    """Swap targeted ``nn.Linear`` layers of an MLX model for :class:`MFQATLinear`, in place.

    Same rules as :func:`mfqat.prepare`: layers whose input width is not a multiple of the block
    size are skipped with a warning naming them; targets that match nothing raise. Weight-only:
    the dynamic MX activation and embedding fake-quant are PyTorch-side features and are refused
    here; the static ``activation_observer`` is supported (:mod:`mfqat.mlx.observers`).
    """
    config = config or QATConfig()
    if config.learn_scales:
        raise ValueError("mfqat.mlx.prepare: learn_scales (affine scales learned with the weights) is PyTorch-only; "
                         "set it to false for MLX training, and learn the scales after it with mfqat refine ANCHOR")
    if config.quantize_activations or config.quantize_embeddings:
        raise ValueError("mfqat.mlx.prepare: quantize_activations / quantize_embeddings are not supported "
                         "on MLX yet (weight-only MF-QAT); set them to false in the QATConfig")
    if SEARCH_RULE in config.scale_rules.values():
        raise ValueError("mfqat.mlx.prepare: the 'search' scale rule is trained in PyTorch only (mfqat train); "
                         "on MLX use floor or ceil in QATConfig.scale_rules")
    found = [name for name, _ in qat_layers(model)]
    if found or "mfqat_controller" in model.__dict__:
        raise ValueError(f"mfqat.mlx.prepare: {type(model).__name__} is already prepared ({len(found)} MF-QAT "
                         "layers); use set_format to change formats, or unprepare(model) before preparing again")
    from mlx_lm.models.switch_layers import SwitchLinear

    swaps, schedules, skipped = [], {}, []
    family = _family(model)
    for name, m in model.named_modules():
        if type(m) not in (nn.Linear, SwitchLinear) or not config.selects(name) or family.kept_high(f"{name}.weight"):
            continue
        width = m.weight.shape[-1]
        if width % config.group_multiple():
            skipped.append(f"{name} ({width} not a multiple of {config.group_multiple()})")
            continue
        anchor = config.anchor_format if config.through_anchor else None
        make = MFQATSwitchLinear.from_switch if isinstance(m, SwitchLinear) else MFQATLinear.from_linear
        layer = make(m, config.block_size, config.scale_rule, anchor, config.affine_group_size)
        layer.scale_rules = MappingProxyType(resolve_scale_rules(config.scale_rule, config.scale_rules))
        if config.activation_observer:
            layer.act_observer = WindowMinMaxObserver(width, config.observer_window)
        swaps.append((name, layer))
        schedules[name] = config.schedule_for(name)
    if skipped:
        warnings.warn("mfqat.mlx.prepare skipped layers (kept full precision): " + ", ".join(skipped))
    if not swaps:
        raise ValueError(f"mfqat.mlx.prepare: targets {config.targets!r} matched no nn.Linear in "
                         f"{type(model).__name__}; check QATConfig.targets (quantized layers must be "
                         "dequantized first: mlx_lm.utils.dequantize_model)")
    model.update_modules(tree_unflatten(swaps))
    controller = MLXController(config, schedules)
    model.mfqat_controller = controller
    controller.set_step(model, 0, 1)
    return model


def set_format(model: nn.Module, fmt: Optional[str]) -> None:
    """Pin every MF-QAT layer to one format (None = full precision)."""
    name = None if fmt is None else canonical_name(fmt)
    for _, m in qat_layers(model):
        m.fmt = name


def unprepare(model: nn.Module) -> nn.Module:
    """Replace MF-QAT layers by plain ``nn.Linear`` holding the same arrays."""
    swaps = [(name, m.to_linear()) for name, m in qat_layers(model)]
    if swaps:
        model.update_modules(tree_unflatten(swaps))
    if "mfqat_controller" in model.__dict__:
        del model.__dict__["mfqat_controller"]
    return model
