"""``export-mlx --refine``: learned affine scales and biases, codes and bytes unchanged, bit-exact export."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402

import mfqat  # noqa: E402
from mfqat.anchor.checkpoint import read_anchor  # noqa: E402
from mfqat.data.sources import calibration_blocks, tiny_llama  # noqa: E402
from mfqat.export import build_plan  # noqa: E402
from mfqat.export.mlx_files import load_weights  # noqa: E402
from mfqat.export.refine import RefineConfig, refine  # noqa: E402

SMALL = dict(steps=6, lr=3e-3, batch=2, seq_len=32, n_blocks=8, n_valid=2)


@pytest.fixture(scope="module")
def anchor(tok, tmp_path_factory):
    torch.manual_seed(0)
    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), tmp_path_factory.mktemp("refine") / "a",
                             "mxint8", tok)


@pytest.fixture(scope="module")
def exports(anchor, tmp_path_factory):
    d = tmp_path_factory.mktemp("refine_out")
    plain = mfqat.export.to_mlx(anchor, d / "plain", recipe="uniform:affine4")
    refined = mfqat.export.to_mlx(anchor, d / "refined", recipe="uniform:affine4", refine=RefineConfig(**SMALL))
    return d / "plain", plain, d / "refined", refined


def test_refine_lowers_the_kl_to_the_anchor_and_the_export_stays_bit_exact(exports):
    _, _, out, rep = exports
    r = rep["refine"]
    assert r["kept"] and r["validation_kl_after"] < r["validation_kl_before"]
    assert r["tensors"] == len(rep["tensors"])  # every affine tensor learnt
    assert rep["verify"]["weights_bit_exact"] and rep["verify"]["max_abs_logit_diff"] <= rep["verify"]["logit_tolerance"]
    assert json.loads((out / "mfqat_export.json").read_text())["refine"]["kept"]


def test_refine_keeps_every_code_and_byte_and_moves_the_scales(exports):
    plain_dir, plain, out, rep = exports
    a, b = load_weights(plain_dir), load_weights(out)
    assert sorted(a) == sorted(b)
    moved = 0
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if k.endswith(".weight"):
            assert np.array_equal(np.array(a[k].astype(mx.float32)), np.array(b[k].astype(mx.float32))), f"{k}: refine changed codes"
        elif k.endswith((".scales", ".biases")):
            moved += not np.array_equal(np.array(a[k].astype(mx.float32)), np.array(b[k].astype(mx.float32)))
    assert moved > 0, "refine wrote the derived scales and biases unchanged"
    assert rep["stored_bytes"] == plain["stored_bytes"]


def test_a_refine_that_raises_the_kl_is_not_kept(anchor, tok):
    a = read_anchor(anchor)
    plan = build_plan(a, "uniform:affine4")
    calib = calibration_blocks(tok, None, n_blocks=10, seq_len=32)
    r = refine(a, plan, calib, RefineConfig(**{**SMALL, "lr": 5.0, "steps": 3}))
    assert r["validation_kl_after"] > r["validation_kl_before"] and not r["kept"]
    assert plan.learned_scales == {}


def test_refine_without_affine_tensors_or_with_too_little_text_is_refused(anchor, tok):
    a = read_anchor(anchor)
    calib = calibration_blocks(tok, None, n_blocks=10, seq_len=32)
    with pytest.raises(ValueError, match="exported as stored"):
        refine(a, build_plan(a, "uniform:mxint8"), calib, RefineConfig(**SMALL))
    with pytest.raises(ValueError, match="10 needed"):
        refine(a, build_plan(a, "uniform:affine4"), calib[:5], RefineConfig(**SMALL))
    with pytest.raises(ValueError, match="steps must be at least 1"):
        RefineConfig(steps=0)


def test_an_exports_refine_keeps_its_codes_on_disk_in_the_staging_folder(anchor, tmp_path, monkeypatch):
    """export-mlx's refine writes the learners' codes to a file in its staging folder (beside the output, not in
    memory), and the file is not part of the export."""
    from mfqat.export import code_spill

    folders = []
    real = code_spill.CodeSpill.__init__

    def spy(self, folder):
        folders.append(Path(folder))
        real(self, folder)
    monkeypatch.setattr(code_spill.CodeSpill, "__init__", spy)
    out = tmp_path / "out"
    mfqat.export.to_mlx(anchor, out, recipe="uniform:affine4", refine=RefineConfig(**{**SMALL, "steps": 1}))
    assert len(folders) == 1 and folders[0].parent == tmp_path and folders[0] != out
    assert not [p.name for p in out.iterdir() if "refine-codes" in p.name]
