#!/usr/bin/env python
"""auto:BPW vs uniform formats at similar size, on one anchor, perplexity in PyTorch (fast; the MLX
export of the same plan is bit-exact, see bench_export.py), after timing the sensitivity pass.

    python scripts/bench/bench_auto.py [--anchor DIR] [--budgets 4.5,5.0] [--blocks 8] [--family affine]
                                 [--sensitivity-only] [--every K]

The sensitivities are measured once (the probe of the lowest budget, as ``auto:BPW`` picks it, or
``--probe``) and allocated for every budget. They are measured twice, side by side: the plain pass
(one full forward per tensor) and the replayed pass ``export-mlx`` runs (each probe computes only
the layers from its tensor's own on, mfqat.export.replay); the table gives both times, the largest
KL difference and whether every budget's plan is the same. ``--sensitivity-only`` stops there.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.sources import load_text, split_text, token_blocks
from mfqat.eval.perplexity import perplexity
from mfqat.eval.report import format_table
from mfqat.export.mlx_export import reference_state
from mfqat.export.recipes import Plan, _matrix_weights, build_plan
from mfqat.export.sensitivity import allocate, calibration_blocks, ladder, level_group, measure, probe_for


def timed_passes(anchor, names, probe, blocks, levels, budgets, group) -> tuple:
    """(replayed sensitivities, table rows): the plain and the replayed pass, timed side by side."""
    def timed(replay: bool):
        t, c = time.perf_counter(), time.process_time()
        sens = measure(anchor, names, probe, blocks, levels, replay=replay)
        return sens, time.perf_counter() - t, time.process_time() - c

    measure(anchor, names[:1], probe, blocks, levels, replay=False)  # warm-up: first-call costs hit neither pass
    plain, t_plain, c_plain = timed(False)
    fast, t_fast, c_fast = timed(True)
    diff = max(abs(fast[n].probe_kl - plain[n].probe_kl) for n in names)
    same = all(allocate(plain, levels, b, group) == allocate(fast, levels, b, group) for b in budgets)
    rows = [{"pass": "plain (full forward per tensor)", "seconds": t_plain, "cpu seconds": c_plain, "x plain": 1.0,
             "max |dKL|": "", "same plans": ""},
            {"pass": "replayed (from the tensor's layer on)", "seconds": t_fast, "cpu seconds": c_fast,
             "x plain": t_plain / t_fast,
             "max |dKL|": f"{diff:.1e}", "same plans": "yes" if same else "NO"}]
    return fast, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", default="out/bench_export/ptq-anchor")
    p.add_argument("--budgets", default="4.5,5.0")
    p.add_argument("--uniform", default="mxint4,mxint5,mxint6")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--family", default=None, help="the ladder: the anchor's family (default) or affine")
    p.add_argument("--probe", default=None, help="probe format (default: auto:BPW's for the lowest budget)")
    p.add_argument("--sensitivity-only", action="store_true", help="time the two passes, skip perplexity")
    p.add_argument("--every", type=int, default=1,
                   help="time the passes on every K-th tensor only (spread over all layers; plans then cover those)")
    a = p.parse_args()
    anchor = read_anchor(Path(a.anchor))
    budgets = sorted(float(b) for b in a.budgets.split(","))
    levels = ladder(anchor.format, a.family)
    group = level_group(anchor, levels[0])
    probe = a.probe or probe_for(budgets[0], levels, group)
    names = list(anchor.quantized) + _matrix_weights(anchor)
    blocks = calibration_blocks(anchor, None)
    sens, rows = timed_passes(anchor, names[::a.every], probe, blocks, levels, budgets, group)
    print(f"sensitivity pass: anchor={a.anchor} probe={probe} tensors={len(names[::a.every])} of {len(names)} calibration tokens="
          f"{blocks.numel()} threads={torch.get_num_threads()} budgets={budgets}")
    print(format_table(rows, ["pass", "seconds", "cpu seconds", "x plain", "max |dKL|", "same plans"]))
    if a.sensitivity_only or a.every > 1:
        return
    model = mfqat.load_anchor(a.anchor)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.anchor)
    held = token_blocks(tok, split_text(load_text(None))[1], 128, max_blocks=a.blocks)
    rows = []
    for recipe in [f"uniform:{f}" for f in a.uniform.split(",")]:
        plan = build_plan(anchor, recipe)
        model.load_state_dict(reference_state(anchor, plan), strict=False)
        rows.append({"plan": recipe, "bits/weight": plan.bits_per_weight(anchor), "ppl": perplexity(model, held)})
    for budget in budgets:
        plan = Plan()
        for name, fmt in allocate(sens, levels, budget, group).items():
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
