#!/usr/bin/env python
"""Every supported model family through the `mfqat` command, as a new user runs it.

For each family, a tiny random model built from its transformers config (mfqat/models/catalog.py's
settings) and the tiny test tokenizer are saved as an HF folder; then, each as its own process:

    mfqat train  --model DIR --steps 2 --qat-config mxint_joint   -> OUT/anchor
    mfqat eval   OUT/anchor --formats mxint8,mxint4               -> perplexity table + PNG
    mfqat export-mlx OUT/anchor --recipe uniform:affine4 --refine -> verified MLX folder
    mfqat export-mlx OUT/anchor --recipe uniform:mxint4           -> verified MLX folder

and prints one row per family: each command's exit status and seconds, the export's stored bits and
max |logit diff|. Exits 1 when any command failed (the failing command's last lines are printed).

    python scripts/dev/probe_families.py                 # every family (~10 min on 2 cores)
    python scripts/dev/probe_families.py --only phi3,qwen3_moe
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mfqat.eval.report import format_table  # noqa: E402


def save_family(name: str, dest: Path) -> None:
    from mfqat.data.sources import tiny_tokenizer
    from mfqat.models.catalog import SUPPORTED, build

    tok = tiny_tokenizer()
    model_type, extra = SUPPORTED[name]
    build(model_type, extra, len(tok)).save_pretrained(dest)
    tok.save_pretrained(dest)


def run(cmd: list, log: list) -> tuple:
    """(exit status, seconds) of ``python -m mfqat CMD``; the output's tail kept in ``log`` on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mfqat", *cmd], env=env, capture_output=True, text=True)
    if p.returncode:
        log.append(f"$ mfqat {' '.join(cmd)}\n" + "\n".join((p.stdout + p.stderr).strip().splitlines()[-8:]))
    return p.returncode, time.perf_counter() - t


def probe(name: str, work: Path, log: list) -> dict:
    src, out = work / name, work / f"run_{name}"
    save_family(name, src)
    row = {"family": name}
    steps = [("train", ["train", "--model", str(src), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                        "--qat-config", "mxint_joint", "--out", str(out)]),
             ("eval", ["eval", str(out / "anchor"), "--formats", "mxint8,mxint4", "--seq-len", "32", "--blocks", "2",
                       "--plot", str(work / f"{name}.png")]),
             ("affine4+refine", ["export-mlx", str(out / "anchor"), "--out", str(work / f"mlx_a4_{name}"),
                                 "--recipe", "uniform:affine4", "--refine", "--refine-steps", "2"]
                                + (["--group-size", "32"] if name == "deepseek_v3" else [])),  # tiny q_lora_rank 32
             ("mxint4", ["export-mlx", str(out / "anchor"), "--out", str(work / f"mlx_m4_{name}"),
                         "--recipe", "uniform:mxint4"])]
    for label, cmd in steps:
        rc, secs = run(cmd, log)
        row[label] = f"rc {rc}, {secs:.0f}s"
        if rc:
            break
    for label, folder in (("affine4 stored bits", f"mlx_a4_{name}"), ("mxint4 stored bits", f"mlx_m4_{name}")):
        rep = work / folder / "mfqat_export.json"
        if rep.is_file():
            r = json.loads(rep.read_text())
            row[label] = f"{r['stored_bits_per_weight']:.2f} (|dlogit| {r['verify']['max_abs_logit_diff']:.1e})"
    return row


def main() -> None:
    from mfqat.models.catalog import SUPPORTED

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma list of families (default: all of mfqat.models.catalog)")
    a = p.parse_args()
    names = [n for n in a.only.split(",") if n] or list(SUPPORTED)
    unknown = sorted(set(names) - set(SUPPORTED))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(SUPPORTED)}")
    log: list = []
    with tempfile.TemporaryDirectory(prefix="mfqat-families-") as tmp:
        rows = [probe(n, Path(tmp), log) for n in names]
    cols = ["family", "train", "eval", "affine4+refine", "mxint4", "affine4 stored bits", "mxint4 stored bits"]
    print(format_table([{c: r.get(c, "-") for c in cols} for r in rows], cols))
    for entry in log:
        print("\n" + entry)
    sys.exit(1 if log else 0)


if __name__ == "__main__":
    main()
