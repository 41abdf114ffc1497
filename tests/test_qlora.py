"""LoRA / QLoRA in `mfqat train` (peft + bitsandbytes, real), 8-bit optimizers, PEFT + MF-QAT."""
import json
import sys

import pytest
import torch

import mfqat
from mfqat.data import tiny_llama
from mfqat.integrations.train_loop import main as train_main

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

TINY = ["--model", "tiny", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-3"]


@pytest.mark.parametrize("optim,cls", [("adamw8bit", "AdamW8bit"), ("paged_adamw8bit", "PagedAdamW8bit")])
def test_bnb_optimizers_train_and_are_recorded(tmp_path, optim, cls):
    s = train_main(TINY + ["--steps", "3", "--no-qat", "--optim", optim, "--out", str(tmp_path / optim)])
    assert s["optimizer"] == cls
    assert all(torch.isfinite(torch.tensor(s["losses"])))


def test_missing_bitsandbytes_is_an_error_not_a_fallback(monkeypatch):
    from mfqat.integrations.optim import make_optimizer

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
    with pytest.raises(SystemExit, match="add --lora-rank"):
        train_main(TINY + ["--steps", "1", "--no-qat", "--base", "nf4", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="do not combine"):
        train_main(TINY + ["--steps", "1", "--lora-rank", "4", "--base", "nf4", "--out", str(tmp_path / "b")])
