"""Issue 36, training semantics users rely on, each checked against a written-out value:
resume with gradient accumulation, the 1/K scaling of accumulated micro-batches (plain and joint
steps), MFQATTrainer's joint distillation, --resume refusals, MX-QLoRA's joint loss, bitsandbytes
double quantization, MLX AdamW against torch's."""
import argparse
import json

import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.train.loop import main as train_main
from mfqat.qat import QATConfig


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(got, want, rtol=1e-5, atol=1e-7):
    assert got.keys() == want.keys() and got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")


# 1. resume with gradient accumulation ----------------------------------------------------------------

def test_resume_with_grad_accum_continues_at_the_step_and_micro_batch(tmp_path):
    """Stopped after N=2 optimizer steps of K=3 micro-batches and resumed with the same K: the
    resumed run trains steps 2..3 on micro-batches 6..11 and ends with the uninterrupted run's
    weights, bit for bit (CPU), and the same losses."""
    from safetensors.torch import load_file

    common = ["--model", "tiny", "--steps", "4", "--seq-len", "32", "--batch-size", "2", "--grad-accum", "3",
              "--lr", "3e-3", "--save-every", "2", "--save-master", "--eval-blocks", "1",
              "--lr-schedule", "cosine", "--warmup-steps", "1", "--qat-config", "mxint_2468"]
    full = train_main(common + ["--out", str(tmp_path / "full")])
    ck = tmp_path / "full" / "checkpoint-2"
    assert json.loads((ck / "mfqat_step.json").read_text())["step"] == 2
    resumed = train_main(common + ["--out", str(tmp_path / "resumed"), "--resume", str(ck)])
    assert resumed["formats"] == full["formats"][2:] == ["mxint6", "mxint8"]  # continues at optimizer step 2
    assert resumed["losses"] == full["losses"][2:]  # the same micro-batches, in the same order
    w_full = load_file(str(tmp_path / "full" / "master" / "model.safetensors"))
    w_res = load_file(str(tmp_path / "resumed" / "master" / "model.safetensors"))
    assert w_full.keys() == w_res.keys()
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k


# 2. gradient accumulation scaling --------------------------------------------------------------------

@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


@pytest.mark.parametrize("cfg", [dict(formats=["mxint4"], schedule="fixed"),
                                 dict(formats=["mxint8", "mxint4"], schedule="joint", loss_weights={"mxint4": 3.0})],
                         ids=["one-format", "joint"])
def test_k_micro_batches_accumulate_the_gradient_of_one_k_times_larger_batch(accelerator, cfg):
    """micro_step (the loop's forward + backward) over K=2 micro-batches of B=2 leaves the gradient
    of one batch of 4 (the loss divided by K exactly once), for one format and for a joint step."""
    from mfqat.train.loop import micro_step

    model = mfqat.prepare(tiny_llama(), QATConfig(**cfg))
    qcfg, ctl = model.mfqat_controller.config, model.mfqat_controller
    batch = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))

    def accumulate(k):
        model.zero_grad(set_to_none=True)
        args = argparse.Namespace(grad_accum=k, steps=1, distill=0.0)
        losses = []
        for i, part in enumerate(batch.chunk(k)):
            losses.append(micro_step(args, accelerator, model, model, ctl, qcfg, part, 0, sync=i == k - 1))
        return _grads(model), losses

    whole, _ = accumulate(1)
    acc2, losses = accumulate(2)
    _assert_close(acc2, whole)
    assert set(losses[0]) == set(cfg["formats"])  # every format of the step ran on every micro-batch
    # and the written-out objective: sum_f w_f L_f / sum w over the whole batch
    model.zero_grad(set_to_none=True)
    weights = {f: qcfg.weight_of(f) for f in cfg["formats"]}
    total = 0
    for f, w in weights.items():
        mfqat.set_format(model, f)
        total = total + w / sum(weights.values()) * model(input_ids=batch, labels=batch).loss
    total.backward()
    _assert_close(whole, _grads(model))


# 3. MFQATTrainer: distillation as configured -------------------------------------------------------

def test_mfqat_trainer_joint_step_is_the_written_out_distillation_loss(tmp_path):
    """One MFQATTrainer step over mxint8/6/4 with distill_weight a and loss_weights {mxint4: 2}:
    the gradient the optimizer sees is that of
        sum_f w_f L_f / sum w,  L_8 = CE_8,  L_f = (1 - a) CE_f + a KL(p_8 || p_f) (f = 6, 4)
    with the teacher p_8 the highest format's logits (detached), not the previous format's."""
    from transformers import TrainerCallback, TrainingArguments

    from mfqat.integrations.hf import MFQATTrainer
    from mfqat.qat.joint import token_kl

    alpha, lw = 0.4, {"mxint4": 2.0}
    model = mfqat.prepare(tiny_llama(), QATConfig(formats=["mxint8", "mxint6", "mxint4"], schedule="joint",
                                                  distill_weight=alpha, loss_weights=lw))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked distributions: the teachers of the formats differ clearly
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    seen = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            seen.update(_grads(model))

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, learning_rate=1e-3, max_grad_norm=0.0,
                             save_strategy="no", logging_strategy="no")
    trainer = MFQATTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                           callbacks=[Grab()])
    trainer.mfqat_callback.anchor_format = None
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = trainer.train()
    assert seen
    with torch.no_grad():  # the written-out loss, on the weights of the step
        for n, p in model.named_parameters():
            p.copy_(before[n])
    model.zero_grad(set_to_none=True)
    w = {"mxint8": 1.0, "mxint6": 1.0, "mxint4": 2.0}
    mfqat.set_format(model, "mxint8")
    top = model(input_ids=ids, labels=ids)
    teacher = top.logits.detach()
    total = w["mxint8"] / 4 * top.loss
    for f in ("mxint6", "mxint4"):
        mfqat.set_format(model, f)
        o = model(input_ids=ids, labels=ids)
        total = total + w[f] / 4 * ((1 - alpha) * o.loss + alpha * token_kl(o.logits, teacher))
    total.backward()
    _assert_close(seen, _grads(model), rtol=1e-4, atol=1e-6)
    assert out.training_loss == pytest.approx(total.item(), rel=1e-5)


# 12. --resume refusals ----------------------------------------------------------------------------

def test_resume_from_a_missing_or_foreign_folder_fails_before_any_work(tmp_path):
    """--resume PATH that does not exist, is not a checkpoint, or is the checkpoint of another run
    (a different model, batch size, gradient accumulation, seed or QAT recipe): an error naming
    --resume and PATH, before the model loads or OUT is written."""
    from mfqat.cli import main as cli_main

    common = ["--model", "tiny", "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--eval-blocks", "1",
              "--qat-config", "mxint_468"]
    train_main(common + ["--out", str(tmp_path / "run"), "--save-every", "1"])
    ck = tmp_path / "run" / "checkpoint-1"
    not_ck = tmp_path / "empty"
    not_ck.mkdir()
    cases = [(tmp_path / "nope", "no such"), (not_ck, "not a checkpoint"),
             (ck, "--batch-size", ["--batch-size", "4"]), (ck, "--grad-accum", ["--grad-accum", "2"]),
             (ck, "--seed", ["--seed", "1"]), (ck, "mxint_2468", ["--qat-config", "mxint_2468"])]
    for path, why, *extra in cases:
        argv = common + (extra[0] if extra else []) + ["--out", str(tmp_path / "out"), "--resume", str(path)]
        with pytest.raises(ValueError) as e:  # the API: a ValueError (AnchorError for a bad folder)
            train_main(argv)
        assert f"--resume {path}" in str(e.value) and why in str(e.value), (why, str(e.value))
        assert not (tmp_path / "out").exists(), why
        with pytest.raises(SystemExit) as e:  # the command line: one line, exit status 2
            cli_main(["train"] + argv)
        assert e.value.code == 2, why
    s = train_main(common + ["--out", str(tmp_path / "ok"), "--resume", str(ck)])  # the same run resumes
    assert len(s["losses"]) == 1


def test_resume_refuses_switching_learned_scales(tmp_path):
    """--learn-scales adds parameters and an optimizer group: a checkpoint written without it cannot
    resume with it (nor the reverse); the error names --resume and --learn-scales before any work."""
    common = ["--model", "tiny", "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--eval-blocks", "1",
              "--qat-config", "affine_joint"]
    train_main(common + ["--out", str(tmp_path / "run"), "--save-every", "1"])
    ck = tmp_path / "run" / "checkpoint-1"
    with pytest.raises(ValueError) as e:
        train_main(common + ["--learn-scales", "--out", str(tmp_path / "out"), "--resume", str(ck)])
    assert f"--resume {ck}" in str(e.value) and "--learn-scales" in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


# 10. MX-QLoRA: the joint loss is the mean over formats ----------------------------------------------

def test_mx_qlora_joint_loss_is_the_mean_of_the_formats_losses(tmp_path):
    """`mfqat mx-qlora --schedule joint` (documented: the mean of the formats' losses, one backward
    each): the first step's logged loss equals the mean over formats of the anchor's loss in each
    format on that step's batch (the adapters start at B = 0, so the model is the anchor)."""
    pytest.importorskip("peft")
    from mfqat.data.sources import load_text, split_text, tiny_tokenizer, token_blocks
    from mfqat.mxqlora.train import main as mx_qlora_main

    tok = tiny_tokenizer()
    anchor = mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path / "anchor", "mxint8", tokenizer=tok)
    formats = ["mxint8", "mxint4", "mxint2"]
    s = mx_qlora_main([str(anchor), "--formats", ",".join(formats), "--schedule", "joint", "--steps", "1",
                       "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "1", "--lora-rank", "2",
                       "--out", str(tmp_path / "run")])
    train = token_blocks(tok, split_text(load_text(None))[0], 32, max_blocks=2)
    batch = train[torch.randint(0, train.shape[0], (2,), generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        per = {f: mfqat.load_anchor(anchor, f)(input_ids=batch, labels=batch).loss.item() for f in formats}
    assert max(per.values()) - min(per.values()) > 1e-3  # the formats' losses differ: the mean is checked
    assert s["losses"][0] == pytest.approx(sum(per.values()) / len(per), rel=1e-5)


# 11. --base nf4 is NF4 with double quantization ------------------------------------------------------

def test_bnb_nf4_base_is_double_quantized_at_4_127_bits(tmp_path):
    """--base nf4 promises QLoRA's NF4 with double quantization: every 4-bit weight's quantization
    state is nested (uint8 absmax per 64 weights, float32 absmax per 256 of those), the saved
    checkpoint carries the nested statistics, and the stored bits per weight are the 4.127 that
    `base_bits_per_weight('nf4')` (the summary's figure) reports."""
    bnb = pytest.importorskip("bitsandbytes")
    from safetensors.torch import load_file

    from mfqat.train.lora import base_bits_per_weight, load_bnb_base

    model = load_bnb_base(tiny_llama(hidden=256, intermediate=512, layers=1, heads=4), "nf4")
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(layers) == 7
    bits = weights = 0
    for name, m in layers.items():
        qs = m.weight.quant_state
        assert qs.quant_type == "nf4" and qs.blocksize == 64, name
        assert qs.nested and qs.state2 is not None and qs.absmax.dtype == torch.uint8, name
        assert qs.state2.blocksize == 256 and qs.state2.absmax.dtype == torch.float32, name
        bits += m.weight.numel() * 8 + qs.absmax.numel() * 8 + qs.state2.absmax.numel() * 32
        weights += qs.shape.numel()
    assert bits / weights == pytest.approx(base_bits_per_weight("nf4"), abs=1e-6)
    assert base_bits_per_weight("nf4") == pytest.approx(4.127, abs=5e-4)
    model.save_pretrained(tmp_path / "saved")
    sd = load_file(str(next((tmp_path / "saved").glob("*.safetensors"))))
    for name in layers:
        assert {f"{name}.weight.nested_absmax", f"{name}.weight.nested_quant_map",
                f"{name}.weight.quant_state.bitsandbytes__nf4"} <= sd.keys(), name


# 9. MLX AdamW (mlx-train) against torch.optim.AdamW --------------------------------------------------

def test_mlx_train_adamw_matches_torch_adamw_step_for_step():
    """mfqat.mlx.train.make_optimizer (what mlx-train steps with) and torch.optim.AdamW, same lr and
    weight decay, same parameters and gradients: the same parameters after each of 6 steps
    (bias correction included: without it the first step alone is ~3x too large)."""
    mx = pytest.importorskip("mlx.core")
    import mlx.nn as mnn
    import numpy as np

    from mfqat.mlx.train import make_optimizer

    lr, wd = 1e-2, 0.1
    g = torch.Generator().manual_seed(0)
    w0, b0 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    tw, tb = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(b0.clone())
    topt = torch.optim.AdamW([tw, tb], lr=lr, weight_decay=wd)
    layer = mnn.Linear(16, 8)
    layer.update({"weight": mx.array(w0.numpy()), "bias": mx.array(b0.numpy())})
    mopt = make_optimizer(lr, wd)
    for step in range(6):
        gw, gb = torch.randn(8, 16, generator=g) * 10 ** (step % 3 - 1), torch.randn(8, generator=g)
        tw.grad, tb.grad = gw.clone(), gb.clone()
        topt.step()
        mopt.update(layer, {"weight": mx.array(gw.numpy()), "bias": mx.array(gb.numpy())})
        mx.eval(layer.parameters())
        np.testing.assert_allclose(np.array(layer.weight), tw.detach().numpy(), rtol=2e-5, atol=1e-6,
                                   err_msg=f"step {step}")
        np.testing.assert_allclose(np.array(layer.bias), tb.detach().numpy(), rtol=2e-5, atol=1e-6,
                                   err_msg=f"step {step}")
    assert not np.allclose(np.array(layer.weight), w0.numpy(), atol=1e-2)  # it moved
