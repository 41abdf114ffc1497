"""FP8 source checkpoints (e4m3 weights with a float32 ``weight_scale_inv`` per 32 x 32 block, as DeepSeek-V3
and the Qwen FP8 releases ship them, here at a tiny block size): mfqat loads them dequantized, block scale by
block scale and experts after, and never carries the FP8 claim into what it writes."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mfqat
from mfqat.data.sources import dequantizing_kwargs, load_model, tiny_tokenizer

from mfqat.models.catalog import SUPPORTED, build  # the tiny family models

BLOCK = 32


def _to_fp8(weight: torch.Tensor):
    """(e4m3 codes, scale_inv per BLOCK x BLOCK block) of a float matrix, as FP8 checkpoints store them."""
    out, inp = weight.shape
    blocks = weight.reshape(out // BLOCK, BLOCK, inp // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    return (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(out, inp), scale.float()


def _dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out, inp = codes.shape
    return (codes.float().reshape(out // BLOCK, BLOCK, inp // BLOCK, BLOCK) * scale[:, None, :, None]).reshape(out, inp)


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """A tiny Qwen3-MoE saved as an FP8 checkpoint (per-expert names on disk), with the float weights it holds."""
    tok = tiny_tokenizer()
    root = tmp_path_factory.mktemp("fp8")
    build(*SUPPORTED["qwen3_moe"], len(tok)).save_pretrained(root / "src")
    tensors, expect = {}, {}
    for k, v in load_file(root / "src" / "model.safetensors").items():
        if ".layers." in k and k.endswith("proj.weight") and v.dim() == 2:
            tensors[k], tensors[f"{k}_scale_inv"] = _to_fp8(v)
            expect[k] = _dequantized(tensors[k], tensors[f"{k}_scale_inv"])
        else:
            tensors[k] = expect[k] = v
    return write_fp8_folder(root, tensors, tok), expect


def write_fp8_folder(root, tensors, tok):
    """``root / "fp8"``: ``tensors`` in one safetensors file, ``root / "src"``'s config with an FP8
    quantization_config (BLOCK x BLOCK blocks), and the tokenizer."""
    (root / "fp8").mkdir()
    save_file(tensors, root / "fp8" / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((root / "src" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    (root / "fp8" / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(root / "fp8")
    return root / "fp8"


def test_fp8_checkpoint_loads_dequantized_block_by_block_experts_stacked_after(fp8_moe):
    folder, expect = fp8_moe
    model, _ = load_model(str(folder))
    got = model.state_dict()
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], expect["model.layers.0.self_attn.q_proj.weight"])
    fused = got["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(fused.shape[0]):
        gate, up = expect[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"], expect[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
        assert torch.equal(fused[e], torch.cat([gate, up]))
        assert torch.equal(got["model.layers.1.mlp.experts.down_proj"][e], expect[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])
    assert not any(hasattr(m, "weight_scale_inv") for m in model.modules())  # no FP8Linear (an nn.Linear subclass)
    assert type(model.get_submodule("model.layers.0.self_attn.q_proj")) is torch.nn.Linear


def test_fp8_is_dequantized_on_every_device_and_never_claimed_by_the_anchor(fp8_moe, tmp_path):
    """``dequantize=True`` is what makes transformers dequantize on an NVIDIA GPU too (it would load FP8Linear
    modules there, which prepare does not replace); the anchor's config says nothing of FP8."""
    folder, _ = fp8_moe
    qc = dequantizing_kwargs(str(folder))["quantization_config"]
    assert qc.dequantize is True and list(qc.weight_block_size) == [BLOCK, BLOCK]
    model, tok = load_model(str(folder))
    mfqat.prepare(model, mfqat.QATConfig())
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    assert json.loads((anchor / "config.json").read_text())["quantization_config"]["quant_method"] == "mfqat"
    assert "model.layers.1.mlp.experts.gate_up_proj" in json.loads((anchor / "mfqat.json").read_text())["tensors"]


@pytest.mark.parametrize("method", ["gptq", "bitsandbytes", "compressed-tensors"])
def test_other_prequantized_checkpoints_are_refused_by_name(method, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": {"quant_method": method}}))
    with pytest.raises(ValueError, match=f"pre-quantized {method} checkpoint.*pass the original model"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("qc, says", [({"quant_method": "mfqat", "format": "mxint8"}, "mfqat.json is missing"),
                                      ({"group_size": 64, "bits": 4}, "MLX-quantized model")])
def test_an_incomplete_anchor_or_an_mlx_model_is_named_for_what_it_is(qc, says, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": qc}))
    with pytest.raises(ValueError, match=says):
        load_model(str(tmp_path))


def test_fp8_checkpoint_exports_to_mlx_directly(fp8_moe, tmp_path):
    """`mfqat export-mlx FP8_FOLDER`: quantized from the dequantized weights (experts as switch_mlp), checked."""
    from mfqat.export import to_mlx

    folder, _ = fp8_moe
    rep = to_mlx(folder, tmp_path / "mlx", recipe="uniform:mxint4")
    assert rep["verify"]["weights_bit_exact"]
    assert any("switch_mlp" in n for t in rep["tensors"].values() for n in t.get("mlx_names", []))
