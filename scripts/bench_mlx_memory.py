#!/usr/bin/env python
"""MLX MF-QAT step time and peak memory, with and without activation checkpointing (--grad-checkpoint).

    python scripts/bench_mlx_memory.py [--steps 2] [--batch-size 2] [--seq-len 128] [--format mxint4]

SmolLM2-135M (embedded), MF-QAT in one fixed format, AdamW, same batch every step. Each
configuration runs in its own process so ``mx.get_peak_memory`` is its own; the first step
(graph build, allocations) is left out of the median step time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


def one(args: argparse.Namespace, checkpoint: bool) -> dict:
    import mlx.core as mx
    import numpy as np

    import mfqat
    from mfqat.mlx import runtime
    from mfqat.mlx.models import load_for_training, smollm2_mlx_dir
    from mfqat.mlx.qat import prepare
    from mfqat.mlx.train import train_steps

    model, _, _ = load_for_training(str(smollm2_mlx_dir()))
    prepare(model, mfqat.QATConfig(formats=[args.format], schedule="fixed"))
    if checkpoint:
        runtime.checkpoint_layers(model)
    batch = mx.array(np.random.default_rng(0).integers(0, 49152, (args.batch_size, args.seq_len + 1)).astype(np.int32))
    mx.reset_peak_memory()
    times = []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        train_steps(model, iter([batch]), 1, lr=1e-5, desc="")
        times.append(time.perf_counter() - t)
    return {"step_s": statistics.median(times[1:]), "peak_mib": runtime.peak_memory_mib()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--format", default="mxint4")
    p.add_argument("--one", choices=["plain", "checkpoint"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args, args.one == "checkpoint")))
        return
    print("| --grad-checkpoint | step time (s) | peak memory (MiB) |\n|---|---:|---:|")
    for mode in ("plain", "checkpoint"):
        r = subprocess.run([sys.executable, __file__, "--one", mode, *sys.argv[1:]], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        res = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"| {'on' if mode == 'checkpoint' else 'off'} | {res['step_s']:.2f} | {res['peak_mib']:.0f} |")


if __name__ == "__main__":
    main()
