"""MLX export on a tiny random Llama: every format and mixed plans load in mlx_lm, generate, match."""
import json

import numpy as np
import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.export import to_mlx

from .test_export_exact import assert_same_greedy_generation, check_weights_independently, pytorch_reference

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")


@pytest.fixture(scope="module")
def anchors(tmp_path_factory):
    d = tmp_path_factory.mktemp("anchors")
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), tie=True)
    return {fam: mfqat.save_anchor(model, d / fam, fmt, tok)
            for fam, fmt in (("int", "mxint8"), ("fp", "mxfp8"))}


@pytest.mark.parametrize("recipe", ["uniform:mxint8", "uniform:mxint7", "uniform:mxint6", "uniform:mxint5",
                                    "uniform:mxint4", "uniform:mxint3", "uniform:mxint2", "seed"])
def test_mxint_exports(anchors, tmp_path, recipe):
    rep = to_mlx(anchors["int"], tmp_path / "m", recipe=recipe)
    assert check_weights_independently(anchors["int"], tmp_path / "m", rep) == 15  # 14 Linears + tied embedding
    assert rep["verify"]["max_abs_logit_diff"] < 1e-4  # float32 scales: MLX computes in float32 (observed ~1e-6)
    assert_same_greedy_generation(tmp_path / "m", pytorch_reference(anchors["int"], report=rep),
                                  "def f(x):\n    return", n_new=5)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and "rope_theta" in cfg
    assert cfg["quantization"]["group_size"] == 32 and "mode" in cfg["quantization"]


@pytest.mark.parametrize("recipe", ["uniform:mxfp8", "uniform:mxfp6_e2m3", "uniform:mxfp6_e3m2",
                                    "uniform:mxfp4", "seed"])
def test_mxfp_exports(anchors, tmp_path, recipe):
    rep = to_mlx(anchors["fp"], tmp_path / "m", recipe=recipe)
    assert check_weights_independently(anchors["fp"], tmp_path / "m", rep) == 15
    assert rep["verify"]["max_abs_logit_diff"] < 1e-4  # the check runs MLX's bfloat16 MXFP embedding in float32
    meta = json.loads((tmp_path / "m" / "mfqat_export.json").read_text())
    assert meta["tensors"].keys() == rep["tensors"].keys()


def test_affine_words_match_mlx_dequantize_directly(anchors):
    a = mfqat.read_anchor(anchors["int"])
    name, q = next(iter(a.quantized.items()))
    from mfqat.export.mlx_export import to_mlx_storage
    for k in (2, 3, 4, 5, 6, 7):
        low = mfqat.slice_and_scale(q, f"mxint{k}")
        st = to_mlx_storage(low)
        got = mx.dequantize(mx.array(st.weight), mx.array(st.scales), mx.array(st.biases), group_size=32, bits=st.bits)
        assert np.array_equal(np.array(got), low.dequantize().numpy())


def test_bad_plans_fail_before_writing(anchors, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(ValueError, match="unknown recipe"):
        to_mlx(anchors["int"], out, recipe="fancy")
    with pytest.raises(ValueError, match="stays inside one MX family"):
        to_mlx(anchors["int"], out, recipe="uniform:mxfp4")
    with pytest.raises(ValueError, match="unknown format"):
        to_mlx(anchors["int"], out, recipe="uniform:mxint9")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_mlx_lm_lora_runs_on_export(anchors, tmp_path):
    from mlx_lm.tuner.utils import linear_to_lora_layers
    import mlx.nn as nn
    import mlx.optimizers as optim

    to_mlx(anchors["int"], tmp_path / "m", recipe="uniform:mxint4")
    model, tok = mlx_lm.load(str(tmp_path / "m"))
    model.freeze()
    mx.random.seed(0)  # the adapters' random init (unseeded, 5 Adam steps at lr 1e-2 once raised the loss)
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    ids = mx.array([tok.encode("def function(x): return x + 1")])

    def loss_fn(m):
        logits = m(ids[:, :-1])
        return nn.losses.cross_entropy(logits, ids[:, 1:]).mean()

    opt = optim.Adam(learning_rate=1e-3)
    grad = nn.value_and_grad(model, loss_fn)
    losses = []
    for _ in range(5):
        loss, g = grad(model)
        opt.update(model, g)
        mx.eval(model.parameters(), opt.state)
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_allocate_gives_bits_to_sensitive_tensors_within_budget():
    from mfqat.export.sensitivity import TensorSensitivity, allocate, ladder

    levels = ladder("mxint8")
    errs = {f: 4.0 ** -i for i, f in enumerate(levels)}  # error falls 4x per level
    sens = {"a": TensorSensitivity("a", 1000, "mxint3", 10.0, dict(errs)),
            "b": TensorSensitivity("b", 1000, "mxint3", 0.01, dict(errs))}
    plan = allocate(sens, levels, budget_bpw=5.25)
    bits = {n: mfqat.get_format(f).bits for n, f in plan.items()}
    assert bits["a"] > bits["b"]
    used = sum(mfqat.get_format(f).bits_per_weight(32) for f in plan.values()) / 2
    assert used <= 5.25
    with pytest.raises(ValueError, match="below the smallest plan"):
        allocate(sens, levels, budget_bpw=2.0)


def test_auto_recipe_meets_budget_and_writes_sensitivities(anchors, tmp_path):
    from mfqat.data.sources import pydoc_text

    rep = to_mlx(anchors["int"], tmp_path / "m", recipe="auto:6.75", calib_text=pydoc_text()[:20000])
    assert check_weights_independently(anchors["int"], tmp_path / "m", rep) == 15
    assert rep["verify"]["max_abs_logit_diff"] < 1e-4
    assert 2.25 <= rep["bits_per_weight"] and rep["stored_bits_per_weight"] <= 6.75  # float32 scales: mxint4 stores 6
    sens = json.loads((tmp_path / "m" / "sensitivity.json").read_text())
    assert sens["probe_format"] == "mxint3" and len(sens["tensors"]) == 15
    assert all(t["probe_kl"] >= 0 and t["chosen"].startswith("mxint") for t in sens["tensors"].values())
    assert len({t["chosen"] for t in sens["tensors"].values()}) > 1  # really mixed
    assert_same_greedy_generation(tmp_path / "m", pytorch_reference(anchors["int"], report=rep), "def f", n_new=3)


def test_auto_recipe_rejects_bad_budget(anchors, tmp_path):
    with pytest.raises(ValueError, match="bits per weight"):
        to_mlx(anchors["int"], tmp_path / "x", recipe="auto:lots")
    assert not (tmp_path / "x").exists()


def test_bfloat16_scales_and_sharding(anchors, tmp_path):
    """bf16 affine scales are exact for power-of-two MX scales; big exports shard with an index."""
    rep = to_mlx(anchors["int"], tmp_path / "m", recipe="seed", scale_dtype="bfloat16", max_shard_bytes=40_000)
    assert check_weights_independently(anchors["int"], tmp_path / "m", rep) == 15
    assert rep["verify"]["mlx_compute"] == "float32-upcast"  # bf16 scales: checked upcast (LOGIT_RTOL)
    assert rep["verify"]["max_abs_logit_diff"] < 1e-4  # the reference dequantizes in the same float32 arithmetic
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "m").glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    from mfqat.export.mlx_export import load_weights
    w = load_weights(tmp_path / "m")
    scales = {k: v.dtype for k, v in w.items() if k.endswith(".scales")}
    assert mx.bfloat16 in scales.values() and mx.uint8 not in scales.values()  # affine only: all bf16
    model, tok = mlx_lm.load(str(tmp_path / "m"))
    assert isinstance(mlx_lm.generate(model, tok, prompt="def f", max_tokens=3), str)


def test_awq_keeps_the_fp_model_and_exports(tmp_path):
    """AWQ scaling leaves the full-precision function unchanged, then exports through the PTQ path."""
    from mfqat.data.sources import calibration_blocks
    from mfqat.export.awq import apply_awq

    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), tie=True)
    ids = calibration_blocks(tok, None, n_blocks=2, seq_len=32)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    stats = apply_awq(model, ids)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert len(stats) == 2 * 4  # heads == kv heads here: v -> o is scaled too
    assert any(v["s_max"] > 1.01 for v in stats.values())
    assert torch.allclose(before, after, atol=1e-4, rtol=1e-4)
    src = tmp_path / "fp"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    rep = to_mlx(src, tmp_path / "m", recipe="uniform:mxint4", awq=True)
    assert rep["verify"]["weights_bit_exact"] and "awq" in rep


def test_awq_refuses_an_anchor(anchors, tmp_path):
    with pytest.raises(ValueError, match="post-training step"):
        to_mlx(anchors["int"], tmp_path / "m", recipe="uniform:mxint4", awq=True)
