"""Learned scales kept in the anchor (``mfqat refine``, format version 4): one anchor reproduces every width
with its learned scales code for code, through load_anchor and export-mlx, and a damaged file is refused."""
import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402

import mfqat  # noqa: E402
from mfqat.anchor.checkpoint import read_anchor  # noqa: E402
from mfqat.data.sources import tiny_llama, tiny_tokenizer  # noqa: E402
from mfqat.export.mlx_files import load_weights  # noqa: E402
from mfqat.export.refine import RefineConfig, refine_anchor  # noqa: E402
from mfqat.quant.derive import derive  # noqa: E402
from mfqat.storage.manifest import AnchorError  # noqa: E402

SMALL = RefineConfig(steps=6, lr=3e-3, batch=2, seq_len=32, n_blocks=8, n_valid=2)
NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def refined(tmp_path_factory):
    """(plain anchor, the same anchor with affine4 and affine3 refined at group 32, the refine rows)."""
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("anchor_refined")
    torch.manual_seed(0)
    plain = mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), root / "plain", "mxint8", tok)
    shutil.copytree(plain, root / "refined")
    (root / "refined" / "notes.txt").write_text("added by hand, never sealed")
    rows = refine_anchor(root / "refined", ["affine4", "affine3"], group_size=32, cfg=SMALL)
    return plain, root / "refined", rows


def test_the_anchor_stores_each_width_it_learned_and_load_anchor_uses_it(refined):
    plain, path, rows = refined
    assert [r["format"] for r in rows] == ["affine4", "affine3"] and all(r["stored"] for r in rows)
    assert all(r["validation_kl_after"] < r["validation_kl_before"] for r in rows)
    meta = json.loads((path / "mfqat.json").read_text())
    assert meta["format_version"] == 4 and set(meta["refined"]) == {"affine4", "affine3"}
    assert meta["refined"]["affine4"]["file"] in meta["manifest"] and "notes.txt" not in meta["manifest"]
    a, p = read_anchor(path), read_anchor(plain)
    for fmt in ("affine4", "affine3"):
        learned, derived = a.in_format(fmt, 32)[NAME], derive(p.quantized[NAME].dequantize(torch.float32), fmt, 32)
        assert torch.equal(learned.codes, derived.codes)  # codes are the derived ones
        s, b = a.learned_scales[fmt].scales[NAME]
        assert torch.equal(learned.scales, s.float()) and torch.equal(learned.biases, b.float())
        assert not torch.equal(learned.scales, derived.scales)  # and the scales are the learned ones
        model = mfqat.load_anchor(path, fmt, group_size=32)
        assert torch.equal(model.get_parameter(NAME).detach(), learned.dequantize(torch.float32))
    assert torch.equal(a.in_format("affine4", 64)[NAME].scales, p.in_format("affine4", 64)[NAME].scales)  # other group
    assert torch.equal(a.in_format("nvfp4")[NAME].scales, p.in_format("nvfp4")[NAME].scales)  # other derived formats


def test_an_export_of_a_refined_width_ships_the_stored_scales_bit_exact(refined, tmp_path):
    _, path, _ = refined
    rep = mfqat.export.to_mlx(path, tmp_path / "mlx", recipe="uniform:affine4", group_size=32)
    assert rep["anchor_refined"] == ["affine4"] and rep["verify"]["weights_bit_exact"]
    s, b = read_anchor(path).learned_scales["affine4"].scales[NAME]
    w = load_weights(tmp_path / "mlx")
    got = np.array(w[NAME.replace(".weight", ".scales")].astype(mx.float32))
    assert np.array_equal(got, s.float().numpy())
    assert np.array_equal(np.array(w[NAME.replace(".weight", ".biases")].astype(mx.float32)), b.float().numpy())


def test_a_changed_refined_file_is_refused_by_name(refined, tmp_path):
    _, path, _ = refined
    bad = shutil.copytree(path, tmp_path / "bad")
    f = bad / json.loads((bad / "mfqat.json").read_text())["refined"]["affine3"]["file"]
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(AnchorError, match=f.name):
        read_anchor(bad)
    from mfqat.storage.manifest import canonical_digest

    unlisted = shutil.copytree(path, tmp_path / "unlisted")  # a width file the manifest does not vouch for
    meta = json.loads((unlisted / "mfqat.json").read_text())
    del meta["manifest"][meta["refined"]["affine3"]["file"]]
    meta["digest"] = canonical_digest(meta)
    (unlisted / "mfqat.json").write_text(json.dumps(meta))
    with pytest.raises(AnchorError, match="refined-affine3-[0-9a-f]+.safetensors is not in the manifest"):
        read_anchor(unlisted)


def test_a_width_file_renamed_for_its_new_bytes_is_refused_by_the_manifest(refined, tmp_path):
    """Changed bytes under a name that matches them (mfqat.json edited and re-digested, the manifest's sha256
    left as it was): the name check passes, the manifest's hash must refuse it."""
    import hashlib

    from mfqat.anchor.learned_scales import learned_scales_file
    from mfqat.storage.manifest import canonical_digest

    _, path, _ = refined
    bad = shutil.copytree(path, tmp_path / "renamed")
    meta = json.loads((bad / "mfqat.json").read_text())
    old = meta["refined"]["affine3"]["file"]
    data = bytearray((bad / old).read_bytes())
    data[-3] ^= 0xFF
    digest = hashlib.sha256(data).hexdigest()[:12]
    new = learned_scales_file("affine3").replace(".safetensors", f"-{digest}.safetensors")
    (bad / new).write_bytes(bytes(data))
    (bad / old).unlink()
    meta["manifest"][new] = meta["manifest"].pop(old)
    meta["refined"]["affine3"]["file"] = new
    meta["digest"] = canonical_digest(meta)
    (bad / "mfqat.json").write_text(json.dumps(meta))
    with pytest.raises(AnchorError, match=new):
        read_anchor(bad)


def test_a_stored_width_is_replaced_only_with_overwrite_and_mx_widths_are_refused(refined):
    _, path, _ = refined
    before = (path / "mfqat.json").read_bytes()
    with pytest.raises(FileExistsError, match="--overwrite"):
        refine_anchor(path, ["affine4"], group_size=32, cfg=SMALL)
    with pytest.raises(ValueError, match="not an affine width"):
        refine_anchor(path, ["mxint4"], group_size=32, cfg=SMALL)
    assert (path / "mfqat.json").read_bytes() == before


def test_refined_needs_format_version_4(refined, tmp_path):
    from mfqat.storage.manifest import canonical_digest

    _, path, _ = refined
    old = shutil.copytree(path, tmp_path / "old")
    meta = json.loads((old / "mfqat.json").read_text())
    meta["format_version"] = 3
    meta["digest"] = canonical_digest(meta)
    (old / "mfqat.json").write_text(json.dumps(meta))
    with pytest.raises(AnchorError, match="'refined' needs format version 4"):
        read_anchor(old)


def test_the_refine_command_stores_a_width_and_prints_the_table(refined, tmp_path, capsys):
    from mfqat.cli import main

    plain, _, _ = refined
    target = shutil.copytree(plain, tmp_path / "a")
    calib = tmp_path / "calib.txt"
    calib.write_text("a calibration text of its own " * 400)
    main(["refine", str(target), "--formats", "affine2", "--group-size", "32", "--steps", "3", "--lr", "3e-3",
          "--calib-text", f"{calib}:1,generated:1"])  # generated: sampled from the anchor being refined
    out = capsys.readouterr().out
    assert "| affine2 | 32" in out and "validation KL before" in out
    manifest = (target / "mfqat.json").read_text()
    assert "affine2" in json.loads(manifest).get("refined", {}) or "no (not lower)" in out
    assert "calibration text of its own" not in manifest  # described (size, hash), not copied in
    with pytest.raises(SystemExit) as e:
        main(["refine", str(target), "--formats", "mxint4"])
    assert e.value.code == 2 and "not an affine width" in capsys.readouterr().err


def test_overwrite_replaces_a_width_and_removes_its_old_file(refined, tmp_path):
    _, path, _ = refined
    a = shutil.copytree(path, tmp_path / "a")
    old = json.loads((a / "mfqat.json").read_text())["refined"]["affine4"]["file"]
    (a / "refined-affine4-orphan.safetensors").write_bytes(b"left by a crash")
    rows = refine_anchor(a, ["affine4"], group_size=32, cfg=RefineConfig(**{**SMALL.__dict__, "seed": 1}),
                         overwrite=True)
    meta = json.loads((a / "mfqat.json").read_text())
    assert rows[0]["stored"] and meta["refined"]["affine4"]["file"] != old and old not in meta["manifest"]
    assert not (a / old).exists() and not (a / "refined-affine4-orphan.safetensors").exists()
    new, first = read_anchor(a).learned_scales["affine4"], read_anchor(path).learned_scales["affine4"]
    assert new.scales[NAME][0].shape == first.scales[NAME][0].shape


def test_values_learned_on_other_weights_are_refused(refined, tmp_path, monkeypatch):
    """An anchor saved again while refine learns holds other codes: the learned scales would decode them
    wrongly, so they are not stored."""
    import mfqat.export.refine as refine_mod

    plain, _, _ = refined
    a = shutil.copytree(plain, tmp_path / "a")
    real = refine_mod.apply_refine

    def resave_while_learning(anchor, plan, *args, **kw):
        report = real(anchor, plan, *args, **kw)
        mfqat.save_anchor(tiny_llama(vocab_size=len(tiny_tokenizer()), tie=True, seed=1), a, "mxint8", tiny_tokenizer(),
                          overwrite=True)
        return report

    monkeypatch.setattr(refine_mod, "apply_refine", resave_while_learning)
    with pytest.raises(ValueError, match="weights changed while refine was learning"):
        refine_anchor(a, ["affine4"], group_size=32, cfg=SMALL)
    assert "refined" not in json.loads((a / "mfqat.json").read_text())
