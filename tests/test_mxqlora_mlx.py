"""One MX-QLoRA adapter, two slices of one anchor, two backends: PyTorch (peft on load_anchor)
and mlx-lm (the converted adapter on `mfqat export-mlx` exports) give the same logits."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import mfqat
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.mxqlora.model import lora_parameters, mx_qlora_model, save_mx_adapter, set_base_format
from mfqat.mxqlora.mlx_adapter import peft_to_mlx

pytest.importorskip("peft")
mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An mxint8 anchor, an adapter trained on it (cycled mxint8/mxint4), its mlx-lm twin, two exports."""
    from mfqat.export import to_mlx

    d = tmp_path_factory.mktemp("mxq_mlx")
    tok = tiny_tokenizer()
    anchor = mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), d / "anchor", "mxint8", tokenizer=tok)
    torch.manual_seed(0)
    model = mx_qlora_model(anchor, rank=4, alpha=8)
    opt = torch.optim.AdamW(lora_parameters(model), lr=5e-2)
    x = torch.randint(0, len(tok), (2, 16))
    for step in range(4):
        set_base_format(model, ["mxint8", "mxint4"][step % 2])
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # a tiny random model barely moves in 4 steps: make the adapter's effect large
        for p in lora_parameters(model):
            p.mul_(20.0)
    save_mx_adapter(model, d / "adapter")
    peft_to_mlx(d / "adapter", d / "mlx_adapter")
    for fmt in ("mxint8", "mxint4"):  # float32 scales: MLX computes in float32 like PyTorch
        to_mlx(anchor, d / fmt, recipe=f"uniform:{fmt}", scale_dtype="float32")
    return d


def export_reference(setup, fmt):
    """The float32 PyTorch model holding exactly the weights of the MLX export ``setup / fmt``: its
    targets are load_anchor(anchor, fmt)'s, but the recipe also quantizes the tied embedding and
    keeps norms in bfloat16 (mfqat.export.mlx_export.reference_state, what export-mlx verifies)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from mfqat.export.mlx_export import plan_from_report, reference_state

    anchor = mfqat.read_anchor(setup / "anchor")
    plan = plan_from_report(json.loads((setup / fmt / "mfqat_export.json").read_text()))
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["llama"].from_dict(anchor.config), dtype=torch.float32)
    model.load_state_dict(reference_state(anchor, plan), strict=False)
    model.tie_weights()
    ours = mfqat.load_anchor(setup / "anchor", fmt).state_dict()
    assert all(torch.equal(model.state_dict()[k], ours[k]) for k in anchor.quantized)  # same base as training
    return model.eval()


@pytest.mark.parametrize("fmt", ["mxint8", "mxint4"])
def test_one_adapter_same_logits_in_pytorch_and_mlx_lm(setup, fmt):
    from peft import PeftModel

    ids = np.random.default_rng(1).integers(0, 200, (1, 24))
    base = export_reference(setup, fmt)
    with torch.no_grad():
        plain = base(input_ids=torch.tensor(ids)).logits.numpy()
        pt = PeftModel.from_pretrained(base, str(setup / "adapter")).eval()(input_ids=torch.tensor(ids)).logits.numpy()
    model, _ = mlx_lm.load(str(setup / fmt), adapter_path=str(setup / "mlx_adapter"))
    out = model(mx.array(ids))
    assert out.dtype == mx.float32
    scale = max(1.0, float(np.abs(pt).max()))
    assert np.abs(np.array(out) - pt).max() <= 1e-5 * scale  # float32 summation order only
    assert np.abs(pt - plain).max() > 0.1 * scale  # the adapter matters, far beyond that tolerance


def test_config_is_mlx_lm_layout(setup):
    cfg = json.loads((setup / "mlx_adapter" / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["num_layers"] == -1
    assert cfg["lora_parameters"]["scale"] == 8 / 4 and cfg["lora_parameters"]["rank"] == 4
    assert "self_attn.q_proj" in cfg["lora_parameters"]["keys"] and "mlp.down_proj" in cfg["lora_parameters"]["keys"]


def test_refuses_what_mlx_lm_cannot_run(setup, tmp_path):
    import shutil

    bad = tmp_path / "dora"
    shutil.copytree(setup / "adapter", bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True has no mlx-lm LoRA equivalent"):
        peft_to_mlx(bad, tmp_path / "out")
    head = tmp_path / "head"
    shutil.copytree(setup / "adapter", head)
    sd = load_file(str(head / "adapter_model.safetensors"))
    sd["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
    save_file(sd, str(head / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.lora_A.weight is not a LoRA matrix of a Linear inside"):
        peft_to_mlx(head, tmp_path / "out")
    assert not (tmp_path / "out").exists()
