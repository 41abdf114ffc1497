"""MF-QAT for fused MoE experts: 3-D parameters ``[E, out, in]`` fake-quantized per expert.

transformers 5 holds a MoE layer's experts as one module with fused parameters (``gate_up_proj``
``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``) that its forward indexes per expert. ``prepare`` turns
such a module into an MF-QAT module in place: its class gains :class:`MFQATExperts` (the parameters,
the state_dict keys and the forward code stay the module's own), and while the forward runs, reading
``self.gate_up_proj`` gives the weight fake-quantized in the active format (MX blocks along the last
axis, the in_features of every expert's matrix; straight-through gradient to the master weight).
Each parameter is quantized once per forward, however many experts the forward visits.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from mfqat.qat.modules import MFQATMixin


class ExpertWeight(MFQATMixin):
    """The quantizer of one fused expert parameter: MFQATMixin's numerics on ``owner.<name>``."""

    def __init__(self, owner: nn.Module, name: str, block_size: int, scale_rule: str, mask_saturated: bool,
                 anchor_format: Optional[str]):
        self._owner, self.name, self._param_name = owner, name, name
        self._init_qat(block_size, scale_rule, mask_saturated, anchor_format)

    @property
    def weight(self) -> torch.Tensor:
        """The master weight (never the fake-quantized view the forward reads)."""
        return self._owner._parameters[self.name]

    @property
    def training(self) -> bool:
        return self._owner.training


class MFQATExperts(MFQATMixin):
    """Mixed into a fused-experts module's class by :func:`prepare_experts` (see the module docstring)."""

    mfqat_weights: Dict[str, ExpertWeight]

    @property
    def fmt(self) -> Optional[str]:  # type: ignore[override]
        return next(iter(self.mfqat_weights.values())).fmt

    @fmt.setter
    def fmt(self, value: Optional[str]) -> None:
        for w in self.__dict__.get("mfqat_weights", {}).values():
            w.fmt = value

    def target_names(self, prefix: str) -> List[str]:
        """The state_dict names of the quantized parameters, for a module called ``prefix``."""
        return [f"{prefix}.{name}" for name in self.mfqat_weights]

    def importance(self) -> Optional[torch.Tensor]:
        """Experts record no input importance (their inputs are routed per token): the ``search`` rule
        weighs every column alike, in training and when the anchor is lowered."""
        return None

    @property
    def tracks_importance(self) -> bool:  # type: ignore[override]
        return False

    def __getattr__(self, name: str):
        weights = self.__dict__.get("mfqat_weights")
        cache = self.__dict__.get("_mfqat_cache")
        if weights is not None and cache is not None and name in weights:
            if name not in cache:
                cache[name] = weights[name].quantized_weight()
            return cache[name]
        return super().__getattr__(name)

    def forward(self, *args, **kwargs):
        if self.fmt is None:
            return super().forward(*args, **kwargs)
        self.__dict__["_mfqat_cache"] = {}
        try:
            return self.with_every_learned_scale(super().forward(*args, **kwargs))
        finally:
            self.__dict__["_mfqat_cache"] = None

    def to_plain(self) -> nn.Module:
        """Undo :func:`prepare_experts` in place (the parameters are untouched); returns the module."""
        base = self.__dict__.pop("_mfqat_base_class")
        self._modules.pop("learned_scales", None)  # QATConfig.learn_scales (mfqat.qat.learned_scales)
        for key in ("mfqat_weights", "_mfqat_cache", "block_size", "scale_rule", "mask_saturated", "anchor_format",
                    "affine_group_size", "scale_rules"):
            self.__dict__.pop(key, None)
        self.__class__ = base
        return self


_CLASSES: Dict[type, type] = {}


def prepare_experts(module: nn.Module, names: List[str], block_size: int, scale_rule: str, mask_saturated: bool,
                    anchor_format: Optional[str]) -> MFQATExperts:
    """Make ``module`` (holding the fused 3-D parameters ``names``) an MF-QAT module, in place."""
    base = type(module)
    cls = _CLASSES.setdefault(base, type(f"MFQAT{base.__name__}", (MFQATExperts, base), {}))
    module.__dict__["mfqat_weights"] = {
        n: ExpertWeight(module, n, block_size, scale_rule, mask_saturated, anchor_format) for n in names}
    module.__dict__["_mfqat_cache"] = None
    module.__dict__["_mfqat_base_class"] = base
    module.__class__ = cls
    module._init_qat(block_size, scale_rule, mask_saturated, anchor_format)
    return module  # type: ignore[return-value]
