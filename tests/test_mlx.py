"""mfqat.mlx on MLX's CPU backend: bit-exact numerics with the PyTorch reference, MF-QAT training,
LoRA on an export, the anchor round trip PyTorch -> MLX -> PyTorch, and serving through mlx-lm."""
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mfqat
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.quant.reference import fake_quantize_reference

from .conftest import MX_FORMATS, free_port
from .test_kernels import adversarial, assert_bits_equal

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")
nn = pytest.importorskip("mlx.nn")

from mfqat.mlx import quant as mq  # noqa: E402
from mfqat.mlx.models import load_for_training  # noqa: E402
from mfqat.mlx.qat import MFQATLinear, prepare, qat_layers, set_format  # noqa: E402
from mfqat.mlx.train import apply_lora, loss_fn, save_adapters, train_steps  # noqa: E402

ALL_FORMATS = MX_FORMATS + ["nf4", "affine2", "affine4", "affine8"]
DTYPES = [(torch.float32, mx.float32), (torch.bfloat16, mx.bfloat16), (torch.float16, mx.float16)]


def to_mx(t: torch.Tensor, dtype) -> "mx.array":
    return mx.array(t.float().numpy()).astype(dtype)


def to_torch(a, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32))).to(dtype)


def finite_input(x: torch.Tensor) -> torch.Tensor:
    """NF4 / affine are defined on finite weights (mfqat refuses NaN weights before they get here)."""
    return torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-6e4, 6e4)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_qdq_and_codes_bit_exact_with_pytorch(name):
    fmt = mfqat.get_format(name)
    base = adversarial(seed=5)
    if not fmt.is_mx:
        base = finite_input(base)
    for tdt, mdt in DTYPES:
        for rule in (("floor", "ceil") if fmt.is_mx else ("floor",)):
            x = base.to(tdt)
            xm = to_mx(x, mdt)
            out = mq.qdq(xm, fmt, 32, rule)
            assert out.dtype == mdt
            ref, _ = fake_quantize_reference(x, fmt, 32, rule)
            assert_bits_equal(to_torch(out, tdt), ref, f"mlx {name} {tdt} {rule}")
            q = mfqat.quantize(x, fmt, 32, rule)
            codes, scales, biases = mq.quantize(xm, fmt, 32, rule)
            assert torch.equal(torch.from_numpy(np.array(codes)), q.codes), f"{name} {tdt} codes"
            np.testing.assert_array_equal(np.array(scales), q.scales.numpy())
            if biases is not None:
                np.testing.assert_array_equal(np.array(biases), q.biases.numpy())
            back = mq.dequantize(codes, scales, fmt, 32, biases, mdt)
            assert_bits_equal(to_torch(back, tdt), q.dequantize(), f"{name} {tdt} dequantize")


@given(name=st.sampled_from(MX_FORMATS), exponent=st.integers(-130, 120),
       values=st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=64, max_size=64))
def test_hypothesis_mlx_matches_reference(name, exponent, values):
    x = torch.tensor(np.array(values, dtype=np.float32)).reshape(2, 32) * torch.tensor(2.0 ** max(exponent, -126))
    out = mq.qdq(to_mx(x, mx.float32), name)
    ref, _ = fake_quantize_reference(x, mfqat.get_format(name), 32)
    assert_bits_equal(to_torch(out, torch.float32), ref, name)


def test_ste_forward_exact_and_gradient_identity():
    w = mx.array(np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))
    out = mq.fake_quantize(w, "mxint4")
    assert np.array_equal(np.array(out), np.array(mq.qdq(w, "mxint4")))
    g = mx.grad(lambda t: (mq.fake_quantize(t, "mxfp4") * 3.0).sum())(w)
    assert np.array_equal(np.array(g), np.full((8, 64), 3.0, np.float32))


def test_bad_block_size_is_clear():
    with pytest.raises(ValueError, match="multiple of block_size"):
        mq.qdq(mx.zeros((4, 30)), "mxint4")


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as an HF directory (float32) that mlx_lm loads."""
    d = tmp_path_factory.mktemp("tiny_hf")
    tok = tiny_tokenizer()
    # a rope_theta other than mlx-lm's default: transformers 5 stores it in rope_parameters only
    model = tiny_llama(vocab_size=len(tok), tie=True, rope_theta=500000.0)
    model.save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_export(tiny_dir, tmp_path_factory):
    """anchor (mxint8) of the tiny model and its MLX export."""
    from mfqat.export import to_mlx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path_factory.mktemp("tiny_export")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    anchor = mfqat.save_anchor(model, d / "anchor", "mxint8", AutoTokenizer.from_pretrained(tiny_dir))
    to_mlx(anchor, d / "mlx8", recipe="uniform:mxint8")
    to_mlx(anchor, d / "mlx4", recipe="uniform:mxint4")
    to_mlx(anchor, d / "mixed", recipe="seed")  # mixed-bit: 4/5/6/8-bit affine per tensor
    return d


def token_batch(seed=0, batch=4, seq=33, vocab=256):
    return mx.array(np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32))


def test_prepare_swaps_targets_and_forward_matches_qdq(tiny_dir):
    model, _, _ = load_for_training(str(tiny_dir))
    prepare(model, mfqat.QATConfig(formats=["mxint4"], schedule="fixed"))
    layers = dict(qat_layers(model))
    assert len(layers) == 2 * 7 and all(m.fmt == "mxint4" for m in layers.values())
    q = layers["model.layers.0.self_attn.q_proj"]
    x = mx.array(np.random.default_rng(1).standard_normal((3, q.weight.shape[1])).astype(np.float32))
    assert np.array_equal(np.array(q(x)), np.array(x @ mq.qdq(q.weight, "mxint4").T))
    set_format(model, None)
    assert np.array_equal(np.array(q(x)), np.array(x @ q.weight.T))


def test_mlx_forward_matches_pytorch_in_same_format(tiny_dir):
    """The MLX MF-QAT model and the PyTorch MF-QAT model give the same logits in mxint4."""
    from transformers import AutoModelForCausalLM

    model, _, _ = load_for_training(str(tiny_dir))
    prepare(model, mfqat.QATConfig(formats=["mxint4"], schedule="fixed"))
    tmodel = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    mfqat.prepare(tmodel, mfqat.QATConfig(formats=["mxint4"], schedule="fixed"))
    ids = token_batch(seq=64)
    got = np.array(model(ids))
    with torch.no_grad():
        want = tmodel(torch.from_numpy(np.array(ids)).long()).logits.numpy()
    assert np.abs(got - want).max() < 1e-3


@pytest.mark.parametrize("fmt", ["affine4", "affine3", "mxint8"])
def test_mlx_trains_the_derived_affine_family_as_pytorch_does(tiny_dir, fmt):
    """affine_joint on MLX: every layer's forward weight in affine k (derived through the MXINT8 anchor,
    bfloat16 scale and bias per group of 64) is bit for bit the PyTorch module's."""
    from transformers import AutoModelForCausalLM

    cfg = lambda: mfqat.QATConfig(formats=["mxint8", "affine4", "affine3"], schedule="joint")  # noqa: E731
    model, _, _ = load_for_training(str(tiny_dir))
    prepare(model, cfg())
    tmodel = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    mfqat.prepare(tmodel, cfg())
    set_format(model, fmt)
    mfqat.set_format(tmodel, fmt)
    tlayers = dict(tmodel.named_modules())
    layers = dict(qat_layers(model))
    assert len(layers) == 14
    for name, layer in layers.items():
        with torch.no_grad():
            want = tlayers[name].quantized_weight().numpy()
        assert np.array_equal(np.array(layer.quantized_weight()), want), name
    grads = mx.grad(lambda w: layers["model.layers.0.mlp.up_proj"]._qdq(w, fmt, "floor").sum())(
        layers["model.layers.0.mlp.up_proj"].weight)
    assert np.array_equal(np.array(grads), np.ones(grads.shape, np.float32))  # straight-through


def test_mfqat_training_reduces_loss_and_cycles_formats(tiny_dir):
    model, _, _ = load_for_training(str(tiny_dir))
    prepare(model, mfqat.QATConfig(formats=["mxint4", "mxint8"], schedule="progressive"))
    batch = token_batch()
    before = loss_fn(model, batch).item()
    seen = []
    ctl = model.mfqat_controller
    orig = ctl.set_step
    ctl.set_step = lambda m, s, n: seen.append(orig(m, s, n)) or seen[-1]
    train_steps(model, iter([batch] * 12), 12, lr=3e-3)
    assert seen[0] == "mxint4" and seen[-1] == "mxint8"
    set_format(model, "mxint4")
    assert loss_fn(model, batch).item() < before - 0.1


def test_anchor_round_trip_keeps_every_code(tiny_export, tmp_path):
    """PyTorch anchor -> MLX export -> MLX masters -> anchor again: identical codes and scales."""
    from mfqat.mlx.anchor import save_anchor

    model, _, src = load_for_training(str(tiny_export / "mlx8"))
    prepare(model, mfqat.QATConfig(formats=["mxint8"], schedule="fixed"))
    save_anchor(model, tmp_path / "back", "mxint8", source_dir=src)
    a, b = mfqat.read_anchor(tiny_export / "anchor"), mfqat.read_anchor(tmp_path / "back")
    assert set(a.quantized) == set(b.quantized) and len(a.quantized) == 14
    for k, q in a.quantized.items():
        assert torch.equal(q.codes, b.quantized[k].codes), k
        assert torch.equal(q.scales, b.quantized[k].scales), k
    loaded = mfqat.load_anchor(tmp_path / "back", fmt="mxint4")
    assert loaded.config.tie_word_embeddings


def test_mlx_trained_anchor_loads_in_pytorch(tiny_dir, tmp_path):
    from mfqat.mlx.anchor import save_anchor

    model, _, src = load_for_training(str(tiny_dir))
    prepare(model, mfqat.QATConfig(formats=["mxint4", "mxint8"]))
    train_steps(model, iter([token_batch()] * 3), 3, lr=1e-3)
    save_anchor(model, tmp_path / "a", "mxint8", source_dir=src, step=3)
    tmodel = mfqat.load_anchor(tmp_path / "a", fmt="mxint4")
    w_mlx = np.array(mq.qdq(dict(qat_layers(model))["model.layers.1.mlp.down_proj"].weight, "mxint4"))
    w_pt = tmodel.model.layers[1].mlp.down_proj.weight.detach().numpy()
    # mxint8 anchor then Slice-and-Scale to mxint4 == direct mxint4 of the mxint8 values
    direct = mfqat.quantize(torch.from_numpy(np.array(mq.qdq(dict(qat_layers(model))
                            ["model.layers.1.mlp.down_proj"].weight, "mxint8"))), "mxint4").dequantize().numpy()
    assert np.array_equal(w_pt, direct)
    assert np.abs(w_pt - w_mlx).max() <= np.abs(w_mlx).max() / 4  # same scale of values, double rounding allowed


def test_lora_on_exported_mixed_bit_model_trains_and_serves(tiny_export, tmp_path):
    model, tok = mlx_lm.load(str(tiny_export / "mixed"))
    bits = {m.bits for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert len(bits) > 1  # really mixed
    apply_lora(model, rank=4)
    trainable = [k for k, _ in __import__("mlx.utils").utils.tree_flatten(model.trainable_parameters())]
    assert trainable and all("lora_" in k for k in trainable)
    batch = token_batch()
    before = loss_fn(model, batch).item()
    train_steps(model, iter([batch] * 10), 10, lr=5e-3)
    assert loss_fn(model, batch).item() < before - 0.05
    adapters = save_adapters(model, tmp_path / "adapters", 4, 20.0, len(model.layers))
    from mfqat.mlx.serve import generate
    text = generate(str(tiny_export / "mixed"), "def f", max_tokens=4, adapter_path=str(adapters))
    assert isinstance(text, str)


def test_cli_mlx_train_and_generate(tiny_dir, tmp_path):
    from mfqat.cli import main

    out = tmp_path / "run"
    main(["mlx-train", str(tiny_dir), "--formats", "mxint4,mxint8", "--steps", "3", "--batch-size", "2",
          "--seq-len", "32", "--eval-blocks", "2", "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert {r["format"] for r in summary["eval"]} >= {"mxint8", "mxint4"}
    assert (out / "loss.png").stat().st_size > 1000
    assert mfqat.read_anchor(summary["anchor"]).format == "mxint8"


def test_cli_mlx_train_affine_joint_recipe(tiny_dir, tmp_path):
    """mlx-train trains the affine family; the evaluation defaults to the trained formats."""
    from mfqat.cli import main

    out = tmp_path / "run"
    main(["mlx-train", str(tiny_dir), "--qat-config", "affine_joint", "--steps", "2", "--batch-size", "2",
          "--seq-len", "32", "--eval-blocks", "2", "--out", str(out)])
    rows = {r["format"]: r for r in json.loads((out / "summary.json").read_text())["eval"]}
    assert set(rows) == {"mxint8", "affine4", "affine3", "fp (master)"} and rows["affine4"]["bits/weight"] == 4.5


def test_serve_answers_openai_completions(tiny_export):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "mfqat.cli", "serve", str(tiny_export / "mlx4"), "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        body = json.dumps({"prompt": "def f", "max_tokens": 4}).encode()
        deadline = time.monotonic() + 600  # a hang guard only: the wait ends when it answers or exits
        reply = None
        while reply is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
            except OSError:
                time.sleep(0.5)
        assert reply is not None, f"mfqat serve exited ({proc.poll()}) or hung before it answered"
        assert reply["choices"][0]["text"] is not None
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_missing_mlx_message(monkeypatch):
    from mfqat.cli import app as cli

    monkeypatch.setitem(sys.modules, "mlx_lm", None)
    with pytest.raises(SystemExit, match="pip install 'mfqat\\[mlx\\]'"):
        cli._mlx()
