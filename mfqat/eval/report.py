"""Summary tables and plots for evaluations."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """A plain-text table (also valid Markdown) of dict rows."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.1f}"
        return "" if v is None else str(v)
    body = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(list(columns)), sep] + [line(b) for b in body])


def plot_ppl_vs_bpw(series: Dict[str, List[tuple]], path: Path, title: str = "Perplexity vs bits per weight",
                    fp_ppl: float | None = None, fp_label: str = "full precision") -> Path:
    """Plot {label: [(bits_per_weight, ppl, format_name), ...]} as lines; write a PNG."""
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for label, pts in series.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for x, y, name in pts:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    if fp_ppl is not None:
        ax.axhline(fp_ppl, color="gray", linestyle="--", label=f"{fp_label} ({fp_ppl:.2f})")
    ax.set_xlabel("bits per weight (incl. scales)")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_curve(values: List[float], path: Path, title: str, ylabel: str = "loss",
               labels: List[str] | None = None) -> Path:
    """A simple line plot (training loss curve), colouring points by an optional label per step."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(range(len(values)), values, linewidth=1)
    if labels:
        for lab in sorted(set(labels)):
            xs = [i for i, l in enumerate(labels) if l == lab]
            ax.scatter(xs, [values[i] for i in xs], s=6, label=lab)
        ax.legend(fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
