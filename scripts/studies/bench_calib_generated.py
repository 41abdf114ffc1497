#!/usr/bin/env python
"""Calibration text for ``auto:`` plans and ``--refine``: the training text against text the model samples
itself (issue 32).

    python scripts/studies/bench_calib_generated.py [--anchor out/joint-affine/anchor] [--recipe auto:4.7:affine]
                                            [--calib "default;pydoc:1,generated:1"] [--blocks 16]
                                            [--refine-steps 0]

For each ``--calib-text`` spec (``default``: the pydoc training split), builds the recipe's plan as
``export-mlx --recipe R --calib-text SPEC`` does (``mixed_text(spec, model=ANCHOR)``, ``build_plan``) and
prints its PyTorch perplexity (``reference_state``: bit-exact with the MLX export) on held-out pydoc
blocks and on numpy's licence text, which no calibration or training step sees. ``--refine-steps N``
also learns the plan's affine scales and biases on the same calibration text, as ``export-mlx --refine
--refine-steps N`` does (``apply_refine``), before scoring.
"""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.mix import mixed_text
from mfqat.data.sources import heldout_blocks
from mfqat.eval.perplexity import perplexity
from mfqat.eval.report import format_table
from mfqat.export.mlx_export import reference_state
from mfqat.export.recipes import build_plan
from mfqat.export.refine import RefineConfig, apply_refine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", default="out/joint-affine/anchor")
    p.add_argument("--recipe", default="auto:4.7:affine")
    p.add_argument("--calib", default="default;pydoc:1,generated:1", help="';'-separated --calib-text specs")
    p.add_argument("--blocks", type=int, default=16, help="held-out blocks of 128 tokens per text")
    p.add_argument("--refine-steps", type=int, default=0, help="also --refine with this many steps (0: no refine)")
    a = p.parse_args()
    from transformers import AutoTokenizer

    anchor = read_anchor(a.anchor)
    tok = AutoTokenizer.from_pretrained(a.anchor)
    held = heldout_blocks(tok, 128, max_blocks=a.blocks)
    model = mfqat.load_anchor(a.anchor)
    rows = []
    for spec in a.calib.split(";"):
        t = time.perf_counter()
        calib = None if spec == "default" else mixed_text(spec, model=a.anchor)
        plan = build_plan(anchor, a.recipe, calib_text=calib)
        refined = {}
        if a.refine_steps:
            with torch.enable_grad():
                r = apply_refine(anchor, plan, Path(a.anchor), calib, RefineConfig(steps=a.refine_steps))
            refined = {"refine KL before/after": f"{r['validation_kl_before']:.4f}/{r['validation_kl_after']:.4f}"
                                                 f"{'' if r['kept'] else ' (not kept)'}"}
        model.load_state_dict(reference_state(anchor, plan), strict=False)
        counts = Counter(plan.formats.values())
        rows.append({"--calib-text": spec, "bits/weight": f"{plan.bits_per_weight(anchor):.3f}",
                     **{f"{k} ppl": f"{perplexity(model, v):.3f}" for k, v in held.items()},
                     "plan": " ".join(f"{f}x{n}" for f, n in sorted(counts.items())), **refined,
                     "seconds": f"{time.perf_counter() - t:.0f}"})
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
