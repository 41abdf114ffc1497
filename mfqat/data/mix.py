"""Calibration text mixed from several sources with weights: ``--calib-text a.txt:2,notes/,pydoc``.

Every calibration consumer (``auto:BPW``'s sensitivity, AWQ, ``--refine``, the scale search) takes
the *first* blocks of its text, so a mix must be in proportion from its first token on. A mix is a
:class:`mfqat.data.sources.MixedText`: ``calibration_blocks`` takes whole token blocks from each source
in proportion to the weights from the first block on (4 blocks of 128 tokens, the sensitivity pass's,
are about 2,000 characters: less than one round of the character interleave below). As a plain
string, the sources are interleaved in rounds: each round takes from source ``i`` the next ``chunk *
w_i / max(w)`` characters (cut after a whitespace so that no word is split), until every source is
used up; a source that ends early simply drops out of later rounds.

``pydoc`` in a mix means the pydoc *training* split (never its held-out part, which the benchmarks
score); ``generated`` means text sampled from the model being calibrated (``model``: the command's
anchor or model; mfqat.data.generated), sized to its share of ``n_blocks`` (the most blocks a consumer of
the mix reads: ``--gptq``'s 256, say) and never less than ``mfqat.data.generated.DEFAULT_TOKENS``; a file or folder is read as ``mfqat.data.sources.load_text``
reads it. A single source without a weight is returned exactly as ``load_text`` / the default
calibration gives it.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import List, Optional, Tuple

from mfqat.data.sources import MixedText, load_text, split_text

CHUNK_CHARS = 4096  # characters per round of the heaviest source


def parse_mix(spec: str) -> List[Tuple[str, float]]:
    """``PATH[:WEIGHT],...`` -> [(path, weight)]; weights default to 1 and must be positive numbers."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        path, sep, w = part.rpartition(":")
        if not sep or not _is_number(w):
            path, w = part, "1"
        weight = float(w)
        if not weight > 0:
            raise ValueError(f"--calib-text {spec!r}: the weight of {path} must be a positive number, got {w}")
        out.append((path, weight))
    if not out:
        raise ValueError(f"--calib-text {spec!r}: no source given")
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def generated_tokens(n_blocks: Optional[int], share: float = 1.0, seq_len: int = 128) -> int:
    """How many tokens ``generated`` samples when its ``share`` of a mix must fill its part of ``n_blocks``
    blocks of ``seq_len``: one block more than that part, 10% more tokens for what decoding and re-tokenizing
    may lose, and never less than ``DEFAULT_TOKENS``."""
    from mfqat.data.generated import DEFAULT_TOKENS

    if not n_blocks:
        return DEFAULT_TOKENS
    return max(DEFAULT_TOKENS, math.ceil((math.ceil(n_blocks * share) + 1) * seq_len * 1.1))


def source_text(path: str, model: Optional[str] = None, n_tokens: Optional[int] = None) -> str:
    """One source of a mix: ``pydoc`` is its training split, ``generated`` text sampled from ``model``
    (``n_tokens``: how many; None: ``DEFAULT_TOKENS``), else a file or folder (load_text)."""
    from mfqat.data.generated import DEFAULT_TOKENS, GENERATED_SOURCE, calibration_generated_text

    if path == "pydoc":
        return split_text(load_text(None))[0]
    if path == GENERATED_SOURCE:
        if model is None:
            raise ValueError(f"--calib-text {GENERATED_SOURCE}: text sampled from the model needs the model; use it "
                             "with export-mlx, refine, convert or eval, or pass model= to mixed_text")
        return calibration_generated_text(model, n_tokens or DEFAULT_TOKENS)
    if not Path(path).exists():
        raise FileNotFoundError(f"--calib-text: {path}: no such file or folder (give files, folders, 'pydoc' or "
                                "'generated', each optionally :WEIGHT)")
    return load_text(path)


def _cut(text: str, start: int, size: int) -> int:
    """The end of the chunk of about ``size`` characters from ``start``: after the next whitespace."""
    end = start + size
    if end >= len(text):
        return len(text)
    space = next((i for i in range(end, min(len(text), end + 256)) if text[i].isspace()), end)
    return space + 1


def mixed_text(spec: str, chunk: int = CHUNK_CHARS, model: Optional[str] = None, n_blocks: Optional[int] = None) -> str:
    """The calibration text of ``spec`` (see the module docstring); ``model``: what ``generated`` samples from;
    ``n_blocks``: the most 128-token blocks a consumer will take (sizes ``generated``; None: its default)."""
    sources = parse_mix(spec)
    if len(sources) == 1 and ":" not in spec:
        path = sources[0][0]
        return load_text(path) if path not in ("pydoc", "generated") else source_text(path, model,
                                                                                      generated_tokens(n_blocks))
    total = sum(w for _, w in sources)
    texts = [source_text(p, model, generated_tokens(n_blocks, w / total)) for p, w in sources]
    top = max(w for _, w in sources)
    sizes = [max(1, int(chunk * w / top)) for _, w in sources]
    pos, parts = [0] * len(texts), []
    while any(p < len(t) for p, t in zip(pos, texts)):
        for i, text in enumerate(texts):
            if pos[i] < len(text):
                end = _cut(text, pos[i], sizes[i])
                parts.append(text[pos[i]:end])
                pos[i] = end
    return MixedText("".join(parts), [(t, w) for t, (_, w) in zip(texts, sources)])
