"""Elastic evaluation: one model, many formats, by Slice-and-Scale from an anchor or by PTQ."""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
from torch import nn

from mfqat.anchor.checkpoint import Anchor
from mfqat.anchor.tensors import default_targets
from mfqat.formats import get_format, known_formats
from mfqat.quant.api import quantize
from mfqat.quant.scale_rules import DEFAULT_SCALE_RULE
from mfqat.eval.perplexity import perplexity


def ptq_state(model: nn.Module, fmt: str, block_size: int = 32, targets: Optional[List[str]] = None,
              scale_rule: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Direct (post-training) quantization of the model's target weights to ``fmt``. ``scale_rule``:
    the MX scale rule; default the format's measured rule (:data:`mfqat.quant.scale_rules.
    DEFAULT_SCALE_RULE`: ceil for mxfp4, floor elsewhere), which a single-format QAT model of ``fmt``
    also trains with and an anchor slices with."""
    sd = model.state_dict()
    names = targets or default_targets(model, block_size)
    return {k: ptq_value(sd[k], fmt, block_size, scale_rule) for k in names}


def ptq_value(value: torch.Tensor, fmt: str, block_size: int = 32, scale_rule: Optional[str] = None) -> torch.Tensor:
    """One weight quantized directly to ``fmt`` and dequantized to its own dtype (:func:`ptq_state`'s rule)."""
    if scale_rule is None:
        scale_rule = DEFAULT_SCALE_RULE.get(get_format(fmt).name, "floor") if get_format(fmt).is_mx else "floor"
    return quantize(value.float(), fmt, block_size, scale_rule).dequantize(value.dtype)


def evaluate_ptq(model: nn.Module, formats: List[str], blocks: torch.Tensor, block_size: int = 32,
                 batch_size: int = 4, scale_rule: Optional[str] = None) -> List[dict]:
    """:func:`evaluate_formats` of each format's :func:`ptq_state`, the same rows, with one format's weights in the
    model at a time: each target is quantized in place from a copy of its original taken once (restored at the
    end), so the memory is the model and that copy, not one state dict per format beside them."""
    params = {k: model.get_parameter(k) for k in default_targets(model, block_size)}
    original = {k: p.detach().clone() for k, p in params.items()}
    rows = []
    try:
        for fmt in formats:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(ptq_value(original[k], fmt, block_size, scale_rule))
            rows.append({"format": fmt, "bits/weight": get_format(fmt).bits_per_weight(block_size),
                         "perplexity": perplexity(model, blocks, batch_size, desc=f"ppl {fmt}")})
    finally:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(original[k])
    return rows


def anchor_state(anchor: Anchor, fmt: Optional[str], dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """The anchor's whole state in ``fmt``: its quantized weights by Slice-and-Scale, dequantized, and
    its plain tensors (embeddings, norms: trained along with the rest), so a model of the same
    architecture with it loaded computes what ``load_anchor(anchor, fmt)`` does."""
    return anchor.state_dict(fmt, dtype)


def evaluate_anchor_formats(model: nn.Module, anchor: Anchor, formats: List[str], blocks: torch.Tensor,
                            block_size: int = 32, batch_size: int = 4) -> List[dict]:
    """Perplexity of ``model`` (the anchor's architecture, holding its own format) with the anchor in each of
    ``formats`` loaded in place tensor by tensor (:func:`mfqat.anchor.checkpoint.load_format`: one tensor in
    memory at a time, however large the model); the anchor's own format is loaded back at the end."""
    from mfqat.anchor.checkpoint import load_format

    rows = []
    for fmt in formats:
        load_format(model, anchor, fmt, plain=False)
        rows.append({"format": fmt, "bits/weight": get_format(fmt).bits_per_weight(block_size),
                     "perplexity": perplexity(model, blocks, batch_size, desc=f"ppl {fmt}")})
    load_format(model, anchor, None, plain=False)
    return rows


def evaluate_formats(model: nn.Module, states: Dict[str, Dict[str, torch.Tensor]], blocks: torch.Tensor,
                     block_size: int = 32, batch_size: int = 4) -> List[dict]:
    """Perplexity of ``model`` with each partial state dict loaded; rows with bits/weight. Refuses,
    before loading anything, a state with tensors the model lacks."""
    own = model.state_dict()
    for fmt, state in states.items():
        foreign = [k for k in state if k not in own]
        if foreign:
            raise ValueError(f"{fmt}: {len(foreign)} tensors do not belong to this model (e.g. {foreign[0]}); "
                             "evaluate an anchor in a model of the architecture it was saved from")
    original = {k: v.clone() for k, v in own.items() if any(k in s for s in states.values())}
    rows = []
    for fmt, state in states.items():
        model.load_state_dict(state, strict=False)
        bpw = (16.0 if fmt == "fp" else get_format(fmt).bits_per_weight(block_size) if fmt in known_formats()
               else float("nan"))
        rows.append({"format": fmt, "bits/weight": bpw, "perplexity": perplexity(model, blocks, batch_size, desc=f"ppl {fmt}")})
    model.load_state_dict(original, strict=False)
    return rows
