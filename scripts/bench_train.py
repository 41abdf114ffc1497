#!/usr/bin/env python
"""MF-QAT training step time vs plain training of the same model, same batch, same run.

    python scripts/bench_train.py [--rounds 6] [--batch-size 4] [--seq-len 128] [--format mxint4]
                                  [--backends reference,auto]

Steps are interleaved (plain, then MF-QAT with each backend, round after round) and the median per
configuration is reported, so slow drifts of the machine hit every configuration alike. Also prints
the time of fake-quantizing every targeted weight once (the part MF-QAT adds to a step).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import mfqat
from mfqat.data import load_model, pydoc_text, token_blocks
from mfqat.qat.prepare import qat_modules


def make_step(model, batch):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        t = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t
    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--format", default="mxint4")
    p.add_argument("--backends", default="reference,auto", help="MFQAT_BACKEND values to time")
    a = p.parse_args()
    model, tok = load_model()
    model.train()
    batch = token_blocks(tok, pydoc_text()[:200000], a.seq_len, max_blocks=a.batch_size)
    qat = copy.deepcopy(model)
    mfqat.prepare(qat, mfqat.QATConfig(formats=[a.format], schedule="fixed"))
    runs = {"plain": (make_step(model, batch), None)}
    qat_step = make_step(qat, batch)
    for backend in a.backends.split(","):
        runs[f"MF-QAT [{backend}]"] = (qat_step, backend)
    times = {k: [] for k in runs}
    for r in range(a.rounds + 1):  # round 0 warms up
        for name, (step, backend) in runs.items():
            if backend:
                os.environ["MFQAT_BACKEND"] = backend
            dt = step()
            if r:
                times[name].append(dt)
    os.environ["MFQAT_BACKEND"] = "auto"
    plain = statistics.median(times["plain"])
    n_weights = sum(m.weight.numel() for _, m in qat_modules(qat))
    print(f"batch={a.batch_size}x{a.seq_len} threads={torch.get_num_threads()} format={a.format} "
          f"rounds={a.rounds} quantized weights={n_weights / 1e6:.1f}M")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<22} median {med:.3f} s/step (min {min(ts):.3f}, max {max(ts):.3f}) | ratio to plain {med / plain:.3f}x")
    for backend in a.backends.split(","):
        os.environ["MFQAT_BACKEND"] = backend
        t = time.perf_counter()
        with torch.no_grad():
            for _, m in qat_modules(qat):
                m.quantized_weight()
        print(f"fake-quant of every targeted weight once [{backend}]: {1000 * (time.perf_counter() - t):.0f} ms")


if __name__ == "__main__":
    main()
