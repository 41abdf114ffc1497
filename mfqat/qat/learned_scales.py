"""Learned affine scales and biases trained with the weights (LSQ-style), for MLX's affine widths.

``QATConfig(learn_scales=True)`` with derived affine formats (``affine4``, ``affine3``, ...) in the
format set: every quantized weight ``W`` gets, for each affine width k and each group of
``affine_group_size``, two trained numbers ``(a, c)`` (0 at the start). Format k's forward is::

    q, s0, b0 = derive_affine(qdq_anchor(W), k)        MLX's codes and bfloat16 scale / bias (no gradient)
    s = bf16(s0 * (1 + a))      b = bf16(b0 + s0 * c)
    W_k = q * s + b                                      in bfloat16 arithmetic, as mx.dequantize computes it

with ``dW_k/dW = 1`` (straight-through, as every MF-QAT format), ``dW_k/da = q * s0`` and
``dW_k/dc = s0`` (bfloat16 rounding straight-through). It is ``mfqat refine``'s parametrisation
(mfqat.export.refine), learned during training against the task loss instead of after it against the
anchor. The pairs live in each MF-QAT module's ``learned_scales`` (a ParameterDict, key
``"{param}_{format}"``, shape ``[2, *groups]``: ``a`` then ``c``), so DDP, FSDP, checkpoints and the
optimizer see them; ``save_anchor`` turns them into the anchor's learned scales (mfqat.anchor.learned_scales),
so ``load_anchor(anchor, "affine4")`` and ``export-mlx --recipe uniform:affine4`` reproduce ``W_k`` bit
for bit, and it drops them from the anchor's full-precision tensors.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from mfqat.formats import canonical_name, get_format
from mfqat.quant.derive import DERIVED_DTYPE, derive_affine
from mfqat.quant.mxtensor import MXTensor

ATTR = "learned_scales"  # the ParameterDict's attribute on an MF-QAT module (and its state_dict infix)


def key_of(param: str, fmt: str) -> str:
    """The ParameterDict key of parameter ``param``'s learned scales in width ``fmt``."""
    return f"{param}_{canonical_name(fmt)}"


def affine_widths(formats: Iterable[str]) -> List[str]:
    """The affine formats of ``formats``, canonical, in order, without repeats."""
    out: List[str] = []
    for f in formats:
        name = canonical_name(f)
        if get_format(name).family == "affine" and name not in out:
            out.append(name)
    return out


def make_learned_scales(weights: Dict[str, torch.Tensor], widths: List[str], group_size: int) -> nn.ParameterDict:
    """Zero-initialised ``(a, c)`` per group for every weight of ``weights`` ({param name: weight}) and width."""
    params = {}
    for name, w in weights.items():
        groups = (*w.shape[:-1], w.shape[-1] // group_size)
        for fmt in widths:
            params[key_of(name, fmt)] = nn.Parameter(torch.zeros(2, *groups, device=w.device, dtype=torch.float32))
    return nn.ParameterDict(params)


def learned_parameters(model: nn.Module) -> List[nn.Parameter]:
    """Every learned-scale parameter of a prepared model (each once)."""
    seen, out = set(), []
    for module in model.modules():
        d = module._modules.get(ATTR)
        if isinstance(d, nn.ParameterDict):
            for p in d.values():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def param_groups(model: nn.Module, lr: float, weight_decay: float, scales_lr: float) -> List[dict]:
    """Optimizer parameter groups: the model's trainable parameters at ``lr`` / ``weight_decay``, and its
    learned scales (when it has any) at ``scales_lr`` without weight decay (they are relative steps of
    the derived scale, which a fine-tuning learning rate would barely move)."""
    every = learned_parameters(model)
    learned = {id(p) for p in every}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in learned]
    groups = [{"params": rest, "lr": lr, "weight_decay": weight_decay}]
    scales = [p for p in every if p.requires_grad]
    if scales:
        groups.append({"params": scales, "lr": scales_lr, "weight_decay": 0.0})
    return groups


def scales_biases(q: MXTensor, ac: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """float32 ``s0 * (1 + a)`` and ``b0 + s0 * c`` of the derived tensor ``q`` (differentiable in ``ac``);
    the stored values are their bfloat16 roundings (training and save_anchor both call this)."""
    if ac.shape[1:] != q.scales.shape:
        raise ValueError(f"learned scales of shape {tuple(ac.shape[1:])} do not fit the {q.fmt.name} groups "
                         f"{tuple(q.scales.shape)} of the weight: was it resized after prepare?")
    s0 = q.scales.to(ac.device)
    return s0 * (1 + ac[0]), q.biases.to(ac.device) + s0 * ac[1]


def _rounded(q: MXTensor, s: torch.Tensor, b: torch.Tensor) -> MXTensor:
    """``q``'s codes with the bfloat16 roundings of ``s`` and ``b`` (held in float32, as MXTensor holds
    affine scales): what the anchor stores and ``mx.dequantize`` decodes."""
    return MXTensor(q.codes, s.detach().to(DERIVED_DTYPE).float(), q.fmt, q.block_size, q.dtype,
                    b.detach().to(DERIVED_DTYPE).float(), q.scale_rule)


def with_learned(q: MXTensor, ac: torch.Tensor) -> MXTensor:
    """The derived tensor ``q`` (codes, s0, b0) with the learned bfloat16 ``s`` and ``b``."""
    return _rounded(q, *scales_biases(q, ac.detach()))


def learned_tensor(values: torch.Tensor, fmt: str, group_size: int, ac: torch.Tensor) -> MXTensor:
    """Width ``fmt`` of the anchor values ``values`` with the learned scales (save_anchor stores these)."""
    return with_learned(derive_affine(values.detach(), fmt, group_size), ac)


def learned_affine(w_anchor: torch.Tensor, fmt: str, group_size: int, ac: torch.Tensor) -> torch.Tensor:
    """``W_k`` of the module docstring in ``w_anchor``'s dtype: the value MLX dequantizes, the gradient
    straight through to ``w_anchor`` and through the scale formula to ``ac``."""
    with torch.no_grad():
        q = derive_affine(w_anchor.detach(), fmt, group_size)
        codes = q.codes.to(torch.float32).reshape(*q.scales.shape, group_size)
    s, b = scales_biases(q, ac)  # once: the exact value and the surrogate's gradient both come from it
    with torch.no_grad():
        exact = _rounded(q, s, b).dequantize(torch.float32).to(w_anchor.device)
    surrogate = (codes * s.unsqueeze(-1) + b.unsqueeze(-1)).reshape(w_anchor.shape)
    out = exact + (w_anchor - w_anchor.detach()).float() + (surrogate - surrogate.detach())
    return out.to(w_anchor.dtype)


def pop_learned(state: Dict[str, torch.Tensor], tied: Optional[Dict[str, str]] = None
                ) -> Dict[Tuple[str, str], torch.Tensor]:
    """Remove the learned-scale entries from a prepared model's state dict (and its tied aliases);
    returns {(tensor name, width): (a, c)}, the tensor name being the weight's state-dict name."""
    infix = f".{ATTR}."
    out: Dict[Tuple[str, str], torch.Tensor] = {}
    for k in [k for k in state if infix in f".{k}"]:
        value = state.pop(k)
        prefix, _, key = f".{k}".rpartition(infix)
        param, _, fmt = key.rpartition("_")
        name = f"{prefix[1:]}.{param}" if prefix else param
        out[(name, fmt)] = value
    for k in [k for k in (tied or {}) if infix in f".{k}" or infix in f".{tied[k]}"]:
        del tied[k]
    return out
