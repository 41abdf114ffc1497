#!/usr/bin/env python
"""Plot scripts/bench/bench_pareto.py's results: perplexity vs stored bits/weight, one panel per text,
one line per method (mlx-lm's tools dashed, mfqat's solid), from its pareto.json.

    python scripts/bench/plot_pareto.py out/pareto_learned/pareto.json docs/img/pareto_learned.png
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench_pareto import line_of

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="pareto.json written by bench_pareto.py")
    p.add_argument("png")
    p.add_argument("--texts", default="pydoc,licence")
    a = p.parse_args()
    rows = list(json.loads(Path(a.results).read_text()).values())
    texts = a.texts.split(",")
    fig, axes = plt.subplots(1, len(texts), figsize=(7 * len(texts), 5.5), squeeze=False)
    lines = defaultdict(list)
    for r in rows:
        lines[line_of(r)].append(r)
    cmap = plt.get_cmap("tab20")
    for ax, text in zip(axes[0], texts):
        for i, (name, pts) in enumerate(sorted(lines.items())):
            pts = sorted(pts, key=lambda r: r["stored bits/w"])
            ax.plot([r["stored bits/w"] for r in pts], [r[text] for r in pts], marker="o",
                    linestyle="--" if name.startswith("mlx_lm") else "-", color=cmap(i % 20), label=name,
                    linewidth=2.5 if "refined" in name else 1.2)
        ax.set_yscale("log")
        ax.set_xlabel("stored bits per weight (files on disk)")
        ax.set_ylabel(f"perplexity, {text} (log)")
        ax.set_title(f"held-out {text}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper right")
    fig.suptitle("Same fine-tuned weights: mlx-lm's quantizers (dashed) vs mfqat exports (solid)")
    fig.tight_layout()
    Path(a.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.png, dpi=110)
    print(f"plot: {a.png}")


if __name__ == "__main__":
    main()
