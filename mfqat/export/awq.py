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

import functools
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from mfqat.anchor.importance import activation_sums, importance_matrix  # noqa: F401 (re-exported)
from mfqat.models import Family, decoder_layers, family_of



def awq_scales(importance: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """s = importance^alpha normalised by sqrt(max * min) (so that s spans 1/r .. r)."""
    s = importance.clamp(min=1e-8).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


Scaling = Tuple[str, torch.Tensor, float]  # ("rows" | "cols", s, norm offset): one step AWQ applies to a tensor


def scaled(value: torch.Tensor, steps: List[Scaling]) -> torch.Tensor:
    """``value`` with AWQ's steps applied in order: "rows" divides the output channels (axis 0) by s, a norm's
    gain computing x * (offset + w) as w' = (offset + w) / s - offset (Gemma's ``1 + w``); "cols" multiplies
    the input channels (the last axis) by s. In ``value``'s dtype, as the loaded model's in-place updates were."""
    w = value
    for kind, s, offset in steps:
        if kind == "rows":
            s = s.view(-1, *([1] * (w.dim() - 1))).to(w.dtype)
            w = (w + offset) / s - offset if offset else w / s
        else:
            w = w * s.view(1, -1).to(w.dtype)
    return w


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


def awq_scalings(model: nn.Module, imatrix: Dict[str, torch.Tensor],
                 alpha: float = 0.5) -> Tuple[Dict[str, List[Scaling]], Dict[str, dict]]:
    """({parameter name: the steps AWQ applies to it, in order}, per-group statistics: min/max of s) for the
    model's (producer, consumers) pairs; the model may be on the meta device (only names and shapes are read).
    A producer's output channels (its weight's rows and bias, or a norm's gain) are divided by s, its
    consumers' input channels multiplied by s (:func:`scaled`)."""
    family = awq_family(model)
    steps: Dict[str, List[Scaling]] = {}
    stats: Dict[str, dict] = {}
    for producer_name, consumer_names in awq_pairs(model):
        producer = model.get_submodule(producer_name)
        s = awq_scales(imatrix[consumer_names[0]], alpha)
        offset = 0.0 if isinstance(producer, nn.Linear) else family.norm_offset
        steps.setdefault(f"{producer_name}.weight", []).append(("rows", s, offset))
        if getattr(producer, "bias", None) is not None:
            steps.setdefault(f"{producer_name}.bias", []).append(("rows", s, 0.0))
        for c in consumer_names:
            steps.setdefault(f"{c}.weight", []).append(("cols", s, 0.0))
        short = [c.split(".", 3)[-1] for c in consumer_names]  # as before: names relative to the layer
        stats[f"{producer_name} -> {short}"] = {"s_min": s.min().item(), "s_max": s.max().item()}
    return steps, stats


def apply_awq(model: nn.Module, blocks: Optional[torch.Tensor], alpha: float = 0.5,
              imatrix: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, dict]:
    """Fold AWQ scales into the model in place; returns per-group statistics (min/max of s).

    ``imatrix``: module name -> importance (e.g. from a llama.cpp GGUF, mfqat.export.imatrix); when
    given, ``blocks`` is not used and no calibration forward pass runs."""
    awq_pairs(model)  # refused before a calibration pass when the family has no groups
    if imatrix is None:
        if blocks is None:
            raise ValueError("AWQ: pass calibration blocks or an importance matrix")
        imatrix = importance_matrix(model, blocks)
    steps, stats = awq_scalings(model, imatrix, alpha)
    with torch.no_grad():
        for name, todo in steps.items():
            p = model.get_parameter(name)
            p.data.copy_(scaled(p.data, todo))
    return stats


def streamed_awq(folder, inspected: tuple, calib_text: Optional[str] = None, imatrix_path: Optional[str] = None,
                 alpha: float = 0.5) -> Tuple[Dict[str, Callable[[torch.Tensor], torch.Tensor]], dict]:
    """AWQ for an HF checkpoint folder that maps tensor by tensor (mfqat.anchor.stream.inspect_folder's answer
    ``inspected``), without loading the model: ({tensor name: its scaling, for mfqat.anchor.stream.folder_anchor's
    ``transforms``}, the report entry). The importance is measured on the full-precision model run module by
    module (mfqat.export.lazy_model; each module's weights read from the shards in float32, what the model
    loaded in float32 holds, so the same importance bit for bit), or read from ``imatrix_path``. The scaled
    tensors are float32, as those of the loaded model AWQ rescaled in place."""
    from mfqat.anchor.source import SourceCheckpoint
    from mfqat.anchor.stream import close_anchor, folder_anchor, folder_tokenizer
    from mfqat.data.sources import calibration_blocks
    from mfqat.export.lazy_model import LazyModel

    _, meta, _ = inspected
    awq_pairs(meta)  # refused before anything is read when the family has no groups
    entry: dict = {}
    if imatrix_path is not None:
        from mfqat.export.imatrix import imatrix_for_model
        imatrix = imatrix_for_model(meta, imatrix_path, [c[0] for _, c in awq_pairs(meta)])
        entry["imatrix"] = str(imatrix_path)
    else:
        tok = folder_tokenizer(folder)
        if tok is None:
            raise ValueError(f"{folder}: no tokenizer to calibrate AWQ with; pass --imatrix-path or add the tokenizer")
        names = folder_anchor(folder, inspected=inspected)  # the names, config and tied aliases LazyModel asks
        try:
            with SourceCheckpoint(folder) as src:
                src.map_to(meta)
                lazy = LazyModel(names, checkpoint_layers=False)
                with lazy.running(lambda name: src.read(name).float()) as model:
                    imatrix = importance_matrix(model, calibration_blocks(tok, calib_text))
        finally:
            close_anchor(names)
    steps, entry["awq"] = awq_scalings(meta, imatrix, alpha)
    return {name: functools.partial(scaled, steps=todo) for name, todo in steps.items()}, entry
