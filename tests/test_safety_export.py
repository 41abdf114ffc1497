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
    from mfqat.export.refine import RefineConfig
    # a refine reads every tensor at every step: the PTQ anchor is written, inside the partial output
    to_mlx(src, tmp_path / "m", recipe="uniform:affine4", verify=False, refine=RefineConfig(steps=1, n_blocks=2))
    assert seen[0].parent.name.startswith(".m.") and seen[0].parent.name.endswith(".partial")
    assert not any(p.name.startswith(".") or p.name == "ptq-anchor" for p in (tmp_path / "m").iterdir())
    to_mlx(src, tmp_path / "s", recipe="uniform:mxint4", verify=False)  # streamed: no anchor is written at all
    assert seen[1] == src and not (tmp_path / "s" / "ptq-anchor").exists()
    to_mlx(src, tmp_path / "w", recipe="uniform:mxint4", verify=False, awq=True)  # AWQ streams too
    assert seen[2] == src and not (tmp_path / "w" / "ptq-anchor").exists()


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


def test_the_upcast_logit_check_catches_a_rope_theta_the_old_ten_percent_let_through(tmp_path, monkeypatch):
    """transformers 5 nests rope_theta in rope_parameters; an export that forgot to copy it out
    (mfqat.models.family._copy_rope) would run mlx-lm's qwen2 default of 1e6 instead of 10000. On a tiny
    Qwen2 (initializer_range 0.04: logits near 1) exported at affine4 (bfloat16 scales: the float32-upcast
    check) that moves the logits by ~3.8% of max |logit| and changes 8% of the next-token argmaxes: a broken
    model, which the old tolerance (10% of max |logit|) passed. A correct export differs by ~5e-7."""
    from mfqat.export import verify
    from mfqat.models import family
    from mfqat.models.catalog import SUPPORTED, build

    tok = tiny_tokenizer()
    model_type, extra = SUPPORTED["qwen2"]
    anchor = mfqat.save_anchor(build(model_type, {**extra, "initializer_range": 0.04}, len(tok)),
                               tmp_path / "a", "mxint8", tok)
    monkeypatch.setattr(family, "_copy_rope", lambda cfg: cfg)  # the bug: rope keys left where mlx-lm never looks
    with monkeypatch.context() as old:
        old.setitem(verify.LOGIT_RTOL, "float32-upcast", 0.1)
        v = to_mlx(anchor, tmp_path / "old", recipe="uniform:affine4")["verify"]
    assert "rope_theta" not in json.loads((tmp_path / "old" / "config.json").read_text())  # really planted
    ratio = v["max_abs_logit_diff"] / (v["logit_tolerance"] / 0.1)  # / max(1, max |logit|)
    assert v["mlx_compute"] == "float32-upcast" and 0.01 < ratio < 0.1 and v["argmax_agreement"] < 1
    for budget in (None, 1):  # the whole-model check and the cut check (compare_truncated)
        with pytest.raises(RuntimeError, match="export check failed: the logits .* above the tolerance"):
            to_mlx(anchor, tmp_path / "new", recipe="uniform:affine4", max_memory=budget)
        assert not (tmp_path / "new").exists()


def test_mxfp_embeddings_run_in_float32_in_the_logit_check(tmp_path):
    """MLX dequantizes MXFP/NVFP4 embeddings to bfloat16. OLMo2's first projection reads the embedding with no
    norm between, so the check's MLX model computed in bfloat16 from there: a valid tiny OLMo2 mxfp8 export
    failed the float32 check (7.3e-3 > 1e-3). The check makes those embeddings return float32 (the values are
    exact in bfloat16), and the export passes at ~3e-7."""
    from mfqat.models.catalog import SUPPORTED, build

    tok = tiny_tokenizer()
    model_type, extra = SUPPORTED["olmo2"]
    anchor = mfqat.save_anchor(build(model_type, extra, len(tok)), tmp_path / "a", "mxfp8", tok)
    for recipe in ("uniform:mxfp8", "uniform:nvfp4"):
        v = to_mlx(anchor, tmp_path / recipe[8:], recipe=recipe)["verify"]
        assert v["mlx_compute"] == "float32" and v["max_abs_logit_diff"] < 1e-5, (recipe, v)
