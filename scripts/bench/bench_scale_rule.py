#!/usr/bin/env python
"""Post-training perplexity of SmolLM2-135M per MX format x scale rule, direct and via Slice-and-Scale.

Every decoder-block Linear weight (what ``mfqat.prepare`` targets) is quantized and dequantized, the
rest stays full precision. Rules: ``floor`` (OCP), ``ceil``, ``mse`` (per block the exponent among
floor-1, floor, floor+1 with the lowest squared error) and ``output`` (the same, each input column's
error weighted by its mean squared input activation on calibration text: the AWQ importance,
mfqat.anchor.importance.importance_matrix). Paths: ``direct`` quantizes the fp weights; ``slice`` quantizes
them to the family's anchor (mxint8 / mxfp8_e4m3, floor) and lowers the anchor with the rule
(mfqat.quant.slice.slice_and_scale with a scale_rule; its search compares against the anchor's values). Held-out texts no
calibration uses: the pydoc held-out split and numpy's licence. Writes a JSON cache (resumable), a
Markdown table and a PNG.

    flock /tmp/heavy.lock nice python scripts/bench/bench_scale_rule.py   # ~6 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List

import torch

from mfqat.data.sources import calibration_blocks, heldout_blocks, load_model
from mfqat.formats import get_format
from mfqat.eval.perplexity import perplexity
from mfqat.eval.report import format_table
from mfqat.anchor.importance import importance_matrix
from mfqat.progress import progress
from mfqat.quant.api import quantize
from mfqat.quant.scale_search import quantize_search
from mfqat.quant.slice import slice_and_scale

FORMATS = ["mxint8", "mxint6", "mxint5", "mxint4", "mxint3", "mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"]
RULES = ["floor", "ceil", "mse", "output"]
ANCHOR = {"mxint": "mxint8", "mxfp": "mxfp8_e4m3"}


def targets(model) -> List[str]:
    """Module names of the decoder blocks' Linear layers."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def lowered(w: torch.Tensor, fmt: str, rule: str, path: str, imp: torch.Tensor) -> torch.Tensor:
    """The dequantized weight of one Linear for a (format, rule, path) point."""
    anchor_fmt = ANCHOR[get_format(fmt).family]
    if path == "slice" and fmt != anchor_fmt:
        anchor = quantize(w, anchor_fmt)
        rule_ = "search" if rule in ("mse", "output") else rule
        return slice_and_scale(anchor, fmt, rule_, imp if rule == "output" else None).dequantize(torch.float32)
    if rule in ("floor", "ceil"):
        return quantize(w, fmt, scale_rule=rule).dequantize(torch.float32)
    return quantize_search(w, fmt, importance=imp if rule == "output" else None).dequantize(torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8, help="held-out blocks of --seq-len tokens per text")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--calib-blocks", type=int, default=8, help="calibration blocks (pydoc training split)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--slice-rules", default="floor,ceil,output",
                   help="rules of the Slice-and-Scale path (add mse to search there too)")
    p.add_argument("--model", default=None, help="HF folder to measure (default: the original SmolLM2-135M), "
                                               "e.g. a run's master/ saved by mfqat train --save-master")
    p.add_argument("--out", default="out/scale_rule")
    p.add_argument("--report-only", action="store_true", help="tables and plot from the cache (a partial run)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_path = out / "scale_rule.json"
    if a.report_only:
        return report(json.loads(cache_path.read_text()), a, out)
    torch.manual_seed(0)
    model, tok = load_model(a.model)
    held = heldout_blocks(tok, a.seq_len, max_blocks=a.blocks)
    names = targets(model)
    imp = importance_matrix(model, calibration_blocks(tok, n_blocks=a.calib_blocks, seq_len=a.seq_len))
    fp = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    cache: Dict[str, dict] = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    if "fp" not in cache:
        cache["fp"] = {t: perplexity(model, b) for t, b in held.items()}
        cache["tokens"] = {t: list(b.shape) for t, b in held.items()}
    rules = {"direct": a.rules.split(","), "slice": a.slice_rules.split(",")}
    # floor/ceil first, then the searches (minutes each, fewest bits first): the cache keeps partial runs. No slice of an
    # anchor to itself, no search at 8 bits (every rule is within noise of fp there).
    order = {"floor": 0, "ceil": 0, "output": 1, "mse": 2}
    points = sorted([(f, r, path) for path in ("direct", "slice") for f in a.formats.split(",") for r in rules[path]
                     if not (f in ANCHOR.values() and (path == "slice" or r in ("mse", "output")))],
                    key=lambda p: (order.get(p[1], 3), order.get(p[1], 3) and get_format(p[0]).bits))  # low bits first
    for f, r, path in progress(points, desc="scale rules"):
        key = f"{f}|{r}|{path}"
        if key in cache:
            continue
        with torch.no_grad():
            for n in names:
                model.get_submodule(n).weight.copy_(lowered(fp[n], f, r, path, imp[n]))
        cache[key] = {t: perplexity(model, b) for t, b in held.items()}
        cache_path.write_text(json.dumps(cache, indent=2))
    with torch.no_grad():
        for n in names:
            model.get_submodule(n).weight.copy_(fp[n])
    report(cache, a, out)


def report(cache: Dict[str, dict], a, out: Path) -> None:
    """One table per text (format x rule, direct / slice) and a plot of ppl relative to floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rules = a.rules.split(",")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
    for ax, text in zip(axes, ("pydoc", "licence")):
        rows = []
        for f in a.formats.split(","):
            for path in ("direct", "slice"):
                vals = {r: cache.get(f"{f}|{r}|{path}", {}).get(text) for r in rules}
                if all(v is None for v in vals.values()):
                    continue
                best = min((v, r) for r, v in vals.items() if v is not None)[1]
                rows.append({"format": f, "path": path, **vals, "best": best})
        n, seq = cache.get("tokens", {}).get(text, ("?", "?"))
        print(f"\n{text} perplexity (fp {cache['fp'][text]:.3f}), {n} x {seq} tokens")
        print(format_table(rows, ["format", "path", *rules, "best"]))
        labels = [f"{r['format']}\n{r['path']}" for r in rows]
        for i, rule in enumerate(rules):
            rel = [(r[rule] / r["floor"] if r.get(rule) and r.get("floor") else float("nan")) for r in rows]
            width = 0.8 / len(rules)
            ax.bar([j + (i - (len(rules) - 1) / 2) * width for j in range(len(rows))], rel, width=width, label=rule)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=6, rotation=90)
        ax.set_ylabel("perplexity / floor's")
        ax.set_yscale("log")
        ax.set_title(f"SmolLM2-135M PTQ, held-out {text}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scale_rule.png")
    print(f"plot: {out / 'scale_rule.png'}")


if __name__ == "__main__":
    main()
