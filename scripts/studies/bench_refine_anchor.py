#!/usr/bin/env python
"""Learned affine widths stored in the anchor (``mfqat refine``) against the derived ones, on one anchor:
PyTorch perplexity of ``load_anchor(anchor, fmt)`` on the pydoc held-out split and numpy's licence text
(8 x 128 tokens each, the texts and blocks of scripts/bench/bench_pareto.py), before and after, in one run.

    nice python scripts/studies/bench_refine_anchor.py --anchor out/joint-affine/anchor --formats affine4,affine3 --steps 32

The anchor is copied to --work first (refine changes the anchor it is given); calibration: the pydoc
training split (refine's default), which neither scored text overlaps.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", required=True)
    p.add_argument("--formats", default="affine4,affine3")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--work", default="runs/bench_refine_anchor")
    a = p.parse_args()

    import mfqat
    from transformers import AutoTokenizer

    from mfqat.data.sources import heldout_blocks
    from mfqat.eval.perplexity import perplexity
    from mfqat.eval.report import format_table
    from mfqat.export.refine import RefineConfig, refine_anchor

    work = Path(a.work) / "anchor"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(a.anchor, work)
    tok = AutoTokenizer.from_pretrained(str(work))
    held = heldout_blocks(tok, 128, max_blocks=8)
    fmts = [f for f in a.formats.split(",") if f]

    def ppl() -> dict:
        out = {}
        for f in fmts:
            model = mfqat.load_anchor(work, f, group_size=a.group_size)
            out[f] = {t: perplexity(model, b) for t, b in held.items()}
        return out

    before = ppl()
    t0 = time.perf_counter()
    rows = refine_anchor(work, fmts, a.group_size, None, RefineConfig(steps=a.steps))
    seconds = time.perf_counter() - t0
    after = ppl()
    table = [{"width": f, "stored": r["stored"], "KL before": r["validation_kl_before"], "KL after": r["validation_kl_after"],
              "pydoc derived": before[f]["pydoc"], "pydoc stored": after[f]["pydoc"],
              "licence derived": before[f]["licence"], "licence stored": after[f]["licence"]}
             for f, r in zip(fmts, rows)]
    print(format_table(table, list(table[0])))
    print(f"refine: {a.steps} steps per width, group {a.group_size}, {seconds:.0f} s for {len(fmts)} widths")
    (Path(a.work) / "results.json").write_text(json.dumps({"before": before, "after": after, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
