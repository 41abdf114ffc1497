"""``export-mlx --scale-search``: output-aware per-block scale choice when an anchor is lowered.

Tokenizes the calibration text and marks the anchor (mfqat.anchor.search: the importance of every
quantized Linear's input channels, then per block the exponent among floor-1, floor, floor+1 with
the lowest importance-weighted squared error, for mxint6..mxint3 only). Every consumer of the plan
(the writer, the PyTorch reference, the verification, auto:BPW's sensitivities) lowers through
``slice_and_scale``, so they all see the same blocks.
The importance is measured module by module (:func:`lazy_importance`: the anchor's model on the meta device,
each module's weights read from the anchor as it runs), and the marks are kept by name on the lazily read
anchor, so a searched export holds one tensor at a time like any other.
Reference (pure PyTorch) speed: about a minute per format for a 135M-parameter model on 2 cores.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch

from mfqat.anchor.checkpoint import Anchor
from mfqat.anchor.importance import importance_matrix
from mfqat.anchor.search import search_scales


def apply_scale_search(anchor: Anchor, tokenizer_dir: Path, calib_text: Optional[str] = None,
                       n_blocks: int = 8, seq_len: int = 128, imatrix_path: Optional[str] = None) -> dict:
    """Attach importance and the ``search`` rule to every anchor tensor (in place); returns a report entry.
    ``imatrix_path``: the importance read from a llama.cpp imatrix GGUF (:func:`imatrix_search`) instead of
    measured on the calibration text."""
    if imatrix_path is not None:
        return imatrix_search(anchor, imatrix_path)
    from transformers import AutoTokenizer

    from mfqat.data.sources import calibration_blocks

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return search_scales(anchor, calibration_blocks(tok, calib_text, n_blocks=n_blocks, seq_len=seq_len),
                         measure=lazy_importance)


def lazy_importance(anchor: Anchor, calib: torch.Tensor, batch_size: int = 4) -> Dict[str, torch.Tensor]:
    """The importance :func:`mfqat.anchor.search.held_importance` measures (every nn.Linear's mean squared input
    in the anchor's own format, float32), with the model run module by module on the CPU
    (mfqat.export.lazy_model): one module's weights in memory at a time, the same values bit for bit."""
    from mfqat.export.lazy_model import LazyModel, anchor_source

    lazy = LazyModel(anchor, checkpoint_layers=False)
    with lazy.running(anchor_source(anchor)) as model:
        return importance_matrix(model, calib.cpu(), batch_size)


def imatrix_search(anchor: Anchor, imatrix_path: str) -> dict:
    """``export-mlx --imatrix-path`` on an anchor: each quantized Linear's input importance is the imatrix's mean
    squared activation (``in_sum2 / counts``, the quantity the search measures on calibration text), so the
    formats the search serves (mxint6..mxint3) pick each block's exponent by the imatrix-weighted error, as
    llama.cpp weighs its quantization error. Fused experts keep their rule (no per-expert importance)."""
    from mfqat.anchor.search import mark_scale_search, searchable_formats
    from mfqat.export.imatrix import imatrix_for_modules

    config = anchor.config or {}
    text = config.get("text_config") or config
    shapes = {n: anchor.shape(n) for n in anchor.quantized}  # from the headers: no tensor read or quantized
    widths = {n[: -len(".weight")]: s[-1] for n, s in shapes.items() if n.endswith(".weight") and len(s) == 2}
    importance = imatrix_for_modules(imatrix_path, config.get("model_type"), int(text.get("num_hidden_layers") or 0),
                                     widths)
    formats = searchable_formats(anchor.format, anchor.meta.get("scale_rules"))
    return {"importance": f"imatrix GGUF {imatrix_path}", "formats": formats,
            "tensors": mark_scale_search(anchor, importance, formats)}


def check_imatrix_used(entry: dict, planned, imatrix_path: str, recipe: str) -> None:
    """Refuse (ValueError, before anything is written) an ``--imatrix-path`` that weighs no tensor of the plan:
    the recipe's formats are none of those the search serves (derived affine, MXFP: ``entry['formats']``)."""
    if not set(planned) & set(entry.get("formats", ())):
        raise ValueError(f"{imatrix_path}: recipe '{recipe}' plans no format the imatrix-weighted scale search serves "
                         f"({', '.join(entry.get('formats', ())) or 'none from this anchor'}); the imatrix would change "
                         "nothing: use an MXINT recipe (e.g. seed, uniform:mxint4), or --awq on a full-precision model")
