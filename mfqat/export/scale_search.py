"""``export-mlx --scale-search``: output-aware per-block scale choice when an anchor is lowered.

Tokenizes the calibration text and marks the anchor (mfqat.anchor.search: the importance of every
quantized Linear's input channels, then per block the exponent among floor-1, floor, floor+1 with
the lowest importance-weighted squared error, for mxint6..mxint3 only). Every consumer of the plan
(the writer, the PyTorch reference, the verification, auto:BPW's sensitivities) lowers through
``slice_and_scale``, so they all see the same blocks.
Reference (pure PyTorch) speed: about a minute per format for a 135M-parameter model on 2 cores.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from mfqat.anchor.checkpoint import Anchor
from mfqat.anchor.search import search_scales


def apply_scale_search(anchor: Anchor, tokenizer_dir: Path, calib_text: Optional[str] = None,
                       n_blocks: int = 8, seq_len: int = 128) -> dict:
    """Attach importance and the ``search`` rule to every anchor tensor (in place); returns a report entry."""
    from transformers import AutoTokenizer

    from mfqat.data.sources import calibration_blocks

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    return search_scales(anchor, calibration_blocks(tok, calib_text, n_blocks=n_blocks, seq_len=seq_len))
