#!/usr/bin/env python
"""auto:BPW vs uniform formats at similar size, on one anchor, perplexity in PyTorch (fast; the MLX
export of the same plan is bit-exact, see bench_export.py).

    python scripts/bench_auto.py [--anchor DIR] [--budgets 4.5,5.0] [--blocks 8]

The sensitivities are measured once (probe mxint3) and allocated for every budget.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.sources import load_text, split_text, token_blocks
from mfqat.eval.perplexity import perplexity
from mfqat.eval.report import format_table
from mfqat.export.mlx_export import reference_state
from mfqat.export.recipes import Plan, _matrix_weights, build_plan
from mfqat.export.sensitivity import allocate, calibration_blocks, ladder, measure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", default="out/bench_export/ptq-anchor")
    p.add_argument("--budgets", default="4.5,5.0")
    p.add_argument("--uniform", default="mxint4,mxint5,mxint6")
    p.add_argument("--blocks", type=int, default=8)
    a = p.parse_args()
    anchor = read_anchor(Path(a.anchor))
    model = mfqat.load_anchor(a.anchor)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.anchor)
    held = token_blocks(tok, split_text(load_text(None))[1], 128, max_blocks=a.blocks)
    names = list(anchor.quantized) + _matrix_weights(anchor)
    sens = measure(anchor, names, "mxint3", calibration_blocks(anchor, None))
    rows = []
    for recipe in [f"uniform:{f}" for f in a.uniform.split(",")]:
        plan = build_plan(anchor, recipe)
        model.load_state_dict(reference_state(anchor, plan), strict=False)
        rows.append({"plan": recipe, "bits/weight": plan.bits_per_weight(anchor), "ppl": perplexity(model, held)})
    for budget in [float(b) for b in a.budgets.split(",")]:
        plan = Plan()
        for name, fmt in allocate(sens, ladder(anchor.format), budget).items():
            plan.formats[name], plan.origin[name] = fmt, "anchor" if name in anchor.quantized else "ptq"
        model.load_state_dict(reference_state(anchor, plan), strict=False)
        counts = {}
        for f in plan.formats.values():
            counts[f] = counts.get(f, 0) + 1
        rows.append({"plan": f"auto:{budget} {dict(sorted(counts.items()))}", "bits/weight": plan.bits_per_weight(anchor),
                     "ppl": perplexity(model, held)})
    print(f"anchor={a.anchor} held-out tokens={held.numel()}")
    print(format_table(rows, ["plan", "bits/weight", "ppl"]))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
