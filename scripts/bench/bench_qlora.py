#!/usr/bin/env python
"""LoRA on a frozen base, SmolLM2-135M: fp LoRA, bitsandbytes QLoRA (NF4 + double quant) and
MX-QLoRA on an MXINT8 anchor (one adapter cycled over mxint8/6/4 vs one trained on mxint4 alone).

    nice python scripts/bench/bench_qlora.py [--steps 20] [--seq-len 64] [--batch-size 4] [--out runs/bench_qlora]

Every configuration runs in its own process (`mfqat train` / `mfqat mx-qlora`) on the same text,
steps, seed, rank 8 (alpha 16, q/k/v/o/gate/up/down), lr 2e-4, so its peak RSS is its own; the
table gives held-out perplexity, peak memory (RSS: includes loading the model) and s/step.
The MXINT8 anchor is a post-training anchor of the original weights (save_anchor, no QAT).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(args: list, out: Path) -> dict:
    """Run ``python -m mfqat.cli ARGS --out OUT`` in a fresh process; its summary.json."""
    subprocess.run([sys.executable, "-m", "mfqat.cli", *args, "--out", str(out)], check=True, cwd=ROOT)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--out", default="runs/bench_qlora")
    a = p.parse_args()
    out = Path(a.out).absolute()
    anchor = out / "anchor_mxint8"
    if not (anchor / "mfqat.json").is_file():
        subprocess.run([sys.executable, "-c", "import mfqat, sys; from mfqat.data.sources import load_model; "
                        "m, t = load_model(); mfqat.save_anchor(m, sys.argv[1], 'mxint8', tokenizer=t, overwrite=True)",
                        str(anchor)], check=True, cwd=ROOT)
    common = ["--steps", str(a.steps), "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
              "--eval-blocks", str(a.eval_blocks), "--lora-rank", "8", "--lora-alpha", "16", "--lr", "2e-4"]
    rows = []

    def row(name, s, ppl, fmt):
        rows.append({"run": name, "eval format": fmt, "perplexity": ppl, "peak MiB": s["peak_memory_mib"],
                     "s/step": s["seconds_per_step"]})

    for base in ("fp", "nf4"):
        s = run(["train", "--no-qat", "--base", base, *common], out / f"lora_{base}")
        row(f"LoRA, {base} base" + (" (bnb, double quant)" if base == "nf4" else ""), s,
            s["eval"][-1]["perplexity"], base)
    mx = ["mx-qlora", str(anchor), "--eval-formats", "mxint8,mxint6,mxint4", *common]
    s = run([*mx[:2], "--formats", "mxint8", "--eval-formats", "mxint8,mxint6,mxint4", "--steps", "0",
             "--seq-len", str(a.seq_len), "--eval-blocks", str(a.eval_blocks)], out / "mx_none")
    for r in s["eval"]:
        rows.append({"run": "no adapter (anchor slice)", "eval format": r["format"], "perplexity": r["perplexity"],
                     "peak MiB": s["peak_memory_mib"], "s/step": float("nan")})
    s = run([*mx, "--formats", "mxint8,mxint6,mxint4", "--schedule", "cyclic"], out / "mx_cyclic")
    for r in s["eval"]:
        row("MX-QLoRA, one adapter cycled 8/6/4", s, r["perplexity"], r["format"])
    s = run([*mx, "--formats", "mxint4", "--schedule", "fixed"], out / "mx_int4")
    for r in s["eval"]:
        row("MX-QLoRA, adapter for mxint4 alone", s, r["perplexity"], r["format"])
    (out / "bench_qlora.json").write_text(json.dumps(rows, indent=2))
    print("| run | eval format | held-out ppl | peak RSS MiB | s/step |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['eval format']} | {r['perplexity']:.2f} | {r['peak MiB']:.0f} | {r['s/step']:.2f} |")


if __name__ == "__main__":
    main()
