"""``export-mlx --scale-search``: output-aware per-block scale choice when an anchor is lowered.

Measures the importance of every quantized Linear's input channels (mean squared input activation
on calibration text, the same statistic ``--awq`` uses: mfqat.export.awq.importance_matrix) with
the anchor model in its own format, and marks each anchor tensor so that Slice-and-Scale to a lower
format picks each block's exponent among floor-1, floor, floor+1 by the importance-weighted squared
error against the anchor's values (mfqat.quant.scale_search). Only the formats where this measured
better than the default rule on both held-out texts are searched
(:data:`mfqat.quant.scale_rules.SCALE_SEARCH_FORMATS`: mxint6..mxint3); others, and the anchor's own
format, keep their rule. Every consumer of the plan (the writer, the PyTorch reference, the verification,
auto:BPW's sensitivities) lowers through ``slice_and_scale``, so they all see the same blocks.
Reference (pure PyTorch) speed: about a minute per format for a 135M-parameter model on 2 cores.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..anchor import Anchor, load_anchor
from ..formats import FORMATS
from ..quant.scale_rules import SCALE_SEARCH_FORMATS
from .awq import importance_matrix


def apply_scale_search(anchor: Anchor, tokenizer_dir: Path, calib_text: Optional[str] = None,
                       n_blocks: int = 8, seq_len: int = 128) -> dict:
    """Attach importance and the ``search`` rule to every anchor tensor (in place); returns a report entry."""
    from transformers import AutoTokenizer

    from ..data import calibration_blocks

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    a = FORMATS[anchor.format]
    lower = [n for n in SCALE_SEARCH_FORMATS if FORMATS[n].family == a.family and FORMATS[n].bits < a.bits]
    if not lower:
        return {"formats": [], "tensors": 0}
    model = load_anchor(anchor.path)
    importance = importance_matrix(model, calibration_blocks(tok, calib_text, n_blocks=n_blocks, seq_len=seq_len))
    marked = 0
    for name, q in anchor.quantized.items():
        imp = importance.get(name[: -len(".weight")])
        if imp is None or imp.numel() != q.shape[-1]:
            continue  # e.g. a tied embedding: not a Linear input
        q.importance = imp
        q.slice_rules = {**(q.slice_rules or {}), **dict.fromkeys(lower, "search")}
        marked += 1
    return {"importance": "mean squared input activation", "calibration_tokens": n_blocks * seq_len,
            "formats": lower, "tensors": marked}
