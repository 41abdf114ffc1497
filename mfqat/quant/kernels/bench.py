"""`mfqat bench`: fake-quant speed per format, as ratios to x.clone() and to torchao measured in the
same run.

    mfqat bench [--size 4096] [--backends reference,cpp] [--repeats 7] [--dtype bfloat16]
                [--device cuda --backends triton,cuda,reference]
                [--through mxint8:mxint4,mxfp8_e4m3:mxfp4_e2m1] [--formats ""]

Prints one row per (format, backend): median milliseconds, ratio to clone(), bandwidth as % of
clone()'s (clone_ms / ms: fake-quant reads and writes the same bytes as a copy), ratio to torchao's
to_mx + to_dtype (MXFP formats, where torchao is installed). Then, per ``--through`` pair
anchor:format, train-through-anchor (what MF-QAT's forward computes for a format below the anchor)
as one fused pass vs the two passes qdq_format(qdq_anchor(x)).

Ships in the package (``mfqat bench`` runs it); ``scripts/bench/bench_quant.py`` in a source
checkout is the same code, for BENCHMARKS.md's command lines and scripts/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import sys
import os
import statistics
import time
import warnings
from typing import List, Optional

import torch

from mfqat.formats import get_format
from mfqat.quant.kernels import available_backends, fake_quantize_dispatch, fake_quantize_through_dispatch

FORMATS = ["mxint8", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2",
           "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1"]


def best_ms(fn, repeats: int) -> float:
    """Median wall time in ms after one warm-up call (the median resists allocator luck and noise)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def torchao_fn(x: torch.Tensor, name: str):
    """torchao's to_mx + to_dtype of ``x`` in MXFP format ``name`` as a callable, or None (no torchao, or
    not an MXFP format torchao has)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
    except Exception:
        return None
    elem = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e3m2": "fp6_e3m2",
            "mxfp6_e2m3": "fp6_e2m3", "mxfp4_e2m1": torch.float4_e2m1fn_x2}.get(name)
    if elem is None:
        return None

    def run():
        s, d = to_mx(x, elem, 32, ScaleCalculationMode.FLOOR)
        return to_dtype(d, s, elem, 32, x.dtype)
    return run


def build_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    """The flags of `mfqat bench` (and of scripts/bench/bench_quant.py)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backends", default=None, help="comma list (default: every available backend)")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list (empty: skip)")
    p.add_argument("--through", default="mxint8:mxint4,mxfp8_e4m3:mxfp4_e2m1",
                   help="anchor:format pairs timed fused vs two passes (empty: skip)")
    return p


def run(a: argparse.Namespace) -> None:
    """Time and print the tables for parsed flags ``a`` (sets ``MFQAT_BACKEND`` per row)."""
    torch.manual_seed(0)
    x = torch.randn(a.size, a.size, device=a.device).to(getattr(torch, a.dtype))
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    backends = a.backends.split(",") if a.backends else available_backends(x.device)
    clone_ms = best_ms(lambda: (x.clone(), sync()), a.repeats)
    print(f"device={a.device} dtype={a.dtype} shape={tuple(x.shape)} threads={torch.get_num_threads()} "
          f"clone={clone_ms:.2f} ms backends={backends}")
    print(f"{'format':<12} {'backend':<10} {'ms':>9} {'x clone':>8} {'% clone':>8} {'torchao ms':>11} "
          f"{'torchao/ours':>13}")
    for name in filter(None, a.formats.split(",")):
        f = get_format(name)
        ao = torchao_fn(x, name)
        ao_ms = best_ms(lambda: (ao(), sync()), a.repeats) if ao else float("nan")
        for be in backends:
            os.environ["MFQAT_BACKEND"] = be
            ms = best_ms(lambda: (fake_quantize_dispatch(x, f, 32, "floor"), sync()), a.repeats)
            print(f"{name:<12} {be:<10} {ms:9.2f} {ms / clone_ms:8.2f} {100 * clone_ms / ms:7.0f}% {ao_ms:11.2f} "
                  f"{ao_ms / ms:13.2f}")
    pairs = [pair.split(":") for pair in a.through.split(",") if pair]
    if pairs:
        print(f"{'anchor:format':<24} {'backend':<10} {'fused ms':>9} {'two-pass ms':>12} {'speed-up':>9}")
    for anchor, name in pairs:
        fa, f = get_format(anchor), get_format(name)
        for be in backends:
            os.environ["MFQAT_BACKEND"] = be
            fused = best_ms(lambda: (fake_quantize_through_dispatch(x, fa, f, 32), sync()), a.repeats)
            two = best_ms(lambda: (fake_quantize_dispatch(fake_quantize_dispatch(x, fa, 32)[0], f, 32), sync()),
                          a.repeats)
            print(f"{anchor + ':' + name:<24} {be:<10} {fused:9.2f} {two:12.2f} {two / fused:8.2f}x")


def check_formats(a: argparse.Namespace) -> None:
    """ValueError for an unknown ``--formats`` name or a ``--through`` entry that is not ANCHOR:FORMAT of
    known formats (checked before any tensor is built)."""
    pairs = [pair.split(":") for pair in a.through.split(",") if pair]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"--through {a.through!r}: give ANCHOR:FORMAT pairs, e.g. mxint8:mxint4")
    for flag, names in (("--formats", filter(None, a.formats.split(","))), ("--through", sum(pairs, []))):
        for name in names:
            try:
                get_format(name)
            except ValueError as e:
                raise ValueError(f"{flag}: {e}") from None


def main(argv: Optional[List[str]] = None, prog: Optional[str] = None) -> None:
    """Parse ``argv`` (default: sys.argv[1:]) and run; ``MFQAT_BACKEND`` is restored afterwards."""
    parser = build_parser(prog)
    a = parser.parse_args(argv)
    try:
        check_formats(a)
    except ValueError as e:  # one line, exit 2, as every mfqat command
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    before = os.environ.get("MFQAT_BACKEND")
    try:
        run(a)
    finally:
        if before is None:
            os.environ.pop("MFQAT_BACKEND", None)
        else:
            os.environ["MFQAT_BACKEND"] = before
