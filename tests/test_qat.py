"""MF-QAT modules, prepare(), schedules, PEFT, torch.compile."""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.qat import (MFQATLinear, ProgressiveSchedule, QATConfig, make_schedule, qat_modules)

from .conftest import MX_FORMATS


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_forward_equals_linear_with_reference_weight(fmt):
    torch.manual_seed(0)
    lin = nn.Linear(64, 16)
    q = MFQATLinear.from_linear(lin)
    q.fmt = fmt
    x = torch.randn(3, 64)
    w = mfqat.quantize(lin.weight.detach(), fmt).dequantize()
    assert torch.equal(q(x), F.linear(x, w, lin.bias))


def test_gradients_reach_master_weight_and_bias():
    torch.manual_seed(0)
    q = MFQATLinear.from_linear(nn.Linear(64, 8))
    q.fmt = "mxfp4"
    x = torch.randn(4, 64)
    q(x).pow(2).sum().backward()
    assert q.weight.grad is not None and q.weight.grad.abs().sum() > 0
    assert q.bias.grad is not None and q.bias.grad.abs().sum() > 0
    # STE: the weight gradient equals that of a plain linear at the quantized weight
    wq = mfqat.quantize(q.weight.detach(), "mxfp4").dequantize().requires_grad_()
    F.linear(x, wq, q.bias.detach()).pow(2).sum().backward()
    assert torch.allclose(q.weight.grad, wq.grad)


def test_schedules():
    p = ProgressiveSchedule(["mxint8", "mxint2", "mxint6", "mxint4"])
    assert [p.format_at(s, 8) for s in range(8)] == ["mxint2"] * 2 + ["mxint4"] * 2 + ["mxint6"] * 2 + ["mxint8"] * 2
    p2 = ProgressiveSchedule(["mxfp4", "mxfp6", "mxfp8"], repeats=2)
    assert [p2.format_at(s, 6) for s in range(6)] == ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp8_e4m3"] * 2
    c = make_schedule("cyclic", ["mxint4", "mxint8"])
    assert [c.format_at(s, 4) for s in range(4)] == ["mxint4", "mxint8"] * 2
    r1 = make_schedule("random", ["mxint4", "mxint6", "mxint8"], seed=3)
    r2 = make_schedule("random", ["mxint4", "mxint6", "mxint8"], seed=3)
    assert [r1.format_at(s, 50) for s in range(50)] == [r2.format_at(s, 50) for s in range(50)]
    assert len({r1.format_at(s, 50) for s in range(50)}) == 3
    assert make_schedule("fixed", ["mxint4"]).format_at(7, 10) == "mxint4"
    with pytest.raises(ValueError, match="unknown format 'mxint9'"):
        make_schedule("cyclic", ["mxint9"])
    with pytest.raises(ValueError, match="unknown schedule"):
        QATConfig(schedule="zigzag")


def test_prepare_keeps_state_dict_and_unprepare():
    m = tiny_llama()
    keys = list(m.state_dict())
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    mfqat.prepare(m, QATConfig(formats=["mxint8"], schedule="fixed"))
    assert list(m.state_dict()) == keys
    names = [n for n, _ in qat_modules(m)]
    assert len(names) == 2 * 7 and "lm_head" not in names
    mfqat.unprepare(m)
    assert not list(qat_modules(m))
    assert all(torch.equal(ref[k], v) for k, v in m.state_dict().items())


def test_targets_matching_nothing_is_an_error():
    with pytest.raises(ValueError, match="matched no nn.Linear"):
        mfqat.prepare(tiny_llama(), QATConfig(targets="nothing_here"))


def test_non_multiple_in_features_skipped_with_warning():
    model = nn.Sequential()
    model.add_module("layers", nn.ModuleList([nn.Linear(48, 8), nn.Linear(64, 8)]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mfqat.prepare(model, QATConfig(formats=["mxint4"], schedule="fixed"))
    assert any("layers.0 (48 not a multiple of 32)" in str(x.message) for x in w)
    assert isinstance(model.layers[1], MFQATLinear) and type(model.layers[0]) is nn.Linear


def test_layer_formats_and_set_format():
    m = tiny_llama()
    cfg = QATConfig(formats=["mxint8"], schedule="fixed", layer_formats={r"mlp\.down_proj": ["mxint4"]})
    mfqat.prepare(m, cfg)
    mods = dict(qat_modules(m))
    assert mods["model.layers.0.mlp.down_proj"].fmt == "mxint4"
    assert mods["model.layers.0.mlp.up_proj"].fmt == "mxint8"
    mfqat.set_format(m, "mxfp4")
    assert all(x.fmt == "mxfp4_e2m1" for x in mods.values())
    mfqat.set_format(m, None)
    assert all(x.fmt is None for x in mods.values())


def test_controller_drives_progressive_formats():
    m = tiny_llama()
    mfqat.prepare(m, QATConfig.from_yaml("mxint_2468"))
    ctl = m.mfqat_controller
    seen = [ctl.set_step(m, s, 8) for s in range(8)]
    assert seen == ["mxint2"] * 2 + ["mxint4"] * 2 + ["mxint6"] * 2 + ["mxint8"] * 2


def test_embeddings_and_activations_optional():
    m = tiny_llama()
    cfg = QATConfig(formats=["mxint4"], schedule="fixed", quantize_embeddings=True, quantize_activations=True)
    mfqat.prepare(m, cfg)
    assert type(m.model.embed_tokens).__name__ == "MFQATEmbedding"
    ids = torch.randint(0, 256, (2, 8))
    loss = m(ids, labels=ids).loss
    loss.backward()
    assert m.model.embed_tokens.weight.grad is not None


def test_peft_lora_on_prepared_model_trains_only_adapters():
    peft = pytest.importorskip("peft")
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=["mxint4"], schedule="fixed"))
    lm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    before = {k: v.clone() for k, v in lm.named_parameters()}
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 16))
    for _ in range(3):
        opt.zero_grad()
        lm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    changed = {k for k, v in lm.named_parameters() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)
    # the frozen base still runs quantized
    base = [mod for n, mod in qat_modules(lm)]
    assert base and all(x.fmt == "mxint4" for x in base)


def test_the_controller_steps_the_formats_of_peft_wrapped_modules():
    """Under PEFT the modules are renamed (base_model.model..., .base_layer); the controller still finds each
    one's schedule, so a progressive run keeps cycling formats after get_peft_model."""
    peft = pytest.importorskip("peft")
    m = tiny_llama()
    mfqat.prepare(m, QATConfig.from_yaml("mxint_2468"))
    lm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    wrapped = [(n, mod) for n, mod in qat_modules(lm) if ".base_layer" in n]
    assert wrapped, "the LoRA targets are wrapped"
    for step, want in ((0, "mxint2"), (7, "mxint8")):
        assert m.mfqat_controller.set_step(lm, step, 8) == want
        assert all(mod.fmt == want for _, mod in qat_modules(lm)), (step, [(n, mod.fmt) for n, mod in wrapped][:3])


def test_torch_compile_matches_eager():
    torch._dynamo.reset()
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=["mxfp4"], schedule="fixed"))
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        eager = m(ids).logits
        compiled = torch.compile(m, backend="aot_eager")(ids).logits
    assert torch.equal(eager, compiled)


def test_bf16_autocast_and_gradient_checkpointing():
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=["mxint4"], schedule="fixed"))
    m.train()
    m.gradient_checkpointing_enable()
    ids = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and m.model.layers[0].mlp.up_proj.weight.grad is not None


def test_yaml_configs_load():
    from mfqat.qat.config import CONFIGS_DIR, shipped_configs
    assert len(shipped_configs()) >= 8, CONFIGS_DIR  # the recipes ship inside the package (mfqat/configs)
    for name in shipped_configs():
        cfg = QATConfig.from_yaml(name)  # a bare name resolves against the shipped recipes
        assert cfg.formats


def test_random_schedule_follows_its_seed():
    """One seed: the same sequence every time; other seeds: other sequences (also through QATConfig)."""
    fmts = ["mxint2", "mxint4", "mxint6", "mxint8"]

    def seq(seed, via_config=False):
        s = (QATConfig(formats=fmts, schedule="random", seed=seed).make_schedule() if via_config
             else make_schedule("random", fmts, seed=seed))
        return [s.format_at(i, 64) for i in range(64)]

    assert seq(5) == seq(5) == seq(5, via_config=True)
    runs = {tuple(seq(s)) for s in range(6)} | {tuple(seq(s, via_config=True)) for s in range(6)}
    assert len(runs) == 6
    m = tiny_llama()
    mfqat.prepare(m, QATConfig(formats=fmts, schedule="random", seed=3))
    assert [m.mfqat_controller.set_step(m, i, 64) for i in range(64)] == seq(3)


def _qdq_inputs(model, fmt):
    """Forward pre-hooks that fake-quantize the input of every MF-QAT Linear (the manual reference)."""
    hooks = []
    for _, mod in qat_modules(model):
        if isinstance(mod, MFQATLinear):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, args: (mfqat.fake_quantize(args[0], fmt, 32),) + tuple(args[1:])))
    return hooks


@pytest.mark.parametrize("act", ["mxint4", "mxfp8_e4m3"])
def test_activation_fake_quant_equals_manual_qdq_of_inputs(act):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with_act = mfqat.prepare(tiny_llama(), QATConfig(formats=["mxint4"], schedule="fixed",
                                                     quantize_activations=True, activation_format=act))
    manual = mfqat.prepare(tiny_llama(), QATConfig(formats=["mxint4"], schedule="fixed"))
    with torch.no_grad():
        plain = manual(ids).logits
        hooks = _qdq_inputs(manual, act)
        want = manual(ids).logits
        for h in hooks:
            h.remove()
        got = with_act(ids).logits
    assert not torch.equal(want, plain)  # the activation quantization changes the logits
    assert torch.equal(got, want)
    # one module directly, with gradients enabled (the recomputing autograd path)
    lin = with_act.model.layers[0].mlp.down_proj
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(1))
    w = mfqat.fake_quantize(lin.weight.detach(), "mxint4")
    assert torch.equal(lin(x).detach(), F.linear(mfqat.fake_quantize(x, act), w))


@pytest.mark.parametrize("schedule,fmt", [("fixed", "mxint4"), ("cyclic", "mxint2")])
def test_embedding_fake_quant_equals_manual_qdq_of_table(schedule, fmt):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg = QATConfig(formats=[fmt] if schedule == "fixed" else [fmt, "mxint8"], schedule=schedule,
                    quantize_embeddings=True)
    m = mfqat.prepare(tiny_llama(), cfg)
    mfqat.set_format(m, fmt)
    table = m.model.embed_tokens.weight.detach()
    qdq = mfqat.fake_quantize(table, fmt, 32)
    if cfg.through_anchor:  # the forward sees qdq_f(qdq_anchor(W))
        qdq = mfqat.fake_quantize(mfqat.fake_quantize(table, cfg.anchor_format, 32), fmt, 32)
    assert not torch.equal(qdq, table)
    assert torch.equal(m.model.embed_tokens(ids), F.embedding(ids, qdq))
    ref = mfqat.prepare(tiny_llama(), QATConfig(formats=cfg.formats, schedule=schedule))
    mfqat.set_format(ref, fmt)
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(qdq)
        assert torch.equal(m(ids).logits, ref(ids).logits)
