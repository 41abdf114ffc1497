"""Output-aware scale search when an anchor is lowered: which formats, the importance, the marking.

Slice-and-Scale keeps each block's exponent by a fixed rule (floor for MXINT). The search instead
picks, per block, the exponent among floor-1, floor, floor+1 whose error against the anchor's
values is lowest when each input column's squared error is weighted by that column's importance:
the mean squared input activation of the Linear on calibration text (mfqat.anchor.importance), measured
with the model in the anchor's own format (mfqat.quant.scale_search). Every block stays a legal
MX block, and in weighted squared error it is never worse than floor.

It is applied to :data:`mfqat.quant.scale_rules.SCALE_SEARCH_FORMATS` (mxint6..mxint3), where it
beat the default rule on two held-out texts (BENCHMARKS.md "Scale rules"), and to any format whose
rule the anchor records as ``search`` (trained in, e.g. mxfp4 of an ``mxfp_joint_search`` anchor:
the calibration's importance then replaces the stored one); the anchor's own format, and the other
MXFP formats, keep their rule. Used by ``load_anchor(..., calib=...)``,
``mfqat eval / convert / export-mlx --scale-search`` and the demo.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from mfqat.anchor.checkpoint import Anchor, anchor_model
from mfqat.anchor.lazy import annotate
from mfqat.formats import FORMATS, canonical_name
from mfqat.anchor.importance import importance_matrix
from mfqat.quant.scale_rules import SCALE_SEARCH_FORMATS, SEARCH_RULE

Measure = Callable[[Anchor, torch.Tensor, int], Dict[str, torch.Tensor]]  # (anchor, calib, batch) -> importance


def searchable_formats(anchor_fmt: str, recorded: Optional[Mapping[str, str]] = None) -> List[str]:
    """The formats below ``anchor_fmt`` of its family that the search serves better than their rule,
    and those whose rule in ``recorded`` (an anchor's ``scale_rules``) is the trained-in search."""
    a = FORMATS[anchor_fmt]
    trained = [n for n, r in (recorded or {}).items() if r == SEARCH_RULE and n != anchor_fmt]
    return [n for n in FORMATS if (n in SCALE_SEARCH_FORMATS or n in trained)
            and FORMATS[n].family == a.family and FORMATS[n].bits < a.bits]


def mark_scale_search(anchor: Anchor, importance: Dict[str, torch.Tensor], formats: Sequence[str]) -> int:
    """Give every quantized Linear weight its input importance and the ``search`` rule for ``formats``
    (in place, by name: a lazily read anchor gives them to each tensor it builds; Slice-and-Scale then
    searches). Returns how many tensors were marked."""
    marked = 0
    for name in list(anchor.quantized):
        imp = importance.get(name[: -len(".weight")])
        if imp is None or imp.numel() != anchor.shape(name)[-1]:
            continue  # e.g. a tied embedding: not a Linear input
        annotate(anchor.quantized, name, imp, dict.fromkeys(formats, "search"))
        marked += 1
    return marked


def held_importance(anchor: Anchor, calib: torch.Tensor, batch_size: int = 4) -> Dict[str, torch.Tensor]:
    """The importance of every nn.Linear's input channels in the anchor's own format, measured on the anchor's
    whole float32 model (on ``calib``'s device); the lazy export path measures the same module by module
    (mfqat.export.scale_search.lazy_importance)."""
    model = anchor_model(anchor, device=calib.device)
    return {k: v.cpu() for k, v in importance_matrix(model, calib, batch_size).items()}


def search_scales(anchor: Anchor, calib: torch.Tensor, formats: Union[None, str, Sequence[str]] = None,
                  batch_size: int = 4, _stacklevel: int = 2, measure: Measure = held_importance) -> dict:
    """Measure the importance on ``calib`` (token ids, blocks x seq_len, on the device to calibrate
    on) and mark the anchor so that lowering it to ``formats`` (default: every searchable format)
    searches the scales. ``measure(anchor, calib, batch_size)`` gives the importance (default: on the whole
    model, :func:`held_importance`).

    Formats the search does not serve (the anchor's own, MXFP, derived affine) keep their rule and
    a warning says so; when none of ``formats`` is searchable no calibration pass runs. Returns a
    report entry: the statistic, calibration tokens, formats searched, tensors marked.
    """
    check_calib(calib, anchor)
    can = searchable_formats(anchor.format, anchor.meta.get("scale_rules"))
    asked = None if formats is None else [canonical_name(f) for f in ([formats] if isinstance(formats, str) else formats)]
    wanted = can if asked is None else [n for n in can if n in asked]
    skipped = [] if asked is None else [n for n in asked if n not in can]
    if skipped:
        warnings.warn(f"{anchor.path}: scale search is not used for {', '.join(skipped)} (from a {anchor.format} "
                      f"anchor it measured better only for {', '.join(can) or 'no format'}); lowering with the "
                      "recorded scale rules", stacklevel=_stacklevel)
    if not wanted:
        return {"formats": [], "tensors": 0}
    importance = measure(anchor, calib, batch_size)
    return {"importance": "mean squared input activation", "calibration_tokens": calib.numel(),
            "formats": wanted, "tensors": mark_scale_search(anchor, importance, wanted)}


def check_calib(calib: torch.Tensor, anchor: Anchor) -> None:
    """``calib`` must be a non-empty (blocks, seq_len) integer tensor of ids in the anchor's vocabulary."""
    if (not isinstance(calib, torch.Tensor) or calib.dim() != 2 or calib.numel() == 0
            or calib.dtype not in (torch.int64, torch.int32)):
        what = f"{calib.dtype} {tuple(calib.shape)}" if isinstance(calib, torch.Tensor) else type(calib).__name__
        raise ValueError(f"calib: expected token ids of shape (blocks, seq_len), int64, got {what} "
                         "(mfqat.data.sources.calibration_blocks(tokenizer, text) makes them from text)")
    vocab = (anchor.config or {}).get("vocab_size")
    if vocab is not None and (int(calib.max()) >= vocab or int(calib.min()) < 0):
        raise ValueError(f"calib: token ids must lie in [0, {vocab}) for {anchor.path} (max {int(calib.max())}); "
                         "tokenize the calibration text with the anchor's own tokenizer")
