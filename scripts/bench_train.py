#!/usr/bin/env python
"""MF-QAT training step time vs plain training of the same model, same batch, same run.

    python scripts/bench_train.py [--steps 5] [--batch-size 4] [--seq-len 128] [--format mxint4]
                                  [--backends reference,auto]

Prints plain step time and, per quantizer backend, the MF-QAT step time and its ratio to plain.
"""
from __future__ import annotations

import argparse
import copy
import os
import time

import torch

import mfqat
from mfqat.data import load_model, pydoc_text, token_blocks


def step_time(model, batch, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for _ in range(steps + 1):
        t = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return min(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
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
    plain_s = step_time(model, batch, a.steps)
    print(f"batch={a.batch_size}x{a.seq_len} threads={torch.get_num_threads()} format={a.format}")
    print(f"plain step {plain_s:.3f} s")
    for backend in a.backends.split(","):
        os.environ["MFQAT_BACKEND"] = backend
        qat_s = step_time(qat, batch, a.steps)
        print(f"MF-QAT step [{backend}] {qat_s:.3f} s | ratio to plain {qat_s / plain_s:.2f}x")
    plain_again = step_time(model, batch, a.steps)
    print(f"plain step again {plain_again:.3f} s (noise check)")


if __name__ == "__main__":
    main()
