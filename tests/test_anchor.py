"""Anchor save/load, Slice-and-Scale on load, corruption and version errors."""
import json

import pytest
import torch

import mfqat
from mfqat.anchor.checkpoint import AnchorError, read_anchor
from mfqat.data.sources import tiny_llama
from mfqat.qat import QATConfig


@pytest.fixture
def prepared():
    m = tiny_llama(tie=True)
    mfqat.prepare(m, QATConfig(formats=["mxint4", "mxint8"]))
    return m


def test_round_trip_exact_and_same_greedy_tokens(prepared, tmp_path):
    path = mfqat.save_anchor(prepared, tmp_path / "a", "mxint8", step=7)
    mfqat.set_format(prepared, "mxint8")
    loaded = mfqat.load_anchor(path)
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        assert torch.equal(prepared(ids).logits, loaded(ids).logits)
    g1 = prepared.generate(ids, max_new_tokens=8, do_sample=False)
    g2 = loaded.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(g1, g2)
    meta = json.loads((path / "mfqat.json").read_text())
    assert meta["step"] == 7 and meta["anchor_format"] == "mxint8" and "lm_head.weight" in meta["tied"]
    a = read_anchor(path)
    q = mfqat.quantize(prepared.model.layers[0].mlp.up_proj.weight.detach(), "mxint8")
    assert torch.equal(a.quantized["model.layers.0.mlp.up_proj.weight"].codes, q.codes)


@pytest.mark.parametrize("fmt", ["mxint6", "mxint5", "mxint4", "mxint3", "mxint2"])
def test_lower_format_on_load_is_slice_and_scale(prepared, tmp_path, fmt):
    path = mfqat.save_anchor(prepared, tmp_path / "a", "mxint8")
    loaded = mfqat.load_anchor(path, fmt)
    w = prepared.model.layers[1].self_attn.k_proj.weight.detach()
    expect = mfqat.slice_and_scale(mfqat.quantize(w, "mxint8"), fmt).dequantize()
    assert torch.equal(loaded.model.layers[1].self_attn.k_proj.weight, expect)


def test_mxfp8_anchor_and_plain_model_ptq(tmp_path):
    m = tiny_llama()
    path = mfqat.save_anchor(m, tmp_path / "p", "mxfp8")
    loaded = mfqat.load_anchor(path, "mxfp4")
    w = m.model.layers[0].mlp.down_proj.weight.detach()
    rule = mfqat.DEFAULT_SCALE_RULE.get("mxfp4_e2m1", "floor")  # the measured default the anchor records
    expect = mfqat.slice_and_scale(mfqat.quantize(w, "mxfp8"), "mxfp4", rule).dequantize()
    assert torch.equal(loaded.model.layers[0].mlp.down_proj.weight, expect)
    assert torch.equal(loaded.lm_head.weight, m.lm_head.weight)  # not a target: kept exactly


def test_bad_requests(prepared, tmp_path):
    path = mfqat.save_anchor(prepared, tmp_path / "a", "mxint6")
    with pytest.raises(ValueError, match="cannot slice mxint6 up to mxint8"):
        mfqat.load_anchor(path, "mxint8")
    with pytest.raises(ValueError, match="stays inside one MX family"):
        mfqat.load_anchor(path, "mxfp4")


def test_truncated_and_tampered_files_refused(prepared, tmp_path):
    path = mfqat.save_anchor(prepared, tmp_path / "a", "mxint8")
    st = path / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(AnchorError, match="model.safetensors: sha256 mismatch"):
        mfqat.load_anchor(path)
    st.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(AnchorError, match="sha256 mismatch"):
        read_anchor(path)


def test_version_and_missing_files(prepared, tmp_path):
    path = mfqat.save_anchor(prepared, tmp_path / "a", "mxint8")
    meta = json.loads((path / "mfqat.json").read_text())
    meta["format_version"] = 99
    (path / "mfqat.json").write_text(json.dumps(meta))
    with pytest.raises(AnchorError, match="newer than this mfqat supports.*upgrade mfqat"):
        read_anchor(path)
    (path / "mfqat.json").unlink()
    with pytest.raises(AnchorError, match="not an mfqat anchor"):
        read_anchor(path)


def test_failed_save_leaves_previous_anchor(prepared, tmp_path):
    path = mfqat.save_anchor(prepared, tmp_path / "a", "mxint8")
    before = (path / "mfqat.json").read_text()
    with torch.no_grad():
        prepared.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight: the weight holds NaN"):
        mfqat.save_anchor(prepared, path, "mxint8")
    assert (path / "mfqat.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    read_anchor(path)


def test_sharded_anchor(prepared, tmp_path):
    path = mfqat.save_anchor(prepared, tmp_path / "s", "mxint8", max_shard_bytes=20_000)
    assert (path / "model.safetensors.index.json").is_file()
    assert len(json.loads((path / "mfqat.json").read_text())["files"]) > 1
    mfqat.set_format(prepared, "mxint8")
    ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(mfqat.load_anchor(path)(ids).logits, prepared(ids).logits)
