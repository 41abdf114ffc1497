"""scripts/bench/mlx_lm_learned.py: mlx-lm's GPTQ, AWQ, dynamic_quant and DWQ run offline on a tiny
Llama, through their own functions, with the pydoc training split as calibration text."""
import json
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import mlx_lm_learned  # noqa: E402

from mfqat.data.sources import tiny_llama, tiny_tokenizer  # noqa: E402
from mfqat.eval.mlx_weights import mlx_lm_convert, mlx_weights_as_torch, stored_bits  # noqa: E402

TINY = {"gptq": dict(num_samples=8, sequence_length=64, batch_size=4),
        "awq": dict(num_samples=4, sequence_length=64, n_grid=4),
        "dynamic": dict(num_samples=8, sequence_length=64, target_bpw=4.7),
        "dwq": dict(num_samples=8, max_seq_length=33, num_valid_samples=4, learning_rate=1e-4)}


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_master")
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), tie=True)
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No download: urllib refuses, and HOME is empty (mlx-lm's calibration cache is not there)."""
    def refuse(*a, **k):
        raise AssertionError("mlx-lm tried to download its calibration data")

    monkeypatch.setattr(urllib.request, "urlretrieve", refuse)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("name", ["gptq", "awq", "dynamic", "dwq"])
def test_method_runs_offline_and_saves_a_loadable_folder(name, master, offline, tmp_path):
    settings = {**mlx_lm_learned.METHODS[name], **TINY[name]}
    rec = mlx_lm_learned.quantize(name, master, tmp_path / name, settings)
    assert not (offline / ".cache" / "mlx-lm").exists()
    assert rec["settings"] == settings and json.loads((tmp_path / name / "mlx_lm_learned.json").read_text()) == rec
    cfg = json.loads((tmp_path / name / "config.json").read_text())["quantization"]
    assert cfg["bits"] == 4 or name == "awq"
    weights = mlx_weights_as_torch(tmp_path / name)  # every stored weight dequantizes
    assert "model.embed_tokens.weight" in weights
    from mlx_lm import load

    load(str(tmp_path / name))
    if name == "dwq":
        assert rec["steps"] == 2 and len(rec["validation_kl"]) == 2


def test_four_bit_methods_store_mlx_lm_convert_q4_g64_bytes(master, offline, tmp_path):
    """GPTQ, AWQ and DWQ at their METHODS settings are stored at exactly convert -q's size (bfloat16
    scales, biases and norms; 4-bit group-64 embedding)."""
    n = sum(t.numel() for t in tiny_llama(vocab_size=len(tiny_tokenizer()), tie=True).parameters())
    ref = stored_bits(mlx_lm_convert(master, tmp_path / "q4", q_bits=4, q_group_size=64), n)
    for name in ("gptq", "awq", "dwq"):
        mlx_lm_learned.quantize(name, master, tmp_path / name, {**mlx_lm_learned.METHODS[name], **TINY[name]})
        assert abs(stored_bits(tmp_path / name, n) - ref) < 0.01, name


def test_parse_spec_overrides_and_refuses_unknown_settings():
    name, s = mlx_lm_learned.parse_spec("dynamic:target_bpw=5.0:num_samples=8")
    assert name == "dynamic" and s["target_bpw"] == 5.0 and s["num_samples"] == 8
    with pytest.raises(SystemExit):
        mlx_lm_learned.parse_spec("gptq:lr=1")
    with pytest.raises(SystemExit):
        mlx_lm_learned.parse_spec("rtn")


def test_slow_blas_is_refused_for_awq_and_dwq_only():
    slow = {"reference_gflops": 2.0, "openblas_gflops": None, "preload": None}
    mlx_lm_learned.require_fast_blas(["gptq", "dynamic"], slow, allow_slow=False)
    mlx_lm_learned.require_fast_blas(["awq"], slow, allow_slow=True)
    with pytest.raises(SystemExit, match="libopenblas0-pthread"):
        mlx_lm_learned.require_fast_blas(["dwq"], slow, allow_slow=False)
    mlx_lm_learned.require_fast_blas(["awq", "dwq"], {**slow, "openblas_gflops": 40.0, "preload": "/x.so"}, False)


def test_blas_check_agrees_within_float_tolerance():
    check = mlx_lm_learned.blas_check()
    assert check["reference_gflops"] > 0
    if check["openblas"] is None:
        pytest.skip("libopenblas0-pthread is not installed")
    assert check["agree"], check
    assert check["max_rel_diff_openblas_vs_reference"] < 1e-5
