"""FP8 releases stream (mfqat.anchor.source: each e4m3 weight dequantized by its block scales as it is read, before
the experts are stacked): the PTQ anchor quantized tensor by tensor from the FP8 folder is, code for code, the one
of the float32 model transformers loads from it (``from_pretrained(dequantize=True)``), dense and MoE, the
anchor never claims FP8, and ``export-mlx FP8_FOLDER`` never loads the model."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mfqat
from mfqat.anchor.stream import close_anchor, folder_anchor, inspect_folder
from mfqat.data.sources import load_model, tiny_tokenizer
from mfqat.models.catalog import SUPPORTED, build

from .test_fp8_source import _to_fp8, write_fp8_folder


def fp8_folder(name, root):
    """A tiny model of family ``name`` saved as an FP8 release: every decoder projection (per expert too) as e4m3
    codes with a float32 ``weight_scale_inv`` per BLOCK x BLOCK block, and a static activation scale beside
    them (a float model uses neither)."""
    tok = tiny_tokenizer()
    build(*SUPPORTED[name], len(tok)).to(torch.bfloat16).save_pretrained(root / "src")
    tensors = {}
    for k, v in load_file(root / "src" / "model.safetensors").items():
        if ".layers." in k and k.endswith("proj.weight") and v.dim() == 2:
            tensors[k], tensors[f"{k}_scale_inv"] = _to_fp8(v.float())
            tensors[k.replace(".weight", ".activation_scale")] = torch.ones(1)
        else:
            tensors[k] = v
    return write_fp8_folder(root, tensors, tok)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_an_fp8_release_streams_to_the_loaded_models_anchor(name, tmp_path):
    folder = fp8_folder(name, tmp_path)
    inspected = inspect_folder(folder)
    assert inspected[0] is None, inspected[0]
    model, tok = load_model(str(folder))  # transformers dequantizes on load (float32)
    want = mfqat.read_anchor(mfqat.save_anchor(model, tmp_path / "loaded", "mxint8", tok))
    got = folder_anchor(folder, "mxint8", inspected=inspected)
    try:
        assert sorted(got.quantized) == sorted(want.quantized) and sorted(got.plain) == sorted(want.plain)
        fp8 = [k for k in want.quantized if got.meta["tensors"][k]["dtype"] == "float32"]
        assert fp8  # the dequantized weights are recorded as the float32 model holds them
        for k in want.quantized:
            a, b = got.quantized[k], want.quantized[k]
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), k
        for k in want.plain:
            assert torch.equal(got.plain[k].float(), want.plain[k].float()), k
        assert "quantization_config" not in got.config and "quantization_config" not in want.config
    finally:
        close_anchor(got)


def test_an_fp8_export_never_loads_the_model(tmp_path, monkeypatch):
    pytest.importorskip("mlx_lm")
    from mfqat.data import sources
    from mfqat.export import to_mlx

    folder = fp8_folder("qwen3_moe", tmp_path)

    def refuse(*a, **k):
        raise AssertionError("the FP8 export loaded the model")
    monkeypatch.setattr(sources, "load_model", refuse)
    rep = to_mlx(folder, tmp_path / "m", recipe="uniform:mxint4")
    assert rep["ptq"] == "tensor by tensor" and rep["verify"]["weights_bit_exact"]
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and "quant_method" not in cfg.get("quantization_config", {})


def test_a_corrupt_fp8_scale_grid_is_named(tmp_path):
    folder = fp8_folder("llama", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    tensors[key] = tensors[key][:, :1].repeat(1, 3)[:, :3]  # a grid that does not divide the weight
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    anchor = folder_anchor(folder, "mxint8")
    try:
        with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj.weight: FP8 weight .*scales \(2, 3\).*corrupt"):
            anchor.quantized["model.layers.0.self_attn.q_proj.weight"]
    finally:
        close_anchor(anchor)
