"""LoRA's default targets work for every model family: `mfqat train --lora-rank` (peft, ``all-linear``)
and `mfqat mx-qlora` (every quantized Linear), never only Llama's module names."""
import pytest
import torch

import mfqat
from mfqat.train.lora import DEFAULT_TARGETS, apply_lora
from mfqat.models import family_for
from mfqat.mxqlora.model import mx_qlora_model

from mfqat.models.catalog import SUPPORTED, build  # the tiny family models

EXPECTED = {  # module names every family's default must adapt (its attention and MLP Linears)
    **{name: set(family_for(name).lora_targets) for name in ("llama", "phi3", "gpt_neox")},
    "qwen3_moe": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "qwen3_5": {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "o_proj", "gate_proj", "down_proj"},
}


def adapted(model) -> set:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_default_lora_targets_adapt_every_familys_linears(name, tok):
    model_type, extra = SUPPORTED[name]
    model = apply_lora(build(model_type, extra, len(tok)), 4, 8.0, 0.0, DEFAULT_TARGETS)
    got = adapted(model)
    assert EXPECTED[name] <= got, f"{name}: {sorted(EXPECTED[name] - got)} not adapted"
    assert "lm_head" not in got and "embed_out" not in got
    if name == "llama":
        assert got == EXPECTED["llama"]  # the default before all-linear, unchanged on Llama
    ids = torch.randint(0, len(tok), (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("name", ["phi3", "gpt_neox"])
def test_mx_qlora_default_targets_adapt_every_quantized_linear(name, tok, tmp_path):
    model_type, extra = SUPPORTED[name]
    anchor = mfqat.save_anchor(build(model_type, extra, len(tok)), tmp_path / "a", "mxint8", tok)
    model = mx_qlora_model(anchor, rank=4)
    assert set(model.mx_qlora["targets"]) == EXPECTED[name]


@pytest.mark.parametrize("name", ["qwen3_moe", "phi3", "gpt_neox"])
def test_from_pretrained_of_a_family_anchor_is_load_anchor(name, tok, tmp_path):
    """transformers 5 loads an anchor's fused-expert names as they are: AutoModelForCausalLM.from_pretrained
    (mfqat's HfQuantizer) gives load_anchor's model, with no weight reported missing or unexpected."""
    from transformers import AutoModelForCausalLM

    mfqat.register_hf_quantizer()
    model_type, extra = SUPPORTED[name]
    cfg = mfqat.QATConfig(formats=["mxint8", "mxint4"], schedule="joint", scale_rules={"mxint4": "search"})
    model = mfqat.prepare(build(model_type, extra, len(tok)), cfg)
    model(torch.randint(0, len(tok), (2, 16)))  # records the input importance the anchor stores
    mfqat.sync_importance(model)
    anchor = mfqat.save_anchor(model, tmp_path / "a", "mxint8", tok)
    assert any(k.endswith(".importance") for k in safe_open_keys(anchor))
    hf, info = AutoModelForCausalLM.from_pretrained(anchor, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    ids = torch.randint(0, len(tok), (1, 12))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, mfqat.load_anchor(anchor)(ids).logits)


def safe_open_keys(folder):
    from safetensors import safe_open

    keys = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            keys += list(fh.keys())
    return keys
