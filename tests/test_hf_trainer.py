"""MFQATTrainer as reporters see it: per-format eval metrics in the Trainer's own log() call, eval_loss
in one fixed format, the processing_class tokenizer in every anchor, an anchor on save_model()."""
import json
import math

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

import mfqat
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.integrations.hf import MFQATCallback, MFQATTrainer
from mfqat.qat import QATConfig


class Reporter(TrainerCallback):
    """What a reporter (TensorBoard, W&B, the console) receives: on_log's logs, as they are then."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


@pytest.fixture
def setup(tmp_path):
    tok = tiny_tokenizer()
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)), QATConfig(formats=["mxint2", "mxint8"], schedule="cyclic"))
    ids = torch.randint(0, len(tok), (8, 32), generator=torch.Generator().manual_seed(0))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    return model, tok, ids, ds


def _manual(model, fmt, batches):
    mfqat.set_format(model, fmt)
    with torch.no_grad():
        return sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)


def test_reporters_see_per_format_metrics_and_eval_loss_is_in_the_anchor_format(setup, tmp_path):
    model, tok, ids, ds = setup
    rep = Reporter()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, logging_steps=1, eval_strategy="steps", eval_steps=3,
                             save_strategy="no", report_to=[], use_cpu=True, learning_rate=1e-3)
    trainer = MFQATTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ds[:8], processing_class=tok,
                           callbacks=[rep], eval_formats=["mxint2", "mxint8"])
    trainer.train()
    train_logs = [l for l in rep.logs if "loss" in l]
    assert train_logs and all(l.get("mfqat_format") in ("mxint2", "mxint8") for l in train_logs)
    (ev,) = [l for l in rep.logs if "eval_loss" in l]
    assert {"eval_mxint2_loss", "eval_mxint2_ppl", "eval_mxint8_loss", "eval_mxint8_ppl"} <= set(ev)
    batches = [ids[:4], ids[4:]]
    assert ev["eval_loss"] == pytest.approx(_manual(model, "mxint8", batches), rel=1e-5)  # the anchor format
    assert ev["eval_mxint2_loss"] == pytest.approx(_manual(model, "mxint2", batches), rel=1e-5)
    assert ev["eval_mxint2_ppl"] == pytest.approx(math.exp(ev["eval_mxint2_loss"]), rel=1e-6)
    # the schedule's format is back after evaluation (step 3 of the cyclic mxint2/mxint8 schedule)
    model.mfqat_controller.set_step(model, 3, 3)
    fmt = model.model.layers[0].mlp.up_proj.fmt
    trainer.evaluate()
    assert model.model.layers[0].mlp.up_proj.fmt == fmt


def test_save_model_and_checkpoints_carry_an_anchor_with_the_tokenizer(setup, tmp_path):
    model, tok, _, ds = setup
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             save_steps=2, report_to=[], use_cpu=True)
    trainer = MFQATTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoint-2" / "mfqat_anchor"
    assert (ckpt / "tokenizer.json").is_file()
    trainer.save_model(str(tmp_path / "final"))
    anchor = tmp_path / "final" / "mfqat_anchor"
    assert json.loads((anchor / "mfqat.json").read_text())["step"] == 2 and (anchor / "tokenizer.json").is_file()
    mfqat.load_anchor(anchor, "mxint2")


def test_plain_trainer_callback_uses_processing_class(setup, tmp_path):
    from transformers import Trainer

    model, tok, _, ds = setup
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, save_steps=1,
                             report_to=[], use_cpu=True)
    Trainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[MFQATCallback()]).train()
    assert (tmp_path / "checkpoint-1" / "mfqat_anchor" / "tokenizer.json").is_file()


def test_from_pretrained_of_an_anchor_is_the_anchor(tmp_path):
    from transformers import AutoModelForCausalLM

    mfqat.register_hf_quantizer()
    tok = tiny_tokenizer()
    anchor = mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), tmp_path / "a", "mxint8", tok)
    model = AutoModelForCausalLM.from_pretrained(anchor)
    ref = mfqat.load_anchor(anchor)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert model.mfqat_format == "mxint8" and getattr(model.config, "quantization_config", None) is None
    model.save_pretrained(tmp_path / "plain")  # a plain checkpoint again
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").state_dict()
    assert all(torch.equal(again[k], want[k]) for k in want)


def test_save_model_of_a_peft_model_writes_the_merged_anchor(setup, tmp_path):
    """issue 33 item 13: with LoRA adapters, save_model wrote PEFT's adapter files and no anchor."""
    from peft import LoraConfig, get_peft_model

    model, tok, ids, ds = setup
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True)
    trainer = MFQATTrainer(model=peft_model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_config.json").is_file()  # the Trainer's (PEFT's) own save
    loaded = mfqat.load_anchor(tmp_path / "final" / "mfqat_anchor", "mxint8")
    merged = peft_model.merge_and_unload()  # the adapters folded in: what the anchor must hold
    mfqat.set_format(merged, "mxint8")
    with torch.no_grad():
        assert torch.equal(loaded(ids[:2]).logits, merged(ids[:2]).logits)
