"""Issue 17 on a tiny random Llama: honest stored size, MXFP post-training export, anchor block sizes
carried as MLX group sizes (or refused before writing), and the scale dtype mlx_lm.convert writes."""
import json

import numpy as np
import pytest
import torch

import mfqat
from mfqat.formats import get_format
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.export import to_mlx

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, tokenizer, folder): a tiny tied Llama saved as a full-precision HF folder."""
    d = tmp_path_factory.mktemp("tiny")
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), tie=True)
    model.save_pretrained(d / "fp")
    tok.save_pretrained(d / "fp")
    return model, tok, d


def _anchor(tiny, fmt: str, block_size: int):
    model, tok, d = tiny
    path = d / f"{fmt}-b{block_size}"
    if not path.exists():
        mfqat.save_anchor(model, path, fmt, tok, block_size=block_size)
    return path


def _quantized_bytes_and_count(folder):
    """Independently of the exporter: bytes of every MLX-quantized matrix (weight+scales+biases) and its
    element count (from the packed words and the config's bits)."""
    cfg = json.loads((folder / "config.json").read_text())["quantization"]
    weights = mfqat.export.mlx_export.load_weights(folder)
    nbytes, count = 0, 0
    for k in [k for k in weights if k.endswith(".scales")]:
        module = k[: -len(".scales")]
        bits = (cfg.get(module) or cfg)["bits"]
        w = weights[f"{module}.weight"]
        count += w.size * 32 // bits
        nbytes += w.nbytes + weights[k].nbytes + (weights[f"{module}.biases"].nbytes if f"{module}.biases" in weights else 0)
    return nbytes, count


@pytest.mark.parametrize("recipe,scale_dtype", [("uniform:mxint4", "float32"), ("uniform:mxint4", "bfloat16")])
def test_stored_bits_per_weight_is_the_bytes_on_disk(tiny, tmp_path, recipe, scale_dtype):
    model, _, _ = tiny
    out = tmp_path / "m"
    rep = to_mlx(_anchor(tiny, "mxint8", 32), out, recipe=recipe, scale_dtype=scale_dtype, verify=False)
    on_disk = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    n_params = sum(p.numel() for p in model.parameters())  # tied embedding counted once
    assert rep["stored_bits_per_weight"] == 8 * on_disk / n_params
    nbytes, count = _quantized_bytes_and_count(out)
    assert rep["stored_bits_per_weight_quantized"] == 8 * nbytes / count
    # mxint4 g32 in affine: 4 bits + (scale + bias) per 32 -> 6 bits (fp32) or 5 bits (bf16)
    assert rep["stored_bits_per_weight_quantized"] == (6.0 if scale_dtype == "float32" else 5.0)
    assert json.loads((out / "mfqat_export.json").read_text())["stored_bits_per_weight"] == rep["stored_bits_per_weight"]
    assert rep["bits_per_weight"] == 4.25  # the MX figure stays beside it


@pytest.mark.parametrize("recipe", ["uniform:mxfp4", "uniform:mxfp8", "seed:mxfp", "auto:6:mxfp"])
def test_mxfp_post_training_export_goes_through_an_mxfp8_anchor(tiny, tmp_path, recipe):
    """MLX's dequantization equals PyTorch's Slice-and-Scale of the weights quantized to MXFP8."""
    model, _, d = tiny
    rep = to_mlx(d / "fp", tmp_path / "m", recipe=recipe)
    assert rep["verify"]["weights_bit_exact"] and rep["verify"]["max_abs_logit_diff"] < 1e-4
    weights = mfqat.export.mlx_export.load_weights(tmp_path / "m")
    params = dict(model.named_parameters())
    modes = set()
    for name, t in rep["tensors"].items():
        if "origin" not in t:
            continue
        w = params[name].detach().float()
        rule = mfqat.DEFAULT_SCALE_RULE.get(get_format(t["source"]).name, "floor")  # the format's default rule
        if t["origin"] == "anchor":  # decoder Linear: Slice-and-Scale of the MXFP8 PTQ anchor
            q = mfqat.slice_and_scale(mfqat.quantize(w, "mxfp8_e4m3", 32), t["source"], rule)
        else:  # the (tied) embedding the anchor keeps in full precision: quantized directly
            q = mfqat.quantize(w, t["source"], 32, scale_rule=rule)
        want = q.dequantize(torch.float32).numpy()
        module = name[: -len(".weight")]
        mode, bits = t["mlx"], t["bits"]
        got = mx.dequantize(weights[name], weights[f"{module}.scales"], None, group_size=32, bits=bits, mode=mode)
        assert np.array_equal(np.array(got.astype(mx.float32)), want), name
        modes.add(mode)
    assert modes <= {"mxfp4", "mxfp8"} and modes


def test_block64_mxint_anchor_exports_with_group_64(tiny, tmp_path):
    out = tmp_path / "m"
    rep = to_mlx(_anchor(tiny, "mxint8", 64), out, recipe="uniform:mxint4")
    assert rep["verify"]["weights_bit_exact"] and rep["verify"]["max_abs_logit_diff"] < 1e-4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["group_size"] == 64
    model, tok = mlx_lm.load(str(out))
    w = mfqat.export.mlx_export.load_weights(out)
    assert w["model.layers.0.mlp.down_proj.scales"].shape == (64, 128 // 64)
    assert isinstance(mlx_lm.generate(model, tok, prompt="def f", max_tokens=3), str)


@pytest.mark.parametrize("fmt,block,recipe,why", [
    ("mxfp8", 64, "uniform:mxfp4", r"group sizes \[32\]"),
    ("mxfp8", 64, "seed", r"group sizes \[32\]"),
    ("mxint8", 16, "uniform:mxint4", r"group sizes \[32, 64, 128\]"),
])
def test_block_sizes_mlx_cannot_carry_are_refused_before_writing(tiny, tmp_path, fmt, block, recipe, why):
    out = tmp_path / "never"
    for verify in (True, False):
        with pytest.raises(ValueError, match=why):
            to_mlx(_anchor(tiny, fmt, block), out, recipe=recipe, verify=verify)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_recipe_family_must_match_the_anchor(tiny, tmp_path):
    with pytest.raises(ValueError, match="asks for the mxfp family"):
        to_mlx(_anchor(tiny, "mxint8", 32), tmp_path / "x", recipe="seed:mxfp")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_default_scale_dtype_is_what_mlx_lm_convert_writes(tiny, tmp_path, dtype):
    _, tok, _ = tiny
    src = tmp_path / "src"
    tiny_llama(vocab_size=len(tok), tie=True).to(dtype).save_pretrained(src)
    tok.save_pretrained(src)
    mlx_lm.convert(str(src), str(tmp_path / "theirs"), quantize=True, q_group_size=32, q_bits=4)
    theirs = {k: v.dtype for k, v in mx.load(str(tmp_path / "theirs" / "model.safetensors")).items()
              if k.endswith(".scales")}
    rep = to_mlx(src, tmp_path / "ours", recipe="uniform:mxint4")
    assert rep["verify"]["weights_bit_exact"]
    ours = {k: v.dtype for k, v in mfqat.export.mlx_export.load_weights(tmp_path / "ours").items()
            if k.endswith(".scales")}
    assert set(ours.values()) == set(theirs.values()) == {getattr(mx, str(dtype).replace("torch.", ""))}
