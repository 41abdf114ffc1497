#!/usr/bin/env python
"""MLX runtime measurements, side by side in one run (SmolLM2-135M, MLX's default device):

1. step time: plain MLX training vs MF-QAT (fixed --format) on the same batch;
2. loss curves: the same short MF-QAT run (progressive schedule) in PyTorch and in MLX from the
   same weights, same batches, same AdamW (bias-corrected, no weight decay) and grad clipping.

    python scripts/bench/bench_mlx.py [--steps 8] [--batch-size 2] [--seq-len 128] [--out out/bench_mlx]

Prints both tables and writes OUT/loss_pytorch_vs_mlx.png.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from transformers import AutoModelForCausalLM

import mfqat
from mfqat.data.sources import load_text, split_text, token_blocks
from mfqat.eval.report import format_table
from mfqat.mlx.models import hf_tokenizer, load_for_training, smollm2_mlx_dir
from mfqat.mlx.qat import prepare as mlx_prepare
from mfqat.mlx.train import loss_fn, make_optimizer, train_steps


def mlx_step_time(model, batch, steps: int) -> float:
    import mlx.nn as nn

    opt = make_optimizer(1e-5)
    vg = nn.value_and_grad(model, loss_fn)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        loss, grads = vg(model, batch)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        times.append(time.perf_counter() - t)
    return min(times[1:])


def torch_losses(src: Path, batches: list, cfg: mfqat.QATConfig, lr: float) -> list:
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    mfqat.prepare(model, cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ctl = model.mfqat_controller
    out = []
    for step, b in enumerate(batches):
        ctl.set_step(model, step, len(batches))
        ids = torch.from_numpy(np.asarray(b)).long()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--timing-steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--format", default="mxint4")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--out", default="out/bench_mlx")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    src = smollm2_mlx_dir()
    model, tok, _ = load_for_training(str(src))
    text, _ = split_text(load_text(None))
    blocks = token_blocks(hf_tokenizer(tok), text, a.seq_len, max_blocks=a.steps * a.batch_size).numpy()
    batches = [blocks[i * a.batch_size:(i + 1) * a.batch_size] for i in range(a.steps)]

    first = mx.array(batches[0])
    plain = mlx_step_time(model, first, a.timing_steps)
    model, _, _ = load_for_training(str(src))
    mlx_prepare(model, mfqat.QATConfig(formats=[a.format], schedule="fixed"))
    qat = mlx_step_time(model, first, a.timing_steps)
    print(f"MLX device={mx.default_device()} batch={a.batch_size}x{a.seq_len}")
    print(format_table([{"run": "plain MLX", "s/step": plain, "ratio": 1.0},
                        {"run": f"MF-QAT {a.format}", "s/step": qat, "ratio": qat / plain}],
                       ["run", "s/step", "ratio"]))

    cfg = mfqat.QATConfig()  # progressive mxint2 -> 4 -> 6 -> 8
    pt = torch_losses(src, batches, cfg, a.lr)
    model, _, _ = load_for_training(str(src))
    mlx_prepare(model, cfg)
    ml = train_steps(model, (mx.array(b) for b in batches), a.steps, a.lr, desc="mlx")
    fmts = [cfg.make_schedule().format_at(i, a.steps) for i in range(a.steps)]
    rows = [{"step": i, "format": f, "PyTorch loss": x, "MLX loss": y, "|diff|": abs(x - y)}
            for i, (f, x, y) in enumerate(zip(fmts, pt, ml))]
    print(format_table(rows, ["step", "format", "PyTorch loss", "MLX loss", "|diff|"]))
    print(f"max |loss diff| {max(r['|diff|'] for r in rows):.2e}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(pt, marker="o", label="PyTorch (mfqat)")
    ax.plot(ml, marker="x", linestyle="--", label="MLX (mfqat.mlx)")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Same MF-QAT run (progressive mxint2->8), same start")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_pytorch_vs_mlx.png")
    print(f"plot: {out / 'loss_pytorch_vs_mlx.png'}")


if __name__ == "__main__":
    main()
