"""AWQ pre-scaling for the post-training path (docs/architecture.md), with mfqat's own importance matrix.

For each producer -> consumers group of a decoder block, as the model's family lists them
(mfqat.models: ``Family.awq_groups``; for Llama the input norm -> the attention's
query/key/value projections, the post-attention norm -> the MLP's gate and up projections, up ->
down, and value -> output when their widths match (no grouped-query attention); a family without
groups is refused), the consumers' input channels are multiplied by ``s = importance^0.5 / sqrt(max * min)`` and the
producer's output channels divided by ``s``, so the full-precision model computes the same function
(up to float rounding; tested) while the salient input channels get more of the quantization grid.
``importance`` is the mean squared activation per input channel on calibration text (the
"imatrix": mfqat.anchor.importance, or read from a llama.cpp imatrix GGUF: mfqat.export.imatrix).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from mfqat.anchor.importance import activation_sums, importance_matrix  # noqa: F401 (re-exported)
from mfqat.models import Family, decoder_layers, family_of



def awq_scales(importance: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s = importance^alpha normalised by sqrt(max * min) (so that s spans 1/r .. r)."""
    s = importance.clamp(min=1e-8).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def _scale_producer(producer: nn.Module, s: torch.Tensor, norm_offset: float = 0.0) -> None:
    """Divide the producer's output channels by s: a Linear's rows and bias, or a norm's gain (for a norm
    computing x * (norm_offset + w), such as Gemma's ``1 + w``: w' = (norm_offset + w) / s - norm_offset)."""
    w = producer.weight.data
    offset = 0.0 if isinstance(producer, nn.Linear) else norm_offset
    s = s.view(-1, *([1] * (w.dim() - 1))).to(w.dtype)
    w.copy_((w + offset) / s - offset) if offset else w.div_(s)
    if getattr(producer, "bias", None) is not None:
        producer.bias.data.div_(s.view(-1).to(producer.bias.dtype))


def awq_family(model: nn.Module) -> Family:
    """The model's family, refused (ValueError naming it and why) when mfqat has no AWQ groups for it."""
    family = family_of(model)
    if not family.awq_groups:
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"AWQ: {model_type}: {family.awq_refusal}; export without --awq (README, 'Model families')")
    return family


def awq_pairs(model: nn.Module) -> List[Tuple[str, List[str]]]:
    """The (producer, consumers) module names AWQ rescales; pairs whose widths differ are skipped."""
    groups = awq_family(model).awq_groups
    names = {id(m): n for n, m in model.named_modules()}
    pairs = []
    _, layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"AWQ: {type(model).__name__} has no decoder layers (a ModuleList named layers)")
    for layer in layers:
        present = {n for n, _ in layer.named_modules()}
        for producer_name, consumer_names in groups:
            if producer_name not in present or any(c not in present for c in consumer_names):
                continue  # a group of another layer type (hybrid models: linear vs full attention)
            producer = layer.get_submodule(producer_name)
            consumers = [layer.get_submodule(c) for c in consumer_names]
            if any(c.in_features != producer.weight.shape[0] for c in consumers):
                continue  # e.g. v_proj -> o_proj under grouped-query attention
            pairs.append((names[id(producer)], [names[id(c)] for c in consumers]))
    if not pairs:
        raise ValueError("AWQ: no producer -> consumer pair found to scale")
    return pairs


def apply_awq(model: nn.Module, blocks: Optional[torch.Tensor], alpha: float = 0.5,
              imatrix: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, dict]:
    """Fold AWQ scales into the model in place; returns per-group statistics (min/max of s).

    ``imatrix``: module name -> importance (e.g. from a llama.cpp GGUF, mfqat.export.imatrix); when
    given, ``blocks`` is not used and no calibration forward pass runs."""
    pairs = awq_pairs(model)
    family = awq_family(model)
    if imatrix is None:
        if blocks is None:
            raise ValueError("AWQ: pass calibration blocks or an importance matrix")
        imatrix = importance_matrix(model, blocks)
    stats: Dict[str, dict] = {}
    for producer_name, consumer_names in pairs:
        producer = model.get_submodule(producer_name)
        consumers = [model.get_submodule(c) for c in consumer_names]
        s = awq_scales(imatrix[consumer_names[0]], alpha)
        with torch.no_grad():
            _scale_producer(producer, s, family.norm_offset)
            for c in consumers:
                c.weight.data.mul_(s.view(1, -1).to(c.weight.dtype))
        short = [c.split(".", 3)[-1] for c in consumer_names]  # as before: names relative to the layer
        stats[f"{producer_name} -> {short}"] = {"s_min": s.min().item(), "s_max": s.max().item()}
    return stats
