#!/usr/bin/env python
"""Packing 3/5/6-bit codes as MLX stores them (``mfqat.quant.packing.pack_codes``): whole-byte groups in one
int64 word (since issue 44) against the bit-by-bit stream it replaced (kept here as the reference: bit k of
code i at stream bit i * bits + k), measured side by side in one run, each in its own process so that its
peak resident memory is its own. The default matrix is a 3B model's embedding (49152 x 3072) at 6 bits,
the tensor whose whole-tensor write took a 3B ``auto:`` export to 16 GiB.

    python scripts/bench/bench_packing.py [--rows 49152] [--cols 3072] [--bits 6]

Prints, per path, the seconds, the peak resident memory and the extra memory over the codes alone, the
ratios, and checks the two paths give the same bytes.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def bit_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout by its definition (what pack_codes did for widths that do not divide 8 before issue 44)."""
    c = codes.to(torch.int32) & ((1 << bits) - 1)
    shifts = torch.arange(bits, dtype=torch.int32)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*c.shape[:-1], c.shape[-1] * bits // 8, 8)
    return (stream << torch.arange(8, dtype=torch.int32)).sum(dim=-1).to(torch.uint8)


def one(path: str, rows: int, cols: int, bits: int) -> dict:
    """Pack random ``bits``-bit uint8 codes of ``rows`` x ``cols`` with one path; its time, memory and digest."""
    import hashlib

    from mfqat.quant.packing import pack_codes

    codes = torch.randint(0, 1 << bits, (rows, cols), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    packed = pack_codes(codes, bits) if path == "words" else bit_stream(codes, bits)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "peak_gib": peak / 2 ** 20, "extra_gib": (peak - before) / 2 ** 20,
            "sha256": hashlib.sha256(packed.numpy().tobytes()).hexdigest()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=49152)
    p.add_argument("--cols", type=int, default=3072)
    p.add_argument("--bits", type=int, default=6, choices=[3, 5, 6, 7])
    p.add_argument("--path", choices=["words", "stream"], help=argparse.SUPPRESS)  # the child process
    a = p.parse_args(argv)
    if a.path:
        print(json.dumps(one(a.path, a.rows, a.cols, a.bits)))
        return 0
    res = {}
    for path in ("stream", "words"):
        out = subprocess.run([sys.executable, __file__, "--path", path, "--rows", str(a.rows), "--cols", str(a.cols),
                              "--bits", str(a.bits)], capture_output=True, text=True, check=True).stdout
        res[path] = json.loads(out.strip().splitlines()[-1])
    s, w = res["stream"], res["words"]
    print(f"pack {a.rows} x {a.cols} codes of {a.bits} bits ({a.rows * a.cols / 1e6:.0f}M codes)")
    print("| path | seconds | peak GiB | extra GiB over the codes |")
    print("|---|---|---|---|")
    for name, r in (("bit stream (before)", s), ("whole-byte words (pack_codes)", w)):
        print(f"| {name} | {r['seconds']:.2f} | {r['peak_gib']:.2f} | {r['extra_gib']:.2f} |")
    print(f"speed-up {s['seconds'] / w['seconds']:.1f}x, extra memory {s['extra_gib'] / max(w['extra_gib'], 1e-9):.1f}x "
          f"less; same bytes: {s['sha256'] == w['sha256']}")
    return 0 if s["sha256"] == w["sha256"] else 1


if __name__ == "__main__":
    sys.exit(main())
