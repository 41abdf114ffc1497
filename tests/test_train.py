"""Training integrations: accelerate loop (1 and 2 ranks), resume, HF Trainer callback."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.integrations.hf import MFQATCallback
from mfqat.train.loop import main as train_main
from mfqat.qat import QATConfig

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_single_process_training_saves_anchor(tmp_path):
    out = tmp_path / "run"
    summary = train_main(["--model", "tiny", "--steps", "8", "--seq-len", "32", "--out", str(out),
                          "--eval-formats", "mxint8,mxint4", "--lr", "1e-3", "--qat-config", "mxint_2468"])
    assert summary["formats"] == ["mxint2"] * 2 + ["mxint4"] * 2 + ["mxint6"] * 2 + ["mxint8"] * 2
    assert summary["losses"][-1] < summary["losses"][0]
    assert summary["seconds_per_step"] == summary["train_seconds"] / 8 and summary["final_loss"] == summary["losses"][-1]
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    meta = json.loads((out / "anchor" / "mfqat.json").read_text())
    assert meta["anchor_format"] == "mxint8" and meta["step"] == 8
    assert (out / "loss.png").stat().st_size > 1000
    mfqat.load_anchor(out / "anchor", "mxint4")


def test_resume_from_checkpoint(tmp_path):
    out = tmp_path / "run"
    common = ["--model", "tiny", "--steps", "6", "--seq-len", "32", "--qat-config", "mxint_2468"]
    train_main(common + ["--out", str(out), "--save-every", "3"])
    ck = out / "checkpoint-3"
    assert (ck / "mfqat_anchor" / "mfqat.json").is_file()
    s = train_main(common + ["--out", str(out / "resumed"), "--resume", str(ck)])
    assert len(s["losses"]) == 3 and s["formats"] == ["mxint6", "mxint6", "mxint8"]


def _load_state(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "model.safetensors")), torch.load(folder / "optimizer.bin", weights_only=False)


def test_resume_gives_the_uninterrupted_run(tmp_path):
    """N steps with --save-every, then a run resumed from checkpoint-K: same weights, optimizer
    (AdamW moments) and LR-scheduler state, same losses, as the uninterrupted N-step run."""
    from safetensors.torch import load_file

    common = ["--model", "tiny", "--steps", "4", "--seq-len", "32", "--lr", "3e-3", "--save-every", "1",
              "--save-master", "--eval-blocks", "1", "--lr-schedule", "cosine", "--warmup-steps", "1"]
    full = train_main(common + ["--out", str(tmp_path / "full")])
    resumed = train_main(common + ["--out", str(tmp_path / "resumed"), "--resume", str(tmp_path / "full" / "checkpoint-2")])
    assert resumed["losses"] == full["losses"][2:]
    w_full = load_file(str(tmp_path / "full" / "master" / "model.safetensors"))
    w_res = load_file(str(tmp_path / "resumed" / "master" / "model.safetensors"))
    assert w_full.keys() == w_res.keys()
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k
    # the step-3 checkpoint of both runs: model, optimizer moments and scheduler state
    (m_a, o_a), (m_b, o_b) = (_load_state(tmp_path / r / "checkpoint-3") for r in ("full", "resumed"))
    assert all(torch.equal(m_a[k], m_b[k]) for k in m_a)
    st_a, st_b = o_a["state"], o_b["state"]
    assert st_a.keys() == st_b.keys() and st_a
    for i in st_a:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(st_a[i][k]), torch.as_tensor(st_b[i][k])), (i, k)
    assert o_a["param_groups"][0]["lr"] == o_b["param_groups"][0]["lr"]
    sched_a, sched_b = (json.loads((tmp_path / r / "checkpoint-3" / "mfqat_scheduler.json").read_text())
                        for r in ("full", "resumed"))
    assert sched_a["last_epoch"] == sched_b["last_epoch"] == 3 and sched_a["_last_lr"] == sched_b["_last_lr"]


@pytest.mark.parametrize("extra", [[], ["--qat-config", "affine_joint", "--learn-scales"]], ids=["mxint", "learned-scales"])
def test_accelerate_ddp_two_ranks_same_weights(tmp_path, extra):
    """Both ranks end with the same parameters; with learned scales too (each width's (a, c) is used in only
    some passes of a joint step, and DDP must still reduce it: mfqat's zero term keeps it in every pass)."""
    dump = tmp_path / "w"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(ROOT / "scripts" / "train.py"), "--model", "tiny",
           "--steps", "4", "--seq-len", "32", "--out", str(tmp_path / "ddp"), "--dump-weights", str(dump), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    w0, w1 = (Path(f"{dump}.rank{i}").read_text() for i in (0, 1))
    assert w0 == w1
    meta = json.loads((tmp_path / "ddp" / "anchor" / "mfqat.json").read_text())
    assert bool(meta.get("refined")) == bool(extra)


def test_hf_trainer_callback(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = tiny_llama()
    mfqat.prepare(model, QATConfig(formats=["mxint4", "mxint8"], schedule="cyclic"))
    ids = torch.randint(0, 256, (16, 32))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                             logging_steps=1, eval_strategy="steps", eval_steps=4, save_steps=4,
                             report_to=[], use_cpu=True, learning_rate=1e-3)
    seen = []

    class Spy(MFQATCallback):
        def on_step_begin(self, a, state, control, model=None, **kw):
            super().on_step_begin(a, state, control, model=model, **kw)
            seen.append(model.model.layers[0].mlp.up_proj.fmt)

    cb = Spy(eval_formats=["mxint4", "mxint8"], anchor_format="mxint8")
    trainer = Trainer(model=model, args=args, train_dataset=ds, eval_dataset=ds[:4], callbacks=[cb])
    trainer.train()
    assert seen == ["mxint4", "mxint8", "mxint4", "mxint8"]
    logs = trainer.state.log_history
    assert any(l.get("mfqat_format") in ("mxint4", "mxint8") for l in logs)
    ev = [l for l in logs if "eval_mxint4_loss" in l]
    assert ev and ev[0]["eval_mxint4_loss"] > 0 and "eval_mxint8_ppl" in ev[0]
    anchor = tmp_path / "checkpoint-4" / "mfqat_anchor"
    assert json.loads((anchor / "mfqat.json").read_text())["step"] == 4
    mfqat.load_anchor(anchor, "mxint4")


def test_hf_callback_eval_losses_are_the_formats_losses(tmp_path):
    """eval_{fmt}_loss is the eval set's mean loss with the model in fmt (not in full precision)."""
    from transformers import Trainer, TrainingArguments

    model = tiny_llama()
    mfqat.prepare(model, QATConfig(formats=["mxint2", "mxint8"], schedule="cyclic"))
    ids = torch.randint(0, 256, (6, 32), generator=torch.Generator().manual_seed(0))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    cb = MFQATCallback(eval_formats=["mxint2", "mxint8"], anchor_format=None)
    trainer = Trainer(model=model, args=args, eval_dataset=ds, callbacks=[cb])
    metrics = trainer.evaluate()
    assert model.model.layers[0].mlp.up_proj.fmt == "mxint2"  # the schedule's format again (step 0)
    batches = [ids[:4], ids[4:]]  # the eval loader's batches, in order (no shuffling)

    def manual(fmt):
        mfqat.set_format(model, fmt)
        with torch.no_grad():
            return sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)

    want = {f: manual(f) for f in (None, "mxint2", "mxint8")}
    for f in ("mxint2", "mxint8"):
        assert metrics[f"eval_{f}_loss"] == pytest.approx(want[f], rel=1e-6, abs=1e-6), f
        assert metrics[f"eval_{f}_ppl"] == pytest.approx(math.exp(want[f]), rel=1e-6)
    assert abs(want["mxint2"] - want[None]) > 1e-3  # the check can tell the formats apart


def test_distillation_loss_and_training(tmp_path):
    from mfqat.data.sources import tiny_llama
    from mfqat.train.loop import distillation_loss

    model = mfqat.prepare(tiny_llama(), mfqat.QATConfig(formats=["mxint4"], schedule="fixed"))
    ctl = model.mfqat_controller
    batch = torch.randint(0, 256, (2, 16))
    ce = model(input_ids=batch, labels=batch).loss
    assert torch.allclose(distillation_loss(model, model, ctl, batch, 0, 1, 0.0), ce)
    kl_only = distillation_loss(model, model, ctl, batch, 0, 1, 1.0)
    assert kl_only.item() > 0  # mxint4 student differs from the fp teacher
    from mfqat.qat.prepare import qat_modules
    assert all(m.fmt == "mxint4" for _, m in qat_modules(model))  # formats restored
    s = train_main(["--model", "tiny", "--steps", "6", "--seq-len", "32", "--out", str(tmp_path / "d"),
                    "--distill", "0.5", "--lr", "1e-3", "--qat-config", "mxint_2468"])
    assert s["losses"][-1] < s["losses"][0]


def test_distillation_loss_is_kl_teacher_to_student():
    """--distill: alpha * KL(p_fp || p_q) + (1 - alpha) * CE, checked against the explicit formula
    (the reverse direction KL(p_q || p_fp) differs by far more than the tolerance)."""
    from mfqat.train.loop import distillation_loss

    model = mfqat.prepare(tiny_llama(), mfqat.QATConfig(formats=["mxint2"], schedule="fixed"))
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # peaked distributions: the two KL directions differ clearly
    ctl = model.mfqat_controller
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mfqat.set_format(model, None)
        log_t = torch.log_softmax(model(input_ids=batch).logits.double(), -1).reshape(-1, 256)
        mfqat.set_format(model, "mxint2")
        out = model(input_ids=batch, labels=batch)
        log_s = torch.log_softmax(out.logits.double(), -1).reshape(-1, 256)
    kl_ts = (log_t.exp() * (log_t - log_s)).sum(-1).mean().item()  # KL(teacher || student)
    kl_st = (log_s.exp() * (log_s - log_t)).sum(-1).mean().item()
    assert abs(kl_ts - kl_st) > 1e-2 * kl_ts  # the two directions are distinguishable here
    for alpha in (1.0, 0.25):
        got = distillation_loss(model, model, ctl, batch, 0, 1, alpha).item()
        assert got == pytest.approx((1 - alpha) * out.loss.item() + alpha * kl_ts, rel=1e-4), alpha
