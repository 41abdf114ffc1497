#!/usr/bin/env python
"""Start-up time of the `mfqat` command: --version, --help, a subcommand's --help, a user mistake.

    python scripts/bench/bench_cli.py [--repeats 7] [--root DIR]   # DIR: another checkout, e.g. an older commit

Each row: median wall seconds of a fresh `python -m mfqat.cli ARGS` process (interpreter start
included), and whether that process imported torch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = [["--version"], ["--help"], ["train", "--help"], ["export-mlx", "--help"],
         ["convert", "no/such/anchor", "--out", "x"]]
PROBE = ("import runpy, sys\nsys.argv = ['mfqat'] + sys.argv[1:]\ntry:\n    runpy.run_module('mfqat.cli', "
         "run_name='__main__')\nexcept SystemExit:\n    pass\nprint('TORCH' if 'torch' in sys.modules else 'NOTORCH', "
         "file=sys.stderr)\n")


def run(args: list[str], root: Path = ROOT) -> tuple[float, bool]:
    """(seconds, torch imported) of one fresh process running the mfqat found in ``root``."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=root)
    return time.perf_counter() - t, "NOTORCH" not in done.stderr


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--root", type=Path, default=ROOT, help="checkout whose mfqat is measured")
    a = p.parse_args()
    print("| command | median s | imports torch |\n|---|---|---|")
    for args in CASES:
        runs = [run(args, a.root) for _ in range(a.repeats)]
        print(f"| `mfqat {' '.join(args)}` | {statistics.median(t for t, _ in runs):.3f} | {runs[0][1]} |")


if __name__ == "__main__":
    main()
