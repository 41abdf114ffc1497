#!/usr/bin/env python
"""MLX MF-QAT step time and peak memory, with and without activation checkpointing (--grad-checkpoint).

    python scripts/bench/bench_mlx_memory.py [--steps 2] [--batch-size 2] [--seq-len 128] [--format mxint4]
    python scripts/bench/bench_mlx_memory.py --tiny --batch-size 8 --seq-len 256 --steps 3

SmolLM2-135M (embedded), MF-QAT in one fixed format, AdamW, same batch every step. Each
configuration runs in its own process so ``mx.get_peak_memory`` is its own; the first step
(graph build, allocations) is left out of the median step time. "peak memory" covers whole steps
(weights, gradients, AdamW state); "gradient pass" is the peak of one forward+backward above the
memory resident before it, where checkpointing acts.
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
    from mfqat.mlx.train import loss_fn, train_steps
    import mlx.nn as nn

    if args.tiny:  # a tiny 8-block Llama: activations, not weights, dominate the memory
        import tempfile

        from mfqat.data.sources import tiny_llama, tiny_tokenizer

        src, tok = tempfile.mkdtemp(), tiny_tokenizer()
        tiny_llama(vocab_size=len(tok), hidden=128, layers=8, heads=4, intermediate=512).save_pretrained(src)
        tok.save_pretrained(src)
    model, _, _ = load_for_training(str(src if args.tiny else smollm2_mlx_dir()))
    prepare(model, mfqat.QATConfig(formats=[args.format], schedule="fixed"))
    if checkpoint:
        runtime.checkpoint_layers(model)
    vocab = 200 if args.tiny else 49152
    batch = mx.array(np.random.default_rng(0).integers(0, vocab, (args.batch_size, args.seq_len + 1)).astype(np.int32))
    mx.reset_peak_memory()
    times = []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        train_steps(model, iter([batch]), 1, lr=1e-5, desc="")
        times.append(time.perf_counter() - t)
    peak = runtime.peak_memory_mib()
    vg = nn.value_and_grad(model, loss_fn)  # the gradient pass alone, above what stays resident
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    mx.eval(vg(model, batch))
    return {"step_s": statistics.median(times[1:]), "peak_mib": peak,
            "grad_pass_mib": (mx.get_peak_memory() - resident) / 2 ** 20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--format", default="mxint4")
    p.add_argument("--tiny", action="store_true", help="a tiny 8-block Llama instead of SmolLM2-135M")
    p.add_argument("--one", choices=["plain", "checkpoint"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args, args.one == "checkpoint")))
        return
    print("| --grad-checkpoint | step time (s) | peak memory (MiB) | gradient pass above resident (MiB) |")
    print("|---|---:|---:|---:|")
    for mode in ("plain", "checkpoint"):
        r = subprocess.run([sys.executable, __file__, "--one", mode, *sys.argv[1:]], capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(r.stderr[-2000:])
        res = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"| {'on' if mode == 'checkpoint' else 'off'} | {res['step_s']:.2f} | {res['peak_mib']:.0f} | "
              f"{res['grad_pass_mib']:.0f} |")


if __name__ == "__main__":
    main()
