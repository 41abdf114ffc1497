"""Derived affine formats (mfqat.quant.derive, issue 17 item 3): MLX's own affine layout re-quantized from an
MXINT8 anchor. MF-QAT trains through the derivation, the anchor reproduces it bit for bit, and the
MLX export stores mx.quantize's codes of the anchor's values at mlx_lm's cost (4.5 bits at g64)."""
import json

import numpy as np
import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.quant.derive import derive_affine
from mfqat.export import to_mlx
from mfqat.export.mlx_export import load_weights
from mfqat.qat.config import QATConfig

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(model prepared with mxint8 + affine4 + affine3 through the anchor, embeddings too (tied: the
    lm_head must see the quantized table, as the anchor gives it), its anchor, ids)."""
    d = tmp_path_factory.mktemp("derive")
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), hidden=128, intermediate=256, tie=True)
    mfqat.prepare(model, QATConfig(formats=["mxint8", "affine4", "affine3"], quantize_embeddings=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    for fmt in ("mxint8", "affine4", "affine3"):  # a few real updates so the weights leave init
        mfqat.set_format(model, fmt)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    mfqat.save_anchor(model, d / "anchor", "mxint8", tok)
    return model, d / "anchor", ids


@pytest.mark.parametrize("fmt", ["affine4", "affine3", "mxint8"])
def test_training_forward_equals_the_anchors_derived_weights(trained, fmt):
    model, anchor, ids = trained
    mfqat.set_format(model, fmt)
    with torch.no_grad():
        want = model(ids).logits
        got = mfqat.load_anchor(anchor, fmt=fmt)(ids).logits
    assert torch.equal(got, want), f"{fmt}: max diff {(got - want).abs().max()}"


def test_derivation_is_mx_quantize_of_the_anchor_values(trained):
    """The derived codes are exactly mx.quantize(bfloat16(anchor values), 64, k); dequantized as MLX does."""
    _, anchor, _ = trained
    a = mfqat.read_anchor(anchor)
    name = next(iter(a.quantized))
    values = a.quantized[name].dequantize(torch.float32)
    for bits in (4, 3):
        q = derive_affine(values, f"affine{bits}", 64)
        wq, s, b = mx.quantize(mx.array(values.numpy()).astype(mx.bfloat16), group_size=64, bits=bits)
        want = np.array(mx.dequantize(wq, s, b, group_size=64, bits=bits).astype(mx.float32))
        np.testing.assert_array_equal(q.dequantize(torch.float32).numpy(), want)


def test_uniform_affine4_export_is_mlx_lm_layout_and_loads(trained, tmp_path):
    model, anchor, ids = trained
    out = tmp_path / "a4"
    rep = to_mlx(anchor, out, recipe="uniform:affine4", group_size=64)
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    assert (cfg["group_size"], cfg["bits"], cfg["mode"]) == (64, 4, "affine")
    w = load_weights(out)
    scales = [k for k in w if k.endswith(".scales")]
    assert scales and all(w[k].dtype == mx.bfloat16 for k in scales)
    assert rep["stored_bits_per_weight_quantized"] == 4.5  # 4 + (bf16 scale + bias) / 64
    assert rep["verify"]["weights_bit_exact"]
    m, _ = mlx_lm.load(str(out))
    mfqat.set_format(model, "affine4")
    with torch.no_grad():
        pt = model(ids[:1]).logits[0, -1].argmax().item()
    assert int(np.array(m(mx.array(ids[:1].numpy()))[0, -1].argmax())) == pt


def test_seed_affine_plan_and_refusals(trained, tmp_path):
    _, anchor, _ = trained
    rep = to_mlx(anchor, tmp_path / "seed", recipe="seed:affine", verify=False)
    src = {n: t["source"] for n, t in rep["tensors"].items() if "source" in t}
    assert any(s == "affine4" for s in src.values()) and any("o_proj" in n and s == "affine8" for n, s in src.items())
    with pytest.raises(ValueError, match="affine_group_size"):
        QATConfig(formats=["mxint8", "affine4"], affine_group_size=48)
    with pytest.raises(ValueError, match="below the smallest plan"):
        to_mlx(anchor, tmp_path / "auto", recipe="auto:2.4:affine", calib_text="def f(x): return x\n" * 200)
    assert not (tmp_path / "auto").exists()


def test_auto_affine_mixes_widths_within_the_budget_in_mlx_lm_bytes(trained, tmp_path):
    """auto:BPW:affine counts the bf16 scale and bias of every 64-group: a 4.75 budget holds a mix of
    affine widths whose files are no bigger than mlx_lm.convert's at 4.75 bits, and MLX loads it."""
    _, anchor, ids = trained
    out = tmp_path / "auto"
    rep = to_mlx(anchor, out, recipe="auto:4.75:affine", calib_text="def f(x):\n    return x + 1\n" * 300)
    chosen = {t["source"] for t in rep["tensors"].values() if "source" in t}
    assert len(chosen) > 1 and all(f.startswith("affine") for f in chosen), chosen
    assert rep["bits_per_weight"] <= 4.75 and rep["verify"]["weights_bit_exact"]
    sens = json.loads((out / "sensitivity.json").read_text())
    assert sens["group_size"] == 64 and sens["probe_format"] == "affine3"
    w = load_weights(out)
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    per_module = {k: v for k, v in cfg.items() if isinstance(v, dict)}
    assert per_module and all(v["group_size"] == 64 for v in per_module.values())
    a = mfqat.read_anchor(anchor)
    for name, t in rep["tensors"].items():  # each tensor: mx.quantize of the anchor's values at its width
        if name in a.quantized and "source" in t:
            bits = int(t["source"][len("affine"):])
            key = name[: -len(".weight")]
            values = mx.array(a.quantized[name].dequantize(torch.float32).numpy()).astype(mx.bfloat16)
            wq, s, b = mx.quantize(values, group_size=64, bits=bits)
            assert np.array_equal(np.array(w[key + ".weight"]), np.array(wq)), name
    m, _ = mlx_lm.load(str(out))
    assert m(mx.array(ids[:1].numpy())).shape[-1] == len(tiny_tokenizer())
