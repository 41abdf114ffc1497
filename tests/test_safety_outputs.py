"""Issue 47: never overwrite or delete what a user has; refuse bad input before the work.

Outputs go through one guard (mfqat.storage.guard): never inside, equal to or above an input, an
existing folder only when it is the command's own earlier output and --overwrite is given, a file
mfqat did not write never replaced, a leftover deleted only when it carries mfqat's mark.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mfqat
from mfqat.cli import main
from mfqat.data.sources import tiny_llama, tiny_tokenizer

from .conftest import dead_pid, one_line_exit_2


# --- leftovers are ours before they are removed ----------------------------------------------------------------

def test_a_user_folder_named_like_a_leftover_partial_is_kept(tmp_path, caplog):
    mfqat.save_anchor(tiny_llama(), tmp_path / "a")  # the next save replaces it: backups of it may go
    pid = dead_pid()
    user = tmp_path / f".a.{pid}-deadbeef.partial"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    killed = tmp_path / f".a.{pid}-0badc0de.partial"  # what a killed save leaves: the mark names its PID
    (killed / ".mfqat-partial").mkdir(parents=True)
    (killed / ".mfqat-partial" / "pid").write_text(str(pid))
    wrong = tmp_path / f".a.{pid}-0badf00d.partial"  # a mark naming another PID is not the writer's
    (wrong / ".mfqat-partial").mkdir(parents=True)
    (wrong / ".mfqat-partial" / "pid").write_text(str(pid + 1))
    backup = tmp_path / f".a.old-{pid}"  # named like a backup, but no anchor
    backup.mkdir()
    (backup / "notes.txt").write_text("mine")
    mfqat.save_anchor(tiny_llama(), tmp_path / "a", overwrite=True)
    assert (user / "thesis.tex").read_text() == "years of work"
    assert (backup / "notes.txt").read_text() == "mine" and wrong.is_dir()
    assert not killed.exists()
    assert f"left {user.name}" in caplog.text and "carries no mark" in caplog.text
    assert not (tmp_path / "a" / ".mfqat-partial").exists(), "the mark must not end up in the artifact"


# --- one output guard: train / mx-qlora never replace their input or a user's files ------------------------------

TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1", "--no-qat", "--steps", "2"]


def _files(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_train_never_writes_over_the_anchor_it_trains_from(anchor, tmp_path, capsys, monkeypatch):
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran before its output was checked"))
    before = _files(anchor.parent)
    for out in (anchor.parent, anchor, anchor / "sub"):
        one_line_exit_2(["train", "--model", str(anchor), "--steps", "2", "--out", str(out), "--overwrite"], capsys,
                         "would overwrite, hold or sit inside the input")
    text = tmp_path / "data" / "train.txt"
    text.parent.mkdir()
    text.write_text("some text " * 50)
    one_line_exit_2(["train", *TINY, "--text", str(text), "--out", str(text.parent)], capsys, "the input")
    one_line_exit_2(["mx-qlora", str(anchor), "--out", str(anchor.parent)], capsys, "the input")
    assert _files(anchor.parent) == before


def test_train_out_over_an_earlier_run_needs_overwrite_and_never_replaces_user_files(tmp_path, capsys):
    from mfqat.train.loop import main as train_main

    out = tmp_path / "r2"
    train_main([*TINY, "--out", str(out)])
    capsys.readouterr()
    first = _files(out)
    assert (out / "summary.json").is_file() and (out / "mfqat_run.json").is_file()
    one_line_exit_2(["train", *TINY, "--out", str(out)], capsys, "pass --overwrite")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        train_main([*TINY, "--out", str(out)])
    assert _files(out) == first
    train_main([*TINY, "--out", str(out), "--overwrite", "--seed", "1"])  # its own earlier run: replaced
    capsys.readouterr()
    assert json.loads((out / "summary.json").read_text())["losses"] != json.loads(first[Path("summary.json")])["losses"]
    (out / "summary.json").write_text("the user's own summary")  # a user's file of the same name
    one_line_exit_2(["train", *TINY, "--out", str(out), "--overwrite"], capsys, "summary.json there was not written")
    assert (out / "summary.json").read_text() == "the user's own summary"
    user = tmp_path / "mine"  # a folder mfqat did not make: refused even with --overwrite
    user.mkdir()
    (user / "loss.png").write_bytes(b"the user's plot")
    one_line_exit_2(["train", *TINY, "--out", str(user), "--overwrite"], capsys, "is no earlier `mfqat train` run")
    assert (user / "loss.png").read_bytes() == b"the user's plot"


def test_mx_qlora_out_and_mlx_adapter_path_never_replace_user_files(anchor, tmp_path, capsys):
    fast = ["--steps", "1", "--seq-len", "16", "--batch-size", "1", "--eval-blocks", "1", "--lora-rank", "2"]
    out = tmp_path / "q"
    main(["mx-qlora", str(anchor), *fast, "--out", str(out)])
    capsys.readouterr()
    assert (out / "adapter" / "adapter_config.json").is_file()
    one_line_exit_2(["mx-qlora", str(anchor), *fast, "--out", str(out)], capsys, "pass --overwrite")
    (out / "summary.json").write_text("the user's own summary")
    one_line_exit_2(["mx-qlora", str(anchor), *fast, "--out", str(out), "--overwrite"], capsys,
                     "summary.json there was not written")
    assert (out / "summary.json").read_text() == "the user's own summary"
    mine = tmp_path / "mine"  # a user's mlx-lm adapter folder (it has adapter_config.json too)
    mine.mkdir()
    (mine / "adapter_config.json").write_text("{}")
    one_line_exit_2(["mx-qlora", str(anchor), *fast, "--out", str(tmp_path / "q2"), "--mlx-adapter-path", str(mine)],
                     capsys, "pass overwrite=True (--overwrite)")
    assert (mine / "adapter_config.json").read_text() == "{}" and not (tmp_path / "q2").exists()


# --- anchors refuse what would poison them ------------------------------------------------------------------------

REFINED_NAME = "model.layers.0.mlp.down_proj.weight"


def _reseal(folder: Path, edit) -> None:
    """Apply ``edit(meta)`` to mfqat.json and re-seal it as a tool that knows the digest would."""
    import hashlib

    from mfqat.storage.manifest import canonical_digest

    meta = json.loads((folder / "mfqat.json").read_text())
    edit(meta)
    meta["manifest"] = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in meta["manifest"]
                        if (folder / n).is_file()}
    meta["digest"] = canonical_digest(meta)
    (folder / "mfqat.json").write_text(json.dumps(meta))


@pytest.fixture
def refined_anchor(anchor, tmp_path):
    import shutil

    import torch

    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.anchor.learned_scales_store import add_learned_scales
    from mfqat.quant.derive import derive

    path = shutil.copytree(anchor, tmp_path / "refined")
    q = derive(read_anchor(path).quantized[REFINED_NAME].dequantize(torch.float32), "affine4", 32)
    q.scales = q.scales * 1.01  # "learned": differs from the derived scales
    add_learned_scales(path, "affine4", 32, {REFINED_NAME: q}, info={})
    mfqat.load_anchor(path, "affine4", group_size=32)  # readable as stored
    return path


def test_a_changed_and_resealed_refined_width_is_refused_by_the_hash_in_its_name(refined_anchor):
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.storage.manifest import AnchorError

    meta = json.loads((refined_anchor / "mfqat.json").read_text())
    f = refined_anchor / meta["refined"]["affine4"]["file"]
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x7F  # the last bfloat16 bias: its high byte becomes an exponent of all ones (NaN / inf)
    f.write_bytes(bytes(data))
    _reseal(refined_anchor, lambda m: None)
    with pytest.raises(AnchorError, match="sha256 does not start with"):
        read_anchor(refined_anchor)


def test_a_refined_width_with_nan_values_is_refused_even_when_its_name_matches(refined_anchor):
    import torch
    from safetensors.torch import load, save

    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.anchor.learned_scales import learned_scales_file
    from mfqat.storage.manifest import AnchorError

    meta = json.loads((refined_anchor / "mfqat.json").read_text())
    old = refined_anchor / meta["refined"]["affine4"]["file"]
    raw = load(old.read_bytes())
    raw[f"{REFINED_NAME}.scales"] = torch.full_like(raw[f"{REFINED_NAME}.scales"], float("nan"))
    data = save(raw)
    import hashlib

    digest = hashlib.sha256(data).hexdigest()[:12]
    name = learned_scales_file("affine4").replace(".safetensors", f"-{digest}.safetensors")
    (refined_anchor / name).write_bytes(data)
    old.unlink()

    def edit(m):
        m["refined"]["affine4"]["file"] = name
        m["manifest"][name] = ""
    _reseal(refined_anchor, edit)
    with pytest.raises(AnchorError, match="NaN or infinite"):
        read_anchor(refined_anchor)


# --- every value checked up front ---------------------------------------------------------------------------------

UP_FRONT = [  # caught by the command line's checks: the command never runs
    (["train", "--model", "tiny", "--lr", "inf"], "--lr must be a finite number"),
    (["train", "--model", "tiny", "--lr", "nan"], "--lr must be a finite number"),
    (["train", "--model", "tiny", "--lr", "0"], "--lr must be > 0"),
    (["train", "--model", "tiny", "--lr-mult", "mxint=-1"], "--lr-mult mxint=-1: must be a finite number > 0"),
    (["train", "--model", "tiny", "--lr-mult", "mxint=nan"], "--lr-mult mxint=nan: must be a finite number > 0"),
    (["train", "--model", "tiny", "--lr-mult", "mxnit=2"], "--lr-mult mxnit: not a format family"),
    (["train", "--model", "tiny", "--distill", "nan"], "--distill must be a finite number"),
    (["mx-qlora", "{anchor}", "--lr", "inf"], "--lr must be a finite number"),
    (["mx-qlora", "{anchor}", "--lr", "0"], "--lr must be > 0"),
    (["refine", "{anchor}", "--lr", "inf"], "--lr must be a finite number"),
    (["export-mlx", "{anchor}", "--out", "{d}/x", "--recipe", "auto:nan"], "the budget must be a number of bits"),
    (["export-mlx", "{anchor}", "--out", "{d}/x", "--recipe", "auto:inf"], "the budget must be a number of bits"),
    (["export-mlx", "{anchor}", "--out", "{d}/x", "--recipe", "auto:1.5"], "from 2.25 (every tensor in mxint2)"),
    (["export-mlx", "{anchor}", "--out", "{d}/x", "--recipe", "auto:3:affine"], "from 3.5 (every tensor in affine3)"),
    (["export-mlx", "{anchor}", "--out", "{d}/x", "--recipe", "auto:4:mxnit"], "unknown family 'mxnit'"),
    (["export-mlx", "{anchor}", "--out", "{d}/x", "--refine", "--refine-lr", "nan"], "--refine-lr must be a finite"),
    (["eval", "{anchor}", "--plot", "{d}/a-file/plot.png"], "is a file, not a folder"),
]


@pytest.mark.parametrize("argv,expect", UP_FRONT, ids=[" ".join(a[0][:1] + a[0][2:]) for a in UP_FRONT])
def test_bad_values_are_one_line_exit_2_before_the_command_runs(anchor, tmp_path, capsys, monkeypatch, argv, expect):
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran: the value was not checked"))
    (tmp_path / "a-file").write_text("mine")
    one_line_exit_2([a.format(d=tmp_path, anchor=anchor) for a in argv], capsys, expect)


def test_generate_and_serve_refuse_numbers_that_never_end(tmp_path, capsys, monkeypatch):
    pytest.importorskip("mlx_lm")
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran"))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 320}))
    one_line_exit_2(["generate", str(tmp_path), "-p", "hi", "--max-tokens", "-1"], capsys, "--max-tokens must be >= 1")
    one_line_exit_2(["generate", str(tmp_path), "-p", "hi", "--temp", "nan"], capsys, "--temp must be a finite")
    one_line_exit_2(["generate", str(tmp_path), "-p", "hi", "--top-p", "0"], capsys, "--top-p must be in (0, 1]")
    one_line_exit_2(["serve", str(tmp_path), "--port", "99999"], capsys, "--port must be between 1 and 65535")
    one_line_exit_2(["serve", str(tmp_path), "--port", "-1"], capsys, "--port must be between 1 and 65535")


def test_refine_and_eval_plot_refuse_a_folder_they_cannot_write_before_the_work(anchor, tmp_path, capsys, monkeypatch):
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran"))
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access  # root writes through permission bits: the file system's answer is faked
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) in (anchor, ro) else real_access(p, m))
    one_line_exit_2(["refine", str(anchor)], capsys, f"cannot write in {anchor}")
    one_line_exit_2(["eval", str(anchor), "--plot", str(ro / "plot.png")], capsys, f"--plot {ro / 'plot.png'}: cannot")


def test_run_values_only_the_qat_config_answers_fail_before_the_model_loads(tmp_path, monkeypatch):
    from mfqat.train import loop as train_loop

    def loaded(*a, **k):
        raise AssertionError("the model loaded before the value was checked")
    monkeypatch.setattr(train_loop, "tiny_llama", loaded)
    out = tmp_path / "out"
    base = ["--model", "tiny", "--steps", "1", "--out", str(out)]
    with pytest.raises(ValueError, match="--lr-mult affine: not a family this run trains"):
        train_loop.main([*base, "--lr-mult", "affine=2"])
    with pytest.raises(ValueError, match="through a mxint8 anchor"):
        train_loop.main([*base, "--anchor-format", "mxfp4"])
    with pytest.raises(ValueError, match="through a mxint8 anchor"):
        train_loop.main([*base, "--anchor-format", "mxint4"])
    fixed = ["--qat-config", "fixed_mxint4"]  # trains no format through an anchor: reachability decides
    with pytest.raises(ValueError, match="mxfp"):
        train_loop.main([*base, *fixed, "--anchor-format", "mxfp8_e4m3"])
    with pytest.raises(ValueError, match="this run trains mxint4"):
        train_loop.main([*base, *fixed, "--anchor-format", "mxint2"])
    assert not out.exists()
    with pytest.raises(AssertionError, match="the model loaded"):  # an anchor mxint4 is sliced from: accepted
        train_loop.main([*base, *fixed, "--anchor-format", "mxint6"])


def test_seq_len_beyond_the_models_positions_and_foreign_token_ids_fail_before_the_first_step(anchor, tmp_path):
    from mfqat.train.loop import main as train_main
    from mfqat.train.setup import check_token_ids

    one = ["--steps", "1", "--batch-size", "1", "--eval-blocks", "1"]  # cheap even if the check were missing
    with pytest.raises(ValueError, match="--seq-len 257 is beyond the model's 256 positions"):
        train_main(["--model", "tiny", "--no-qat", *one, "--seq-len", "257", "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit, match="--seq-len 257 is beyond the model's 256 positions"):
        main(["mx-qlora", str(anchor), *one, "--lora-rank", "2", "--seq-len", "257", "--out", str(tmp_path / "q")])
    assert not (tmp_path / "q").exists()
    import torch

    model = tiny_llama(vocab_size=100)
    check_token_ids(model, torch.tensor([[0, 99]]))
    with pytest.raises(ValueError, match="token id 100, beyond the model's 100-token vocabulary"):
        check_token_ids(model, torch.tensor([[0, 99]]), torch.tensor([[100, 1]]))


# --- crafted files: one line, never a traceback, never executed ---------------------------------------------------

def _drop_config_key(src: Path, dst: Path, key: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg[key]
    (dst / "config.json").write_text(json.dumps(cfg))
    _reseal(dst, lambda m: None)
    return dst


def test_a_config_without_hidden_size_is_one_line_before_any_model_loads(anchor, tmp_path, capsys, monkeypatch):
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran"))
    bad = _drop_config_key(anchor, tmp_path / "bad", "hidden_size")
    expect = "config.json has no positive integer 'hidden_size'"
    one_line_exit_2(["eval", str(bad)], capsys, expect)
    one_line_exit_2(["convert", str(bad), "--out", str(tmp_path / "c")], capsys, expect)
    one_line_exit_2(["export-mlx", str(bad), "--out", str(tmp_path / "e")], capsys, expect)
    one_line_exit_2(["train", "--model", str(bad), "--out", str(tmp_path / "t")], capsys, expect)
    one_line_exit_2(["mx-qlora", str(bad), "--out", str(tmp_path / "q")], capsys, expect)


@pytest.mark.parametrize("content,expect", [
    ("formats: !!python/object/apply:os.mkdir ['{marker}']\n", "no python tags"),
    ("!!python/object/apply:os.mkdir ['{marker}']\n", "no python tags"),
    ("- mxint8\n- mxint4\n", "expected a YAML mapping of QATConfig fields"),
    ("formats: [mxint8, mxint4\n", "not a YAML QATConfig file"),
    ("\x89PNG\r\n\x1a\n\x00\xff\xfe", "not a YAML QATConfig file"),
    ("formats: [mxint8, mxint4]\nblock_size: 32.0\n", "QATConfig.block_size: expected an int"),
], ids=["tag-in-field", "tag-at-top", "a-list", "broken-yaml", "binary", "block-size-float"])
def test_a_crafted_qat_config_is_one_line_and_never_runs(tmp_path, capsys, content, expect):
    marker = tmp_path / "code-ran"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_bytes(content.format(marker=marker).encode("latin-1"))
    one_line_exit_2(["train", "--model", "tiny", "--qat-config", str(cfg), "--out", str(tmp_path / "o")], capsys,
                     expect)
    assert not marker.exists() and not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def search_checkpoint(tmp_path_factory):
    from mfqat.train.loop import main as train_main

    out = tmp_path_factory.mktemp("search") / "run"
    train_main(["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1", "--steps", "1",
                "--save-every", "1", "--out", str(out)])  # the default recipe trains the search rule: importance sums
    ck = out / "checkpoint-1"
    assert (ck / "mfqat_importance_rank0.pt").is_file()
    return ck


@pytest.mark.parametrize("crafted,expect", [
    ("not-a-dict", "expected {module: importance sums}, got list"),
    ("wrong-shape", "expected float64 (64,)"),
    ("nan", "negative, NaN or infinite"),
    ("unknown-module", "not an MF-QAT module of this model"),
    ("garbage", "not the importance sums mfqat saves"),
])
def test_a_crafted_importance_file_on_resume_is_one_line(search_checkpoint, tmp_path, capsys, crafted, expect):
    import shutil

    import torch

    from mfqat.storage.train_checkpoint import seal_checkpoint

    ck = shutil.copytree(search_checkpoint, tmp_path / "checkpoint-1")
    f = ck / "mfqat_importance_rank0.pt"
    state = torch.load(f, weights_only=True)
    name = next(iter(state))
    if crafted == "not-a-dict":
        state = [1, 2]
    elif crafted == "wrong-shape":
        state[name]["sum"] = torch.ones(3, dtype=torch.float64)
    elif crafted == "nan":
        state[name]["sum"] = torch.full_like(state[name]["sum"], float("nan"))
    elif crafted == "unknown-module":
        state["model.nope"] = state[name]
    if crafted == "garbage":
        f.write_bytes(b"\x80\x04not a torch file")
    else:
        torch.save(state, f)
    seal_checkpoint(ck, 1, extra={"run": json.loads((search_checkpoint / "mfqat_step.json").read_text())["run"]})
    one_line_exit_2(["train", "--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--eval-blocks", "1",
                      "--steps", "2", "--save-every", "1", "--resume", str(ck), "--out", str(tmp_path / "o")],
                     capsys, expect)


def test_verify_refuses_unlisted_symlinks_and_folders_in_an_anchor(anchor, tmp_path, capsys):
    import shutil

    a = shutil.copytree(anchor, tmp_path / "a")
    main(["verify", str(a)])
    capsys.readouterr()
    (a / "link.safetensors").symlink_to(a / "model.safetensors")
    one_line_exit_2(["verify", str(a)], capsys, "symlink link.safetensors not covered by the manifest")
    (a / "link.safetensors").unlink()
    (a / "extra").mkdir()
    (a / "extra" / "payload.bin").write_bytes(b"x")
    one_line_exit_2(["verify", str(a)], capsys, "folder extra not covered by the manifest")


@pytest.mark.parametrize("tied,expect", [
    ({"model.layers.0.mlp.down_proj.weight": "model.embed_tokens.weight"}, "no alias of a saved tensor"),
    ({"lm_head.weight": "lm_head.weight"}, "no alias of a saved tensor"),
    ({"lm_head.weight": "x.weight", "x.weight": "model.embed_tokens.weight"}, "no alias of a saved tensor"),
    ({"../lm_head.weight": "model.embed_tokens.weight"}, "is not a pair of parameter names"),
])
def test_tampered_tied_aliases_are_refused(anchor, tmp_path, tied, expect):
    import shutil

    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.storage.manifest import AnchorError

    a = shutil.copytree(anchor, tmp_path / "a")
    assert json.loads((a / "mfqat.json").read_text())["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    _reseal(a, lambda m: m.update(tied=tied))
    with pytest.raises(AnchorError, match=expect):
        read_anchor(a)


def _edit_weights(folder: Path, drop) -> None:
    """Rewrite each weight file of an anchor without the tensors ``drop(name)`` picks and re-seal mfqat.json (the
    weight files' hashes too): the tensors are gone as a user's tool could remove them, every hash matching."""
    import hashlib

    from safetensors.torch import load_file, save_file

    meta = json.loads((folder / "mfqat.json").read_text())
    for name in meta["files"]:
        tensors = load_file(str(folder / name))
        save_file({k: v for k, v in tensors.items() if not drop(k)}, str(folder / name), metadata={"format": "pt"})
    files = {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in meta["files"]}
    _reseal(folder, lambda m: m.update(files=files, tensors={k: e for k, e in m["tensors"].items()
                                                             if not drop(f"{k}.codes")}))


def _eval(folder: Path, plot: Path) -> list:
    """The argv of `mfqat eval FOLDER --dtype bfloat16` (the model built empty, filled tensor by tensor)."""
    return ["eval", str(folder), "--formats", "mxint4", "--blocks", "2", "--seq-len", "32", "--dtype", "bfloat16",
            "--text", str(Path(__file__).resolve().parents[1] / "README.md"), "--plot", str(plot)]


def _bump_layers(folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (folder / "config.json").write_text(json.dumps(cfg))
    _reseal(folder, lambda m: None)


@pytest.mark.parametrize("edit,expect", [
    (_bump_layers, "no value for 9 tensor(s) of the model its config.json builds (model.layers.2.self_attn.q_proj"),
    (lambda a: _edit_weights(a, lambda k: k == "model.norm.weight"), "no value for 1 tensor(s) of the model its "
     "config.json builds (model.norm.weight)"),
    (lambda a: _edit_weights(a, lambda k: k.startswith("model.layers.1.mlp.down_proj.weight.")), "no value for 1 "
     "tensor(s) of the model its config.json builds (model.layers.1.mlp.down_proj.weight)"),
], ids=["config-names-a-layer-more", "plain-tensor-dropped", "quantized-tensor-dropped"])
def test_eval_of_an_anchor_lacking_a_tensor_is_refused_before_it_runs_on_uninitialised_weights(anchor, tmp_path,
                                                                                                capsys, edit, expect):
    """`mfqat eval` builds the model without initialising it and fills it tensor by tensor: a tensor the anchor
    does not hold (every hash matching) would stay garbage memory; it is refused, named, with the anchor. The
    untouched (tied) anchor evaluates: its lm_head comes from the tie, not from the weights."""
    import shutil

    main(_eval(anchor, tmp_path / "ok.png"))
    assert "| mxint4" in capsys.readouterr().out and (tmp_path / "ok.png").is_file()
    bad = shutil.copytree(anchor, tmp_path / "bad")
    edit(bad)
    err = one_line_exit_2(_eval(bad, tmp_path / "p.png"), capsys, expect)
    assert f"mfqat eval: error: {bad}: " in err and "save or copy the anchor again" in err
    assert not (tmp_path / "p.png").exists()


def test_eval_of_a_vision_language_release_anchor_needs_every_tensor_but_a_wholly_dropped_tower(tmp_path, capsys):
    """A Qwen3.5 release's anchor evaluates in the whole VL model; with its vision tower wholly removed (a
    text-only anchor) too, the tower left unfilled (a text forward never runs it); with part of the tower or a
    language-model tensor removed it is refused naming the tensor."""
    import shutil

    import torch
    import transformers

    from mfqat.anchor.stream import anchor_from_folder

    tok = tiny_tokenizer()
    text = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                intermediate_size=128, vocab_size=len(tok))
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                  temporal_patch_size=2)
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text, vision_config=vision)
                                                 ).save_pretrained(tmp_path / "release")
    tok.save_pretrained(tmp_path / "release")
    whole = anchor_from_folder(tmp_path / "release", tmp_path / "a")

    def row(folder, plot):
        main(_eval(folder, tmp_path / plot))
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("| mxint4")]

    text_only = shutil.copytree(whole, tmp_path / "text-only")
    _edit_weights(text_only, lambda k: k.startswith("model.visual."))
    assert row(whole, "whole.png") == row(text_only, "text-only.png") != []
    part = shutil.copytree(whole, tmp_path / "part")
    _edit_weights(part, lambda k: k == "model.visual.merger.linear_fc2.weight")
    one_line_exit_2(_eval(part, tmp_path / "p.png"), capsys, "no value for 1 tensor(s) of the model its config.json "
                    "builds (model.visual.merger.linear_fc2.weight)")
    lm = shutil.copytree(whole, tmp_path / "lm")
    _edit_weights(lm, lambda k: k == "model.language_model.norm.weight")
    one_line_exit_2(_eval(lm, tmp_path / "p.png"), capsys, "(model.language_model.norm.weight)")
    assert not (tmp_path / "p.png").exists()


def test_eval_with_a_tokenizer_beyond_the_models_vocabulary_is_one_line(tmp_path, capsys):
    tok = tiny_tokenizer()
    small = mfqat.save_anchor(tiny_llama(vocab_size=len(tok) // 2, tie=True), tmp_path / "small", "mxint8", tok)
    one_line_exit_2(["eval", str(small), "--blocks", "1", "--formats", "mxint4", "--plot", str(tmp_path / "p.png")],
                     capsys, f"beyond the model's {len(tok) // 2}-token vocabulary")
    assert not (tmp_path / "p.png").exists()
    one_line_exit_2(["eval", str(small), "--blocks", "1", "--seq-len", "257", "--plot", str(tmp_path / "p.png")],
                     capsys, "--seq-len 257 is beyond the model's 256 positions")


def test_a_run_out_that_cannot_be_written_is_refused_before_the_work(anchor, tmp_path, capsys, monkeypatch):
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran"))
    real_access = os.access  # root writes through permission bits: the file system's answer is faked
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == tmp_path else real_access(p, m))
    for argv in (["train", *TINY], ["mx-qlora", str(anchor)]):
        one_line_exit_2([*argv, "--out", str(tmp_path / "new" / "run")], capsys, f"cannot write in {tmp_path}")


def test_the_trainer_callback_refuses_an_output_dir_over_the_model_it_loaded(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, TrainingArguments

    from mfqat.integrations.hf import MFQATCallback, MFQATTrainer
    from mfqat.qat import QATConfig
    from mfqat.storage.guard import UnsafeOutputError

    tok = tiny_tokenizer()
    src = tmp_path / "model"
    tiny_llama(vocab_size=len(tok)).save_pretrained(src)
    before = _files(src)
    model = mfqat.prepare(AutoModelForCausalLM.from_pretrained(src), QATConfig(formats=["mxint8"], schedule="fixed"))
    ids = torch.randint(0, len(tok), (4, 16), generator=torch.Generator().manual_seed(0))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    for out in (src, tmp_path):
        args = TrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=4, save_strategy="no",
                                 report_to=[], use_cpu=True)
        with pytest.raises(UnsafeOutputError, match="output_dir .* the input"):
            MFQATTrainer(model=model, args=args, train_dataset=ds, callbacks=[MFQATCallback()]).train()
    assert _files(src) == before
