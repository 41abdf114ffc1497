"""Joint MF-QAT: schedule, objective, train-through-anchor, Trainer and MLX paths."""
import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.qat import QATConfig
from mfqat.qat.joint import joint_backward, token_kl
from mfqat.qat.schedules import JointSchedule

from .conftest import assert_formats_equal_the_anchors


def test_joint_schedule_sandwich_is_seeded_and_keeps_the_ends():
    s = JointSchedule(["mxint4", "mxint8", "mxint2", "mxint6", "mxint5", "mxint3"], seed=3, sample=1)
    sets = [s.formats_at(step) for step in range(40)]
    assert all(x[0] == "mxint8" and x[-1] == "mxint2" and len(x) == 3 for x in sets)
    assert {x[1] for x in sets} == {"mxint6", "mxint5", "mxint4", "mxint3"}  # varies with the step
    assert sets == [JointSchedule(s.formats, seed=3, sample=1).formats_at(i) for i in range(40)]
    assert JointSchedule(["mxint4", "mxint8"]).formats_at(5) == ["mxint8", "mxint4"]


def test_config_defaults_and_errors():
    assert QATConfig(formats=["mxint4", "mxint8"], schedule="joint").anchor_format == "mxint8"
    fp = QATConfig(formats=["mxfp4", "mxfp6"], schedule="joint")
    assert fp.anchor_format == "mxfp8_e4m3" and fp.through_anchor
    assert not QATConfig(formats=["mxint4"], schedule="fixed").through_anchor
    with pytest.raises(ValueError, match="loss_weights"):
        QATConfig(formats=["mxint4"], schedule="joint", loss_weights={"mxint6": 1.0})
    assert not QATConfig(formats=["mxint4", "mxfp4"], schedule="joint").through_anchor  # no single anchor
    with pytest.raises(ValueError, match="one format family"):
        QATConfig(formats=["mxint4", "mxfp4"], schedule="joint", through_anchor=True)
    with pytest.raises(ValueError, match="cannot slice"):
        QATConfig(formats=["mxint8"], schedule="joint", anchor_format="mxint6")
    warm = QATConfig(formats=["mxint4", "mxint8"], schedule="joint", anchor_warmup_steps=2)
    assert warm.step_formats(1, 10) == ["mxint8"] and warm.step_formats(2, 10) == ["mxint8", "mxint4"]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("distill", [0.0, 0.4])
def test_joint_step_equals_weighted_sum_of_format_gradients(distill):
    weights = {"mxint8": 2.0, "mxint4": 1.0, "mxint3": 0.5}
    cfg = QATConfig(formats=list(weights), schedule="joint", loss_weights=weights, distill_weight=distill)
    model = mfqat.prepare(tiny_llama(), cfg)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    formats = cfg.step_formats(0, 1)
    assert formats == ["mxint8", "mxint4", "mxint3"]
    losses = joint_backward(model, model, inputs, formats, cfg.weight_of, lambda l: l.backward(), distill, scale=0.5)
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    # the manual objective: one graph, every format, weights normalised to sum 1
    total, teacher = 0.0, None
    for f in formats:
        mfqat.set_format(model, f)
        out = model(**inputs)
        loss = out.loss
        if teacher is not None and distill:
            loss = (1 - distill) * loss + distill * token_kl(out.logits, teacher)
        if teacher is None:
            teacher = out.logits.detach()
        assert abs(loss.item() - losses[f]) < 1e-5
        total = total + weights[f] / sum(weights.values()) * loss
    (0.5 * total).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("formats", [["mxint4", "mxint6", "mxint8"], ["mxfp4", "mxfp6", "mxfp8"]])
def test_through_anchor_forward_equals_load_anchor(formats, tmp_path):
    """After set_format(model, f) the logits equal those of load_anchor(save_anchor(model), fmt=f)."""
    cfg = QATConfig(formats=formats, schedule="joint")
    model = mfqat.prepare(tiny_llama(seed=1), cfg)
    with torch.no_grad():  # spread the weights so that the two roundings differ somewhere
        for p in model.parameters():
            p.mul_(1 + torch.rand_like(p) * 3)
    anchor = mfqat.save_anchor(model, tmp_path / "a", cfg.anchor_format)
    assert_formats_equal_the_anchors(model, anchor, formats)


def test_trainer_joint_step_is_the_joint_gradient(tmp_path):
    """One MFQATTrainer step with SGD(lr=1) moves the weights by exactly -grad of the joint loss."""
    from transformers import TrainingArguments

    from mfqat.integrations.hf import MFQATTrainer

    weights = {"mxint8": 1.0, "mxint4": 3.0}
    cfg = QATConfig(formats=list(weights), schedule="joint", loss_weights=weights)
    model = mfqat.prepare(tiny_llama(), cfg)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": row, "labels": row} for row in ids]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    joint_backward(model, model, {"input_ids": ids, "labels": ids}, ["mxint8", "mxint4"], cfg.weight_of,
                   lambda l: l.backward())
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    args = TrainingArguments(str(tmp_path), max_steps=1, per_device_train_batch_size=2, learning_rate=1.0,
                             optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[],
                             save_strategy="no", use_cpu=True, logging_steps=1, dataloader_drop_last=True)
    MFQATTrainer(model=model, args=args, train_dataset=data).train()
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), want[n], rtol=1e-4, atol=1e-6, msg=n)


def test_train_cli_joint_with_accumulation_and_cosine(tmp_path):
    from mfqat.train.loop import main

    s = main(["--model", "tiny", "--steps", "3", "--batch-size", "2", "--seq-len", "32", "--grad-accum", "2",
              "--schedule", "joint", "--formats", "mxint4,mxint8", "--lr-schedule", "cosine",
              "--warmup-steps", "1", "--gradient-checkpointing", "--eval-formats", "mxint4", "--eval-blocks", "2",
              "--out", str(tmp_path / "run")])
    assert s["formats"] == ["mxint8+mxint4"] * 3
    assert s["peak_memory_mib"] > 0
    meta = mfqat.anchor.checkpoint.read_meta(tmp_path / "run" / "anchor")
    assert meta["anchor_format"] == "mxint8" and meta["step"] == 3


def test_lr_lambda_warmup_cosine_and_family_multiplier():
    from types import SimpleNamespace

    from mfqat.train.loop import make_lr_lambda

    ctl = SimpleNamespace(step_formats=lambda step, total: ["mxfp8_e4m3"] if step % 2 else ["mxint8"])
    args = SimpleNamespace(lr_mult="mxint=2", warmup_steps=2, lr_schedule="cosine", steps=10)
    f = make_lr_lambda(args, ctl)
    assert f(0) == pytest.approx(2 * 0.5) and f(1) == pytest.approx(1.0)
    assert f(6) == pytest.approx(2 * 0.5) and f(10) == pytest.approx(0.0)


@pytest.mark.parametrize("distill", [0.0, 0.4])
def test_mlx_joint_step_equals_weighted_sum(distill):
    mx = pytest.importorskip("mlx.core")
    import numpy as np
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mfqat.mlx.qat import prepare, set_format
    from mfqat.mlx.train import joint_grads

    model = _tiny_mlx()
    weights = {"mxint8": 1.0, "mxint4": 2.0}
    cfg = QATConfig(formats=list(weights), schedule="joint", loss_weights=weights, distill_weight=distill)
    prepare(model, cfg)
    batch = mx.array(np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32))
    loss, grads = joint_grads(model, batch, ["mxint8", "mxint4"], cfg)
    set_format(model, "mxint8")
    teacher = mx.stop_gradient(model(batch[:, :-1]).astype(mx.float32))

    def objective(m, b, fmt):  # written out: CE, plus KL(teacher || student) below the top format
        logits = m(b[:, :-1]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, b[:, 1:], reduction="mean")
        if fmt == "mxint8" or not distill:
            return ce
        p_t = mx.softmax(teacher, axis=-1)
        kl = (p_t * (mx.log(p_t) - nn.log_softmax(logits, axis=-1))).sum(-1).mean()
        return (1 - distill) * ce + distill * kl
    want, want_loss = None, 0.0
    for f, w in weights.items():
        set_format(model, f)
        l, g = nn.value_and_grad(model, lambda m, b: objective(m, b, f))(model, batch)
        want_loss += w / 3 * l.item()
        g = dict(tree_flatten(g))
        want = {k: w / 3 * v for k, v in g.items()} if want is None else {k: want[k] + w / 3 * v for k, v in g.items()}
    got = dict(tree_flatten(grads))
    assert abs(loss - want_loss) < 1e-5
    for k in want:
        assert np.allclose(np.array(got[k]), np.array(want[k]), rtol=1e-4, atol=1e-6), k


def _tiny_mlx():
    """A tiny random MLX Llama built from mlx_lm's own model class."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=2, rms_norm_eps=1e-5, vocab_size=256, num_key_value_heads=2)
    return llama.Model(args)


def test_token_kl_is_kl_of_teacher_from_student():
    s, t = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    p = t.softmax(-1)
    want = (p * (p.log() - s.log_softmax(-1))).sum(-1).mean()
    torch.testing.assert_close(token_kl(s, t), want)


def test_mfqat_linear_saves_no_quantized_copy_of_the_weight():
    """The backward recomputes qdq(W): autograd keeps what a plain Linear keeps (x, and W itself)."""
    from torch import nn

    def saved_bytes(layer, x):
        seen = []

        def pack(t):
            if t.data_ptr() != layer.weight.data_ptr():  # the parameter itself costs nothing extra
                seen.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x).sum()
        return sum(seen)

    lin = nn.Linear(256, 512)
    x = torch.randn(4, 256, requires_grad=True)
    q = mfqat.qat.MFQATLinear.from_linear(nn.Linear(256, 512))
    q.fmt = "mxint4"
    assert saved_bytes(q, x) <= saved_bytes(lin, x)
    q.anchor_format = "mxint8"
    assert saved_bytes(q, x) <= saved_bytes(lin, x)


def test_default_recipe_is_joint_through_the_mxint8_anchor():
    cfg = QATConfig()
    assert cfg.schedule == "joint" and cfg.anchor_format == "mxint8" and cfg.through_anchor
    assert cfg.step_formats(0, 1) == ["mxint8", "mxint6", "mxint4"]
    assert QATConfig.from_yaml("mxint_joint").formats == cfg.formats


def test_anchor_warmup_drives_every_schedule():
    """During anchor_warmup_steps the controller puts every layer in the anchor format (also for
    one-format-per-step schedules), and current_format says so."""
    cfg = QATConfig(formats=["mxint4", "mxint6"], schedule="cyclic", anchor_warmup_steps=2)
    model = mfqat.prepare(tiny_llama(), cfg)
    ctl = model.mfqat_controller
    assert ctl.set_step(model, 1, 10) == "mxint8"
    assert {m.fmt for _, m in mfqat.qat.qat_modules(model)} == {"mxint8"}
    assert ctl.set_step(model, 2, 10) == "mxint4"
    assert {m.fmt for _, m in mfqat.qat.qat_modules(model)} == {"mxint4"}
