#!/usr/bin/env python
"""Can the ``auto:`` sensitivity pass screen tensors on fewer tokens and keep its plans? (issue 34)

    python scripts/studies/bench_auto_screening.py [--anchor DIR] [--family affine] [--budgets 3.8,4.2,4.7]
                                           [--spreads 1.1,1.25,1.5,2] [--every 10]

The pass ``export-mlx`` runs (mfqat.export.sensitivity.measure, replayed) scores every tensor by the KL of
its probe over all calibration tokens (4 x 128). A cheaper pass would score every tensor on a subset of
the tokens (the *screen*), then re-score exactly only the tensors whose width could change. This script
measures, on one anchor, how far that gets without changing any plan:

1. every tensor's probe KL **per token** (the exact replayed pass, keeping each token's KL);
2. for several token subsets, the screened KL (the subset's mean) against the exact one: the spread of
   their ratio around its median (a common factor does not change a plan), and how many tensors'
   widths change at each budget when the screened KLs plan alone;
3. screening followed by exact re-scoring, simulated from the stored per-token KLs: a tensor is
   re-scored when one of its width boundaries (the KL saved per extra bit between two adjacent widths)
   lies, within a factor ``spread`` of its screened KL, inside the range of boundaries the current plan
   sits between; the screened KLs are put on the exact scale by the median ratio of the tensors
   re-scored so far; repeated until no tensor is added. Reported: tensors re-scored, plan changes
   against the exact plans, and the pass time this would take;
4. the time of one probe on each subset, on a sample of tensors (``--every``), against a full probe and
   against the plain pass's full forward, to turn (3) into seconds.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Dict, List

import torch

from mfqat.anchor.checkpoint import read_anchor
from mfqat.anchor.load import load_anchor
from mfqat.eval.report import format_table
from mfqat.export.recipes import _matrix_weights
from mfqat.export.replay import LayerReplay, start_layers
from mfqat.export.sensitivity import (TensorSensitivity, allocate, anchor_values, calibration_blocks, in_format,
                                      ladder, level_bits, level_group, probe_for)
from mfqat.progress import progress
from mfqat.quant.derive import is_derived

SUBSETS = {  # name: (which blocks, which positions of each): a forward runs those blocks up to the last position
    "first block (128 tokens)": (slice(0, 1), slice(0, 128)),
    "first 2 blocks (256)": (slice(0, 2), slice(0, 128)),
    "first 32 positions of each block (128)": (slice(0, 4), slice(0, 32)),
    "first 64 positions of each block (256)": (slice(0, 4), slice(0, 64)),
}


class Prober:
    """Per-token KLs of one-tensor probes against the anchor-format model, replayed from the tensor's layer."""

    def __init__(self, anchor, names: List[str], probe: str, blocks: torch.Tensor, levels: List[str]):
        self.anchor, self.probe, self.blocks, self.levels = anchor, probe, blocks, levels
        self.model = load_anchor(anchor.path)
        self.params = dict(self.model.named_parameters(remove_duplicate=False))
        self.start = start_layers(self.model, names)
        self.replays = {}

    def _reference(self, ids: torch.Tensor):
        key = tuple(ids.shape)
        if key not in self.replays:
            replay = LayerReplay(self.model)
            with torch.no_grad():
                ref = torch.log_softmax(replay.record(input_ids=ids).float(), dim=-1)
            self.replays[key] = (replay, ref, ref.exp())
        return self.replays[key]

    def errors_and_probe(self, name: str):
        original = self.params[name].data
        norm = original.float().pow(2).sum().item() or 1.0
        values = anchor_values(self.anchor, name) if any(is_derived(f) for f in self.levels) else None
        errors, probe_w = {}, None
        for f in self.levels:
            w = in_format(self.anchor, name, f, values=values).dequantize(torch.float32)
            errors[f] = (w - original.float()).pow(2).sum().item() / norm
            if f == self.probe:
                probe_w = w
        return errors, probe_w

    def per_token(self, name: str, probe_w: torch.Tensor, ids: torch.Tensor, replayed: bool = True) -> torch.Tensor:
        replay, ref, p_ref = self._reference(ids)
        param = self.params[name]
        original = param.data.clone()
        param.data.copy_(probe_w.to(param.dtype))
        try:
            with torch.no_grad():
                logits = (replay.logits_from(self.start[name], input_ids=ids) if replayed
                          else self.model(input_ids=ids).logits)
                low = torch.log_softmax(logits.float(), dim=-1)
        finally:
            param.data.copy_(original)
        return (p_ref * (ref - low)).sum(-1)


def slopes(s: TensorSensitivity, levels: List[str], bpw: Dict[str, float]) -> List[float]:
    """KL saved per extra stored bit between adjacent widths (the boundaries of the tensor's choice)."""
    return [(s.at(levels[i]) - s.at(levels[i + 1])) / ((bpw[levels[i + 1]] - bpw[levels[i]]) * s.numel)
            for i in range(len(levels) - 1)]


def screen_then_rescore(exact: torch.Tensor, screened: torch.Tensor, make, levels, budgets, group, spread: float):
    """(tensors re-scored, {budget: plan}) of the screen-then-rescore pass, simulated (see the docstring)."""
    bpw = level_bits(levels, group)
    done: set = set()
    while True:
        g = statistics.median([float(exact[i] / screened[i]) for i in done]) if done else 1.0
        sens = make([float(exact[i]) if i in done else g * float(screened[i]) for i in range(len(exact))])
        names = list(sens)
        plans, new = {}, set()
        for b in budgets:
            plan = plans[b] = allocate(sens, levels, b, group)
            lo_b, hi_b = 0.0, math.inf
            for n, s in sens.items():
                k, sl = levels.index(plan[n]), slopes(s, levels, bpw)
                if k < len(sl):
                    lo_b = max(lo_b, sl[k])  # the best upgrade not taken
                if k > 0:
                    hi_b = min(hi_b, sl[k - 1])  # the weakest upgrade taken
            lo, hi = min(lo_b, hi_b), max(lo_b, hi_b)
            new |= {i for i, n in enumerate(names) if i not in done
                    and any(lo / spread <= x <= hi * spread for x in slopes(sens[n], levels, bpw))}
        if not new:
            return done, plans
        done |= new


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", default="out/joint-affine/anchor")
    p.add_argument("--family", default="affine", help="the ladder: affine (default) or none (the anchor's)")
    p.add_argument("--budgets", default="3.8,4.2,4.7")
    p.add_argument("--spreads", default="1.1,1.25,1.5,2")
    p.add_argument("--every", type=int, default=10, help="time probes on every K-th tensor")
    a = p.parse_args()
    family = None if a.family == "none" else a.family
    anchor = read_anchor(a.anchor)
    budgets = [float(b) for b in a.budgets.split(",")]
    levels = ladder(anchor.format, family)
    group = level_group(anchor, levels[0])
    probe = probe_for(min(budgets), levels, group)
    names = list(anchor.quantized) + _matrix_weights(anchor)
    blocks = calibration_blocks(anchor, None)
    prober = Prober(anchor, names, probe, blocks, levels)
    print(f"{a.anchor}: {len(names)} tensors, probe {probe}, {blocks.numel()} calibration tokens {tuple(blocks.shape)}")

    per, errors = [], []
    for name in progress(names, desc=f"per-token KLs (probe {probe})"):
        err, w = prober.errors_and_probe(name)
        errors.append(err)
        per.append(prober.per_token(name, w, blocks).double())
    per_t = torch.stack(per)  # [tensors, blocks, positions]
    exact = per_t.flatten(1).mean(1)
    numel = [prober.params[n].numel() for n in names]

    def make(values):
        return {n: TensorSensitivity(n, numel[i], probe, max(v, 0.0), errors[i]) for i, (n, v) in enumerate(zip(names, values))}

    exact_plans = {b: allocate(make(exact.tolist()), levels, b, group) for b in budgets}

    sample = names[::a.every]
    times: Dict[str, float] = {"plain: full forward": 0.0, "replayed, all tokens": 0.0}
    for name in progress(sample, desc="timing probes"):
        _, w = prober.errors_and_probe(name)
        for label, ids, replayed in [("plain: full forward", blocks, False), ("replayed, all tokens", blocks, True)] + [
                (k, blocks[b, s], True) for k, (b, s) in SUBSETS.items()]:
            prober._reference(ids)
            t = time.perf_counter()
            prober.per_token(name, w, ids, replayed)
            times[label] = times.get(label, 0.0) + time.perf_counter() - t
    full_cost = times["replayed, all tokens"]

    rows, cert_rows = [], []
    for label, (b, s) in SUBSETS.items():
        screened = per_t[:, b, s].flatten(1).mean(1)
        ratio = screened / exact
        dev = (ratio / ratio.median()).log().abs()
        changed = [sum(allocate(make(screened.tolist()), levels, bud, group)[n] != exact_plans[bud][n] for n in names)
                   for bud in budgets]
        cost = times[label] / full_cost
        rows.append({"screen": label, "probe time x full": f"{cost:.2f}",
                     "|log ratio| median / 90% / max": f"{dev.median():.3f} / {dev.quantile(0.9):.3f} / {dev.max():.3f}",
                     "plan changes " + "/".join(map(str, budgets)): "/".join(map(str, changed))})
        for spread in [float(x) for x in a.spreads.split(",")]:
            done, plans = screen_then_rescore(exact, screened, make, levels, budgets, group, spread)
            diff = [sum(plans[bud][n] != exact_plans[bud][n] for n in names) for bud in budgets]
            pass_cost = cost + len(done) / len(names)
            cert_rows.append({"screen": label, "spread": spread, "re-scored": f"{len(done)} ({len(done) / len(names):.0%})",
                              "plan changes": "/".join(map(str, diff)),
                              "x replayed pass": f"{1 / pass_cost:.2f}",
                              "x plain pass": f"{times['plain: full forward'] / full_cost / pass_cost:.2f}"})
    print(f"\nprobe times on {len(sample)} tensors: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    print("\nScreened KLs alone (ratio to the exact KL, around its median):")
    print(format_table(rows, list(rows[0])))
    print("\nScreen, then re-score exactly the tensors near a width boundary:")
    print(format_table(cert_rows, list(cert_rows[0])))


if __name__ == "__main__":
    main()
