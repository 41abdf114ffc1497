#!/usr/bin/env python
"""Affine scales learned with the weights (``--learn-scales``) against learned after training (``mfqat refine``),
on two runs of the same protocol that differ only in ``--learn-scales``: PyTorch perplexity of each affine width
on the pydoc held-out split and numpy's licence text (8 x 128 tokens each, the blocks of
scripts/studies/bench_refine_anchor.py), in one run.

    python scripts/studies/bench_learned_scales.py --plain out/joint-affine/anchor --learned out/joint-affine-lsq/anchor

Rows per width: the plain run's derived widths; the plain run + ``mfqat refine`` (KL to its anchor on the
pydoc training split, ``--refine-steps``); the learned run's derived widths (its weights alone); the learned
run's stored widths (what it trained, what its export ships); the learned run + ``mfqat refine`` (which
relearns from its derived values). The anchors are copied to --work before refine writes into them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", required=True, help="anchor of the run without --learn-scales")
    p.add_argument("--learned", required=True, help="anchor of the same run with --learn-scales")
    p.add_argument("--formats", default="affine4,affine3")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--refine-steps", type=int, default=32, help="0: skip the refine rows")
    p.add_argument("--work", default="runs/bench_learned_scales")
    a = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from mfqat.anchor.checkpoint import anchor_model, read_anchor
    from mfqat.data.sources import heldout_blocks
    from mfqat.eval.perplexity import perplexity
    from mfqat.eval.report import format_table
    from mfqat.export.refine import RefineConfig, refine_anchor

    work = Path(a.work)
    copies = {}
    for name, src in (("plain", a.plain), ("learned", a.learned)):
        copies[name] = work / name
        if copies[name].exists():
            shutil.rmtree(copies[name])
        shutil.copytree(src, copies[name])
    tok = AutoTokenizer.from_pretrained(str(copies["plain"]))
    held = heldout_blocks(tok, 128, max_blocks=8)
    fmts = [f for f in a.formats.split(",") if f]

    def ppl(path: Path, fmt: str, stored: bool) -> dict:
        anchor = read_anchor(path)
        if not stored:
            anchor.learned_scales = {}
        model = anchor_model(anchor, fmt, "cpu", torch.float32, a.group_size)
        return {t: perplexity(model, b) for t, b in held.items()}

    rows = []
    for fmt in fmts:
        rows.append({"width": fmt, "model": "plain run, derived", **ppl(copies["plain"], fmt, False)})
        rows.append({"width": fmt, "model": "learned run, derived (weights only)", **ppl(copies["learned"], fmt, False)})
        rows.append({"width": fmt, "model": "learned run, stored (trained scales)", **ppl(copies["learned"], fmt, True)})
    seconds = {}
    if a.refine_steps:
        for name in ("plain", "learned"):
            t0 = time.perf_counter()
            refine_anchor(copies[name], fmts, a.group_size, None, RefineConfig(steps=a.refine_steps), overwrite=True)
            seconds[name] = time.perf_counter() - t0
            for fmt in fmts:
                rows.append({"width": fmt, "model": f"{name} run + mfqat refine {a.refine_steps}",
                             **ppl(copies[name], fmt, True)})
    rows.sort(key=lambda r: fmts.index(r["width"]))
    print(format_table(rows, ["width", "model", "pydoc", "licence"]))
    print(f"group {a.group_size}; refine seconds: {seconds}")
    (work / "results.json").write_text(json.dumps({"rows": rows, "refine_seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
