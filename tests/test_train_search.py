"""Issue 12 item 4 inside training: the ``search`` scale rule, trained through the anchor and stored in it.

A model trained with ``scale_rules: {mxint4: search, ...}`` records each Linear's input importance in
its anchor-format forwards, lowers mxint6..mxint3 by the importance-weighted per-block exponent
search, and ``save_anchor`` stores the importance so that ``load_anchor`` gives the same weights.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mfqat
from mfqat import QATConfig
from mfqat.anchor.checkpoint import AnchorError, read_anchor
from mfqat.data.sources import tiny_llama
from mfqat.qat.input_squares import column_square_sums
from mfqat.qat.joint import joint_backward
from mfqat.qat.prepare import qat_modules
from mfqat.quant.api import fake_quantize, fake_quantize_through
from mfqat.quant.scale_search import quantize_search

FORMATS = ["mxint8", "mxint6", "mxint4"]
SEARCH = {"mxint6": "search", "mxint4": "search", "mxint3": "search"}


MXFP = ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"]
MXFP_SEARCH = {"mxfp6_e2m3": "search", "mxfp6_e3m2": "search", "mxfp4_e2m1": "search"}


def trained(steps: int = 3, rules=SEARCH, seed: int = 0, formats=FORMATS):
    """A tiny Llama after ``steps`` joint steps of ``formats`` with the given scale rules, and its batch."""
    torch.manual_seed(seed)
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=formats, schedule="joint", scale_rules=rules))
    opt = torch.optim.AdamW(m.parameters(), 1e-3)
    ids = torch.randint(0, m.config.vocab_size, (2, 32))
    for _ in range(steps):
        joint_backward(m, m, {"input_ids": ids, "labels": ids}, formats, lambda f: 1.0, lambda l: l.backward())
        opt.step()
        opt.zero_grad()
    return m.eval(), ids


@pytest.fixture(scope="module")
def model_and_anchor(tmp_path_factory):
    m, ids = trained()
    return m, ids, mfqat.save_anchor(m, tmp_path_factory.mktemp("a") / "anchor")


def test_importance_is_the_mean_squared_input_of_anchor_format_training_forwards():
    torch.manual_seed(1)
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=FORMATS, schedule="joint", scale_rules=SEARCH))
    seen = {}
    for name, lin in qat_modules(m):  # every Linear, the q/k/v and gate/up siblings sharing an input too
        seen[name] = []
        lin.register_forward_pre_hook(lambda mod, args, out=seen[name]:
                                      out.append(args[0].detach().reshape(-1, args[0].shape[-1]).clone()))
    ids = torch.randint(0, m.config.vocab_size, (2, 16))
    for fmt in ["mxint8", "mxint4", "mxint8"]:  # only the anchor format's forwards count
        mfqat.set_format(m, fmt)
        m(ids)
    m.eval()
    m(ids)  # nor do eval forwards
    for name, lin in qat_modules(m):
        rows = torch.cat([seen[name][0], seen[name][2]]).double()
        torch.testing.assert_close(lin.importance(), rows.square().mean(0).float(), rtol=1e-6, atol=0)
        assert lin.importance_tokens == rows.shape[0] and lin.pending_tokens == 0


def test_an_input_summed_once_is_reused_only_while_it_is_the_same_unmodified_tensor():
    x = torch.randn(3, 5, 64)
    first = column_square_sums(x)
    assert column_square_sums(x) is first  # a sibling projection reading the same input
    assert torch.equal(first, x.double().square().sum((0, 1)))
    x.mul_(2)  # modified in place: summed again
    assert torch.equal(column_square_sums(x), x.double().square().sum((0, 1)))
    y = x.clone()  # equal values, another tensor
    assert column_square_sums(y) is not column_square_sums(x)
    z = torch.randn(3, 5, 64, dtype=torch.float64)
    before = z.clone()
    assert torch.equal(column_square_sums(z), before.square().sum((0, 1)))
    assert torch.equal(z, before)  # not squared in place
    with torch.inference_mode():  # a training-mode forward under inference_mode: no version counter to key on
        t = torch.randn(4, 64)
        assert torch.equal(column_square_sums(t), t.double().square().sum(0))
        assert column_square_sums(t) is not column_square_sums(t)


def test_trained_search_model_equals_its_loaded_anchor_bit_for_bit(model_and_anchor):
    m, ids, path = model_and_anchor
    meta = json.loads((path / "mfqat.json").read_text())
    assert meta["format_version"] == 3 and meta["scale_rules"]["mxint4"] == "search"
    anchor = read_anchor(path)
    name, lin = next(qat_modules(m))
    assert torch.equal(anchor.quantized[f"{name}.weight"].importance, lin.importance())
    for fmt in ["mxint8", "mxint6", "mxint4", "mxint3"]:
        mfqat.set_format(m, fmt)
        with torch.no_grad():
            assert torch.equal(m(ids).logits, mfqat.load_anchor(path, fmt)(ids).logits), fmt


def test_mxfp_search_trained_model_equals_its_loaded_anchor_and_beats_its_rule(tmp_path):
    """The float family searched inside training (through the MXFP8 anchor): the anchor reproduces every
    searched format bit for bit, and each searched block's weighted error is at most the default rule's."""
    m, ids = trained(steps=2, rules=MXFP_SEARCH, formats=MXFP)
    path = mfqat.save_anchor(m, tmp_path / "a")
    assert json.loads((path / "mfqat.json").read_text())["scale_rules"]["mxfp4_e2m1"] == "search"
    changed = 0
    for fmt in MXFP + ["mxfp6_e3m2"]:
        mfqat.set_format(m, fmt)
        with torch.no_grad():
            assert torch.equal(m(ids).logits, mfqat.load_anchor(path, fmt)(ids).logits), fmt
    for name, lin in qat_modules(m):
        imp = lin.importance().double()
        base = fake_quantize(lin.weight.detach(), "mxfp8_e4m3", 32)
        for fmt, rule in [("mxfp6_e2m3", "floor"), ("mxfp4_e2m1", "ceil"), ("mxfp4_e2m1", "floor")]:
            searched = lin.quantized_weight(fmt).detach()
            default = fake_quantize(base, fmt, 32, rule)
            assert torch.equal(searched, quantize_search(base, fmt, 32, lin.importance()).dequantize())
            err = lambda w: ((base - w).double().square() * imp).reshape(-1, 32).sum(-1)  # noqa: E731
            assert (err(searched) <= err(default)).all(), (name, fmt, rule)
            changed += int(not torch.equal(searched, default))
    assert changed > 0


def test_calibrating_an_mxfp_searched_anchor_replaces_its_importance(tmp_path):
    """load_anchor(calib=) on an anchor trained with the MXFP search recalibrates those formats (not
    the untrained-search MXFP formats' rule), and the weights follow the new importance."""
    from mfqat.anchor.search import search_scales

    m, ids = trained(steps=1, rules={"mxfp4_e2m1": "search"}, formats=MXFP)
    path = mfqat.save_anchor(m, tmp_path / "a")
    stored = read_anchor(path)
    before = {k: q.dequantize() for k, q in stored.in_format("mxfp4_e2m1").items()}
    anchor = read_anchor(path)
    rep = search_scales(anchor, torch.randint(0, m.config.vocab_size, (2, 16)), ["mxfp4_e2m1"])
    assert rep["formats"] == ["mxfp4_e2m1"] and rep["tensors"] > 0
    with pytest.warns(UserWarning, match="not used for mxfp6_e2m3"):
        assert search_scales(read_anchor(path), ids, ["mxfp6_e2m3"])["formats"] == []
    after = {k: q.dequantize() for k, q in anchor.in_format("mxfp4_e2m1").items()}
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_search_changes_the_weights_and_never_raises_the_weighted_error(model_and_anchor):
    m, _, _ = model_and_anchor
    changed = 0
    for name, lin in qat_modules(m):
        imp = lin.importance().double()
        base = fake_quantize(lin.weight.detach(), "mxint8", 32)
        for fmt in ["mxint4", "mxint3"]:
            searched = lin.quantized_weight(fmt).detach()
            floor = fake_quantize_through(lin.weight.detach(), "mxint8", fmt, 32)
            assert torch.equal(searched, quantize_search(base, fmt, 32, lin.importance()).dequantize())
            err = lambda w: ((base - w).double().square() * imp).reshape(-1, 32).sum(-1)  # noqa: E731
            assert (err(searched) <= err(floor)).all(), (name, fmt)
            changed += int(not torch.equal(searched, floor))
    assert changed > 0


def test_the_kept_exponents_follow_the_weight_and_the_importance():
    m, ids = trained(steps=1)
    _, lin = next(qat_modules(m))
    first = lin.quantized_weight("mxint4").clone()
    with torch.no_grad():
        lin.weight.mul_(1.7)  # an optimizer step: the exponents kept for backward are stale now
    fresh = quantize_search(fake_quantize(lin.weight.detach(), "mxint8", 32), "mxint4", 32, lin.importance())
    assert torch.equal(lin.quantized_weight("mxint4"), fresh.dequantize())
    assert not torch.equal(first, fresh.dequantize())
    m.train()
    mfqat.set_format(m, "mxint8")
    before = lin.importance()
    m(ids * 0 + 3)  # new inputs: pending until the weight changes (the micro-batches of one step agree)
    kept = lin.quantized_weight("mxint4").clone()
    assert torch.equal(kept, fresh.dequantize()) and lin.pending_tokens > 0
    with torch.no_grad():
        lin.weight.mul_(0.9)  # the next optimizer step: the new inputs are folded in, the search reruns
    searched = lin.quantized_weight("mxint4")
    assert lin.pending_tokens == 0 and not torch.equal(lin.importance(), before)
    fresh = quantize_search(fake_quantize(lin.weight.detach(), "mxint8", 32), "mxint4", 32, lin.importance())
    assert torch.equal(searched, fresh.dequantize())


def test_search_gradient_is_straight_through():
    m, ids = trained(steps=1)
    m.train()
    mfqat.set_format(m, "mxint4")
    _, lin = next(qat_modules(m))
    x = torch.randn(3, lin.in_features)
    wq = lin.quantized_weight("mxint4").detach().requires_grad_()
    (torch.nn.functional.linear(x, wq, lin.bias) ** 2).sum().backward()
    (lin(x) ** 2).sum().backward()
    torch.testing.assert_close(lin.weight.grad, wq.grad)


def test_anchors_without_search_stay_version_2(tmp_path):
    m, _ = trained(steps=1, rules={})
    path = mfqat.save_anchor(m, tmp_path / "a")
    meta = json.loads((path / "mfqat.json").read_text())
    assert meta["format_version"] == 2
    assert not any(k.endswith(".importance") for k in load_file(str(path / "model.safetensors")))


@pytest.mark.parametrize("bad", ["nan", "shape"])
def test_a_corrupt_stored_importance_is_named(model_and_anchor, tmp_path, bad):
    import shutil

    _, _, path = model_and_anchor
    copy = shutil.copytree(path, tmp_path / "a")
    sd = load_file(str(copy / "model.safetensors"))
    key = next(k for k in sd if k.endswith(".importance"))
    sd[key] = sd[key][:-1] if bad == "shape" else sd[key].clone().fill_(float("nan"))
    save_file(sd, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AnchorError, match=f"model.safetensors.*{key.removesuffix('.importance')}.importance"):
        read_anchor(copy, verify=False)


@pytest.mark.parametrize("kwargs, why", [
    ({"scale_rules": {"mxint8": "search"}}, "mxint6.*only"),
    ({"scale_rules": {"mxfp8_e4m3": "search"}}, "mxint6.*only"),
    ({"formats": ["mxint4"], "schedule": "fixed", "scale_rules": {"mxint4": "search"}}, "through an 8-bit anchor"),
    ({"scale_rules": {"mxfp4_e2m1": "search"}}, "mxint8 or mxfp8_e4m3"),
    ({"formats": ["mxfp8_e5m2", "mxfp4_e2m1"], "anchor_format": "mxfp8_e5m2", "scale_rules": {"mxfp4_e2m1": "search"}},
     "got anchor_format mxfp8_e5m2"),
    ({"scale_rules": {"mxint4": "serach"}}, "unknown scale rule"),
    ({"scale_rules": {"mxint4": "search"}, "mask_saturated": True}, "mask_saturated is not supported"),
])
def test_search_rule_misuse_is_refused(kwargs, why):
    with pytest.raises(ValueError, match=why):
        QATConfig(**{"formats": FORMATS, "schedule": "joint", **kwargs})


@pytest.mark.parametrize("formats, rules, fmt", [(FORMATS, SEARCH, "mxint4"), (MXFP, MXFP_SEARCH, "mxfp4_e2m1")],
                         ids=["mxint4", "mxfp4"])
def test_export_mlx_writes_the_trained_search_blocks(tmp_path, formats, rules, fmt):
    """The MLX model of a search-trained anchor holds the blocks the model trained on (no calibration)."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import numpy as np

    from mfqat.data.sources import tiny_tokenizer
    from mfqat.export import to_mlx

    from .test_export_exact import mlx_dequantized

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(tok))
    mfqat.prepare(m, QATConfig(formats=formats, schedule="joint", scale_rules=rules))
    ids = torch.randint(0, len(tok), (2, 32))
    joint_backward(m, m, {"input_ids": ids, "labels": ids}, formats, lambda f: 1.0, lambda l: l.backward())
    path = mfqat.save_anchor(m.eval(), tmp_path / "a", tokenizer=tok)
    rep = to_mlx(path, tmp_path / "m", recipe=f"uniform:{fmt}")
    assert rep["verify"]["weights_bit_exact"]
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    weights = {}
    for f in sorted((tmp_path / "m").glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    for name, lin in qat_modules(m):
        got = mlx_dequantized(tmp_path / "m", name, weights, cfg["quantization"])
        assert np.array_equal(got, lin.quantized_weight(fmt).detach().numpy()), name


def test_mlx_training_refuses_the_search_rule():
    pytest.importorskip("mlx.core")
    import mlx.nn as nn

    from mfqat.mlx.qat import prepare as mlx_prepare

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(64, 32)]

    with pytest.raises(ValueError, match="'search' scale rule is trained in PyTorch only"):
        mlx_prepare(Tiny(), QATConfig(formats=FORMATS, schedule="joint", scale_rules=SEARCH, targets=r"layers\.0"))


def test_gradient_checkpointing_records_each_input_once():
    torch.manual_seed(2)
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=FORMATS, schedule="joint", scale_rules=SEARCH))
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    mfqat.set_format(m, "mxint8")
    ids = torch.randint(0, m.config.vocab_size, (2, 16))
    m(input_ids=ids, labels=ids).loss.backward()  # backward reruns each layer's forward
    _, lin = next(qat_modules(m))
    lin.importance()  # folds the pending records
    assert lin.importance_tokens == ids.numel()


def test_search_rule_in_an_old_version_or_a_stray_importance_is_refused(model_and_anchor, tmp_path):
    import shutil

    from .test_safety_read import meta_of, write_meta

    _, _, path = model_and_anchor
    old = shutil.copytree(path, tmp_path / "old")
    meta = meta_of(old)
    meta["format_version"] = 2
    write_meta(old, meta)
    with pytest.raises(AnchorError, match="'search' rule needs format version 3"):
        read_anchor(old)
    stray = shutil.copytree(path, tmp_path / "stray")
    sd = load_file(str(stray / "model.safetensors"))
    sd["model.norm.importance"] = torch.ones(8)
    save_file(sd, str(stray / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AnchorError, match="model.norm.importance belongs to no quantized tensor"):
        read_anchor(stray, verify=False)


def test_a_fused_optimizer_step_refreshes_the_kept_exponents():
    """AdamW(fused=True) (the HF Trainer's default) changes weights without bumping their version:
    the search must still see the new weights and fold the new inputs."""
    torch.manual_seed(4)
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=FORMATS, schedule="joint", scale_rules=SEARCH))
    opt = torch.optim.AdamW(m.parameters(), 1e-2, fused=True)
    ids = torch.randint(0, m.config.vocab_size, (2, 32))
    _, lin = next(qat_modules(m))
    for _ in range(2):
        joint_backward(m, m, {"input_ids": ids, "labels": ids}, FORMATS, lambda f: 1.0, lambda l: l.backward())
        before = lin.quantized_weight("mxint4").clone()
        opt.step()
        opt.zero_grad()
    m.train()
    got = lin.quantized_weight("mxint4")
    fresh = quantize_search(fake_quantize(lin.weight.detach(), "mxint8", 32), "mxint4", 32, lin.importance())
    assert torch.equal(got, fresh.dequantize()) and not torch.equal(got, before)


def test_each_format_keeps_its_exponents_and_non_finite_inputs_are_left_out(monkeypatch):
    from mfqat.qat import modules

    m, ids = trained(steps=1)
    m.train()
    _, lin = next(qat_modules(m))
    calls = []
    real = modules.search_through_anchor  # (w, anchor, anchor_rule, fmt, ...): the search through the anchor
    monkeypatch.setattr(modules, "search_through_anchor", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    for _ in range(2):  # two micro-batches of one step: mxint6 and mxint4 are searched once each
        for fmt in ("mxint6", "mxint4"):
            lin.quantized_weight(fmt)
    assert sorted(calls) == ["mxint4", "mxint6"]
    before = lin.importance()
    x = torch.randn(4, lin.in_features)
    x[0, 0] = float("inf")
    mfqat.set_format(m, "mxint8")
    with pytest.warns(UserWarning, match="non-finite"):
        lin(x)
    assert torch.equal(lin.importance(), before)


def test_forget_searched_exponents_after_a_data_edit():
    from mfqat.qat import forget_searched_exponents

    m, _ = trained(steps=1)
    _, lin = next(qat_modules(m))
    lin.quantized_weight("mxint4")
    lin.weight.data.mul_(1.5)  # bumps no version: the kept exponents are stale until forgotten
    forget_searched_exponents(m)
    fresh = quantize_search(fake_quantize(lin.weight.detach(), "mxint8", 32), "mxint4", 32, lin.importance())
    assert torch.equal(lin.quantized_weight("mxint4"), fresh.dequantize())
