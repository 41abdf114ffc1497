"""What an anchor stores from a model: which weights are quantized, their codes, and what stays aside.

``save_anchor`` (mfqat.anchor.checkpoint) quantizes the targets (:func:`quantize_targets`), names the matrices it
keeps in full precision (:func:`full_precision`) and, for a ``search`` scale rule, stores the input
importance training recorded (:func:`recorded_importance`).
"""
from __future__ import annotations

import warnings
from typing import Dict, List

import torch
from torch import nn

from mfqat.models import family_of, in_decoder_block
from mfqat.qat.prepare import qat_modules
from mfqat.quant.api import quantize
from mfqat.quant.scale_rules import SEARCH_RULE


def default_targets(model: nn.Module, block_size: int) -> List[str]:
    """PTQ targets for a plain model: decoder-block Linear weights whose rows divide into blocks (not
    those the model's family keeps in high precision, nor a vision tower's), and the fused 3-D expert
    parameters its family quantizes (mfqat.models)."""
    family = family_of(model)
    linears = [f"{n}.weight" for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and in_decoder_block(n) and m.in_features % block_size == 0
               and not family.kept_high(f"{n}.weight") and not family.tower(n)]
    fused = [n for n, p in model.named_parameters() if p.dim() == 3 and in_decoder_block(n)
             and family.expert_param(n) is not None and p.shape[-1] % block_size == 0 and not family.tower(n)]
    return linears + fused


def unblockable(model: nn.Module, block_size: int) -> Dict[str, str]:
    """{weight: reason} for decoder-block Linear weights whose in_features is not a whole number of blocks."""
    family = family_of(model)
    return {f"{n}.weight": f"in_features {m.in_features} not a multiple of {block_size}"
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and in_decoder_block(n) and m.in_features % block_size and not family.tower(n)}


def quantize_targets(sd: Dict[str, torch.Tensor], targets: List[str], f, block_size: int, scale_rule: str
                     ) -> tuple[Dict[str, torch.Tensor], Dict[str, dict]]:
    """(tensors to write, mfqat.json entries): targets as codes + scales, the rest as they are."""
    tensors: Dict[str, torch.Tensor] = {}
    entries: Dict[str, dict] = {}
    for k, v in sd.items():
        if k in targets:
            if not torch.isfinite(v).all():
                raise ValueError(f"{k}: the weight holds NaN or Inf values; refusing to save an anchor of it")
            q = quantize(v.float(), f, block_size, scale_rule)
            tensors[f"{k}.codes"], tensors[f"{k}.scales"] = q.pack(), q.scales
            entries[k] = {"format": f.name, "shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
        else:
            tensors[k] = v
    return tensors, entries


def recorded_importance(model: nn.Module, entries: Dict[str, dict], rules: Dict[str, str]) -> Dict[str, torch.Tensor]:
    """{weight name: importance} that training recorded for the ``search`` rule (none without it)."""
    if SEARCH_RULE not in rules.values():
        return {}
    found = {f"{n}.weight": m.importance() for n, m in qat_modules(model) if hasattr(m, "importance")}
    return {k: v.detach().cpu() for k, v in found.items() if v is not None and k in entries}


def full_precision(model: nn.Module, sd: Dict[str, torch.Tensor], entries: Dict[str, dict], block_size: int
                   ) -> Dict[str, str]:
    """{matrix kept in full precision: why} (its width, its family's reason, or "not a target");
    warns naming layers left out for their width."""
    odd = unblockable(model, block_size)
    family = family_of(model)
    fp = {k: odd.get(k) or family.kept_high(k) or family.tower(k) or "not a target" for k, v in sd.items()
          if k not in entries and v.is_floating_point() and v.dim() >= 2}
    skipped = [f"{k} ({r})" for k, r in fp.items() if k in odd]
    if skipped:
        warnings.warn("mfqat.save_anchor kept layers full precision: " + ", ".join(skipped), stacklevel=3)
    return fp
