"""LoRA / QLoRA in `mfqat train` (peft + bitsandbytes NF4/INT8 bases, real: mfqat/train/lora.py; MX-QLoRA is
tests/test_mxqlora*.py), 8-bit optimizers, PEFT + MF-QAT."""
import json
import sys

import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.train.loop import main as train_main

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-3"]


@pytest.mark.parametrize("optim,cls", [("adamw8bit", "AdamW8bit"), ("paged_adamw8bit", "PagedAdamW8bit")])
def test_bnb_optimizers_train_and_are_recorded(tmp_path, optim, cls):
    s = train_main(TINY + ["--steps", "3", "--no-qat", "--optim", optim, "--out", str(tmp_path / optim)])
    assert s["optimizer"] == cls
    assert all(torch.isfinite(torch.tensor(s["losses"])))


def test_missing_bitsandbytes_is_an_error_not_a_fallback(monkeypatch):
    from mfqat.train.optim import make_optimizer

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(RuntimeError, match="adamw8bit needs bitsandbytes.*--optim adamw"):
        make_optimizer("adamw8bit", torch.nn.Linear(4, 4).parameters(), 1e-3, 0.0)


@pytest.mark.parametrize("base", ["nf4", "int8"])
def test_qlora_on_bnb_base_trains_only_adapters(tmp_path, base):
    out = tmp_path / base
    s = train_main(TINY + ["--steps", "3", "--no-qat", "--lora-rank", "4", "--base", base, "--out", str(out)])
    assert s["base"] == base and 0 < s["trainable_params"] < s["total_params"] / 10
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"
    from safetensors.torch import load_file
    keys = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert keys and all("lora_" in k for k in keys)
    assert s["eval"][-1]["format"] == f"{base} base + LoRA"


def test_lora_flags_refuse_nonsense(tmp_path):
    # refused before any model loads (issue 33: these were checked only after loading)
    with pytest.raises(ValueError, match="add --lora-rank"):
        train_main(TINY + ["--steps", "1", "--no-qat", "--base", "nf4", "--out", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="do not combine"):
        train_main(TINY + ["--steps", "1", "--lora-rank", "4", "--base", "nf4", "--out", str(tmp_path / "b")])


def test_prepare_refuses_a_peft_model():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="already holds PEFT adapters.*prepare\\(model, config\\) first"):
        mfqat.prepare(model, mfqat.QATConfig(formats=["mxint4"], schedule="fixed"))


def test_trainer_callback_saves_the_merged_anchor_of_a_peft_model(tmp_path):
    """mfqat.prepare -> peft.get_peft_model -> Trainer + MFQATCallback: the checkpoint's anchor holds
    the adapters merged into the base weights; the training model keeps its adapters unmerged."""
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from mfqat.integrations.hf import MFQATCallback

    model = mfqat.prepare(tiny_llama(), mfqat.QATConfig(formats=["mxint4", "mxint8"], schedule="cyclic"))
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]))
    assert type(model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]) is torch.nn.Linear
    ids = torch.randint(0, 256, (8, 32))
    ds = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, save_steps=2,
                             report_to=[], use_cpu=True, learning_rate=1e-2)
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[MFQATCallback(anchor_format="mxint8")]).train()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = layer.lora_B["default"].weight @ layer.lora_A["default"].weight * layer.scaling["default"]
    assert delta.abs().max() > 0  # the adapters trained
    merged = layer.base_layer.weight.detach() + delta.detach()
    loaded = mfqat.load_anchor(tmp_path / "checkpoint-2" / "mfqat_anchor", "mxint8")
    assert torch.equal(loaded.model.layers[0].self_attn.q_proj.weight, mfqat.fake_quantize(merged, "mxint8"))
    assert (tmp_path / "checkpoint-2" / "adapter_config.json").is_file()  # Trainer saved the adapters
    assert not layer.merged


def test_lora_with_mf_qat_follows_the_schedule_and_saves_anchor_and_adapter(tmp_path):
    out = tmp_path / "qat_lora"
    s = train_main(TINY + ["--steps", "2", "--formats", "mxint4,mxint8", "--schedule", "cyclic",
                           "--lora-rank", "4", "--out", str(out)])
    assert s["formats"] == ["mxint4", "mxint8"]  # the controller is found under the peft wrapper
    assert (out / "anchor" / "mfqat.json").is_file() and (out / "adapter" / "adapter_config.json").is_file()
    assert s["trainable_params"] < s["total_params"] / 10


NF4 = TINY + ["--no-qat", "--lora-rank", "4", "--base", "nf4", "--eval-blocks", "1", "--save-every", "1"]


@pytest.fixture(scope="module")
def nf4_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nf4") / "full"
    return out, train_main(NF4 + ["--steps", "3", "--out", str(out)])


def test_nf4_qlora_resume_gives_the_uninterrupted_run(nf4_run, tmp_path):
    """issue 33: the NF4 base's quantization state (absmax, quant maps) in the checkpoint broke the
    resume; a resumed run must now give the uninterrupted run's losses and adapters, bit for bit."""
    from safetensors.torch import load_file

    full_out, full = nf4_run
    resumed = train_main(NF4 + ["--steps", "3", "--out", str(tmp_path / "r"), "--resume", str(full_out / "checkpoint-1")])
    assert resumed["losses"] == full["losses"][1:]
    a = load_file(str(full_out / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "r" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_nf4_resume_refuses_a_checkpoint_lacking_a_tensor(nf4_run, tmp_path):
    """Non-strict loading skips only bnb's save-only state: a checkpoint without an adapter tensor is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mfqat.storage.train_checkpoint import seal_checkpoint

    ck = shutil.copytree(nf4_run[0] / "checkpoint-1", tmp_path / "ck")
    sd = load_file(str(ck / "model.safetensors"))
    dropped = next(k for k in sd if "lora_A" in k)
    del sd[dropped]
    save_file(sd, str(ck / "model.safetensors"), metadata={"format": "pt"})
    seal_checkpoint(ck, 1)
    with pytest.raises(ValueError, match="lacks tensor .*lora_A"):
        train_main(NF4 + ["--steps", "3", "--out", str(tmp_path / "r"), "--resume", str(ck)])


@pytest.mark.parametrize("base,layer", [("nf4", "Linear4bit"), ("int8", "Linear8bitLt")])
def test_prepare_names_a_bitsandbytes_model_as_already_quantized(tmp_path, base, layer):
    """issue 33 item 13: it said the targets matched no nn.Linear, as if the model had no layers to train."""
    from transformers import AutoModelForCausalLM

    from mfqat.train.lora import bnb_config

    tiny_llama().save_pretrained(tmp_path)
    q = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=bnb_config(base), device_map="cpu")
    with pytest.raises(ValueError, match=rf"already quantized by bitsandbytes \(\d+ {layer} layers.*"
                                         r"without quantization_config.*--no-qat"):
        mfqat.prepare(q, mfqat.QATConfig(formats=["mxint4"], schedule="fixed"))
