#!/usr/bin/env python
"""MX-compressed gradient all-reduce vs fp32, 2 gloo ranks: bytes sent per step and the loss curve.

    python scripts/bench/bench_grad_compress.py [--steps 150] [--hidden 128] [--layers 4]
                                          [--modes fp32,fp16,mxfp8,mxint4-noef,...]

Each mode trains the same tiny Llama (byte tokens of Python's pydoc text, a different shard per
rank, AdamW, same seed) with DDP over gloo; ``-noef`` turns error feedback off; ``fp16`` is torch's
own ``fp16_compress_hook`` (the usual 2x compression, and a yardstick for how far any rounding of
the gradients moves an AdamW trajectory). Reported per mode:
bytes this rank hands the backend per optimizer step (fp32: the flat fp32 buckets the default
all-reduce sends; compressed: packed codes + one E8M0 byte per 32 gradients, all-gathered), the
final loss (mean of the last 10 steps), the held-out loss, and the largest gap to the fp32 loss curve.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def byte_blocks(text: str, seq: int) -> torch.Tensor:
    ids = torch.tensor(list(text.encode()), dtype=torch.long)
    return ids[: ids.numel() // seq * seq].reshape(-1, seq)


def worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mfqat.data.sources import pydoc_text, split_text, tiny_llama
    from mfqat.train.grad_compress import register

    train_text, held_text = split_text(pydoc_text())
    train, held = byte_blocks(train_text, args.seq_len), byte_blocks(held_text, args.seq_len)[:32]
    results = {}
    for mode in args.modes.split(","):
        model = tiny_llama(vocab_size=256, hidden=args.hidden, layers=args.layers, heads=4,
                           intermediate=args.hidden * 2, seed=0)
        model.train()
        ddp = DDP(model)
        fmt = mode.split("-")[0]
        state = None
        if fmt == "fp16":  # torch's own compression hook, the usual 2x (its bf16 one needs NCCL)
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
            ddp.register_comm_hook(None, fp16_compress_hook)
        elif fmt != "fp32":
            state = register(ddp, fmt, error_feedback=not mode.endswith("-noef"))
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(1 + rank)
        losses, sent = [], []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            batch = train[torch.randint(0, train.shape[0], (args.batch_size,), generator=g)]
            loss = ddp(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t = loss.detach().clone()
            dist.all_reduce(t)
            losses.append(t.item() / 2)
            n = sum(p.numel() for p in model.parameters())
            sent.append(state.pop_bytes()[0] if state else (2 if fmt == "fp16" else 4) * n)
        secs = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            held_loss = model(input_ids=held, labels=held).loss.item()
        results[mode] = {"losses": losses, "bytes_per_step": sent[-1], "held_loss": held_loss, "seconds": secs}
        if rank == 0:
            tail = losses[-10:]
            print(f"{mode}: final loss {sum(tail) / len(tail):.4f} held-out {held_loss:.4f} ({secs:.0f}s)", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--modes", default="fp32,fp16,mxfp8,mxfp8-noef,mxint8,mxint4,mxint4-noef,mxfp4,mxfp4-noef")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "res.json")
        mp.spawn(worker, args=(free_port(), args, out), nprocs=2, join=True)
        res = json.loads(Path(out).read_text())
    fp = res.get("fp32")
    print("\n| mode | bytes/step/rank | vs fp32 | final loss (last 10) | held-out loss | max gap to fp32 curve |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, r in res.items():
        ratio = fp["bytes_per_step"] / r["bytes_per_step"] if fp else float("nan")
        gap = max(abs(a - b) for a, b in zip(r["losses"], fp["losses"])) if fp else float("nan")
        tail = r["losses"][-10:]
        print(f"| {mode} | {r['bytes_per_step']:,} | {ratio:.2f}x smaller | {sum(tail) / len(tail):.4f} | "
              f"{r['held_loss']:.4f} | {gap:.4f} |")


if __name__ == "__main__":
    main()
