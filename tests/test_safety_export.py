"""Issue 13 for MLX exports: refuse foreign outputs, manifest + `mfqat verify`, enforced logit check."""
import json

import pytest

import mfqat
from mfqat.cli import main as cli_main
from mfqat.data.sources import tiny_llama, tiny_tokenizer

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
from mfqat.export import mlx_export  # noqa: E402
from mfqat.export import to_mlx  # noqa: E402


def test_export_refuses_its_input_and_foreign_folders(anchor, tmp_path):
    with pytest.raises((ValueError, FileExistsError), match="input|not an mfqat"):
        to_mlx(anchor, anchor, overwrite=True)
    mfqat.read_anchor(anchor)
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="mine"):
        to_mlx(anchor, user, overwrite=True)
    assert (user / "notes.txt").read_text() == "keep"
    to_mlx(anchor, tmp_path / "m", verify=False)
    with pytest.raises(FileExistsError, match="overwrite"):
        to_mlx(anchor, tmp_path / "m", verify=False)
    to_mlx(anchor, tmp_path / "m", verify=False, overwrite=True)


def test_export_manifest_and_verify_command(anchor, tmp_path, capsys):
    out = tmp_path / "m"
    cli_main(["export-mlx", str(anchor), "--out", str(out), "--no-verify"])
    meta = json.loads((out / "mfqat_export.json").read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(meta["manifest"])
    cli_main(["verify", str(out)])
    cli_main(["verify", str(anchor)])
    assert capsys.readouterr().out.count("OK") == 2
    raw = bytearray((out / "model.safetensors").read_bytes())
    raw[-1] ^= 1  # the last tensor's last byte (a scale or bias)
    (out / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(SystemExit, match="model.safetensors: sha256 mismatch"):
        cli_main(["verify", str(out)])


def test_logit_check_is_enforced(anchor, tmp_path, monkeypatch):
    real = mlx_export._config_for_mlx
    monkeypatch.setattr(mlx_export, "_config_for_mlx", lambda c, p, a: {**real(c, p, a), "rope_theta": 1.0})
    with pytest.raises(RuntimeError, match="logits.*tolerance"):
        to_mlx(anchor, tmp_path / "m", recipe="uniform:mxint4")
    assert not (tmp_path / "m").exists() and not list(tmp_path.iterdir())


def test_ptq_temporary_anchor_lives_in_the_partial_output(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    src = tmp_path / "fp"
    tiny_llama(vocab_size=len(tok), tie=True).save_pretrained(src)
    tok.save_pretrained(src)
    seen = []
    real = mlx_export.build_plan
    monkeypatch.setattr(mlx_export, "build_plan", lambda a, *x, **k: seen.append(a.path) or real(a, *x, **k))
    to_mlx(src, tmp_path / "m", recipe="uniform:mxint4", verify=False, awq=True)  # AWQ: an anchor is saved
    assert seen[0].parent.name.startswith(".m.") and seen[0].parent.name.endswith(".partial")
    assert not any(p.name.startswith(".") or p.name == "ptq-anchor" for p in (tmp_path / "m").iterdir())
    to_mlx(src, tmp_path / "s", recipe="uniform:mxint4", verify=False)  # streamed: no anchor is written at all
    assert seen[1] == src and not (tmp_path / "s" / "ptq-anchor").exists()


def test_files_the_anchor_manifest_lacks_are_not_sealed_into_the_export(anchor, tmp_path):
    """Issue 33 item 4: a chat_template.jinja dropped into the anchor after saving is not in its manifest:
    the export leaves it out with a warning naming it (not sealed as if verified); --tokenizer DIR ships it."""
    import shutil
    planted = tmp_path / "a"
    shutil.copytree(anchor, planted)
    (planted / "chat_template.jinja").write_text("{{ 'planted' }}")
    mfqat.read_anchor(planted)  # the anchor itself still reads: its own files are intact
    with pytest.warns(UserWarning, match="chat_template.jinja not in the anchor's manifest"):
        to_mlx(planted, tmp_path / "m", verify=False)
    meta = json.loads((tmp_path / "m" / "mfqat_export.json").read_text())
    assert not (tmp_path / "m" / "chat_template.jinja").exists()
    assert "chat_template.jinja" not in meta["manifest"] and "tokenizer.json" in meta["manifest"]
    to_mlx(planted, tmp_path / "t", verify=False, tokenizer=str(planted))  # the user's explicit choice
    assert (tmp_path / "t" / "chat_template.jinja").read_text() == "{{ 'planted' }}"
