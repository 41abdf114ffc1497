"""MLX export checked independently of the exporter's own report (whose ``exact`` entries and
``weights_bit_exact`` are set, not measured): a tiny Llama with non-default rope_theta and
rms_norm_eps, every exported tensor dequantized by MLX against Slice-and-Scale of the anchor,
logits on a long prompt against ``load_anchor(fmt=...)`` within 1e-4 (MXINT: MLX computes in float32;
MXFP exports compute in bfloat16 and get a bf16 tolerance), greedy generation token for token."""
import json

import numpy as np
import pytest
import torch

import mfqat
from mfqat.data.sources import pydoc_text, tiny_tokenizer
from mfqat.export import to_mlx

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

ROPE_THETA, RMS_EPS = 500000.0, 1e-3
PROMPT = pydoc_text()[5000:5600]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, rope_theta=ROPE_THETA, rms_norm_eps=RMS_EPS)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(10)  # peaked logits: a wrong setting moves them well past 1e-4
        for n, p in model.named_parameters():
            if "norm" in n:  # non-trivial norm weights (a dropped norm weight shows)
                p.copy_(1 + 0.5 * torch.rand_like(p))
    d = tmp_path_factory.mktemp("exact")
    return {"tok": tok, "int": mfqat.save_anchor(model, d / "int", "mxint8", tok),
            "fp": mfqat.save_anchor(model, d / "fp", "mxfp8", tok)}


def rule(fmt):
    """The scale rule the exporter quantizes a full-precision tensor with: the format's default."""
    return mfqat.DEFAULT_SCALE_RULE.get(mfqat.get_format(fmt).name, "floor")


def expected_weights(anchor, fmt):
    """What a uniform:fmt export must hold: Slice-and-Scale of every anchor tensor, and (README:
    uniform recipes quantize the embedding and an untied lm_head too) direct quantization of the
    anchor's plain 2-D weights."""
    want = {n: mfqat.slice_and_scale(q, fmt).dequantize(torch.float32) for n, q in anchor.quantized.items()}
    for n, v in anchor.plain.items():
        if n.endswith(".weight") and v.dim() == 2:
            want[n] = mfqat.quantize(v.float(), fmt, 32, scale_rule=rule(fmt)).dequantize(torch.float32)
    return want


def check_weights_independently(anchor_dir, out, report) -> int:
    """Every tensor the report says was exported from the anchor ("origin": anchor / ptq, in format
    "source"): MLX's dequantization of the files equals mfqat's Slice-and-Scale (anchor) or direct
    quantization (ptq), bit for bit. Replaces the report's own ``exact`` / ``weights_bit_exact``
    flags, which the exporter sets rather than measures. Returns the number of tensors checked."""
    anchor = mfqat.read_anchor(anchor_dir)
    cfg = json.loads((out / "config.json").read_text())
    weights = {}
    for f in sorted(out.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    checked = 0
    for name, t in report["tensors"].items():
        if "origin" not in t:
            continue
        fmt, bs = t["source"], anchor.meta.get("block_size", 32)
        q = (mfqat.slice_and_scale(anchor.quantized[name], fmt) if t["origin"] == "anchor"
             else mfqat.quantize(anchor.plain[name].float(), fmt, bs, scale_rule=rule(fmt)))
        got = mlx_dequantized(out, name[: -len(".weight")], weights, cfg["quantization"])
        assert np.array_equal(got, q.dequantize(torch.float32).numpy()), f"{name} ({fmt})"
        checked += 1
    return checked


def pytorch_reference(anchor_dir, fmt=None, report=None):
    """load_anchor in ``fmt`` with the export's 2-D plain weights quantized, the rest (norms) in bf16;
    with ``report``: every tensor in the format the report names (mixed plans)."""
    model = mfqat.load_anchor(anchor_dir, fmt=fmt)
    anchor = mfqat.read_anchor(anchor_dir)
    if report is None:
        want = expected_weights(anchor, fmt)
    else:
        want = {n: (mfqat.slice_and_scale(anchor.quantized[n], t["source"]) if t["origin"] == "anchor"
                    else mfqat.quantize(anchor.plain[n].float(), t["source"], 32, scale_rule=rule(t["source"]))
                    ).dequantize(torch.float32)
                for n, t in report["tensors"].items() if "origin" in t}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(want[n] if n in want else p.bfloat16().float())
    return model


def assert_same_greedy_generation(out, ref, prompt, n_new=12):
    """mlx_lm.generate (greedy) on the export gives the tokens of PyTorch's greedy decoding of ``ref``."""
    model, tok = mlx_lm.load(str(out))
    text = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=n_new)
    start = tok.encode(prompt)
    seq = list(start)
    with torch.no_grad():
        for _ in range(n_new):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    assert text == tok.decode(seq[len(start):])


def mlx_dequantized(out, module, weights, quant):
    entry = quant.get(module, quant)
    if entry is False or f"{module}.scales" not in weights:
        return np.array(weights[f"{module}.weight"].astype(mx.float32))
    got = mx.dequantize(weights[f"{module}.weight"], weights[f"{module}.scales"], weights.get(f"{module}.biases"),
                        group_size=entry["group_size"], bits=entry["bits"], mode=entry.get("mode", "affine"))
    return np.array(got.astype(mx.float32))


@pytest.mark.parametrize("family,fmt", [("int", "mxint4"), ("int", "mxint3"), ("fp", "mxfp4_e2m1"),
                                        ("fp", "mxfp6_e3m2")])
def test_export_matches_independent_reference(setup, tmp_path, family, fmt):
    out = tmp_path / "m"
    rep = to_mlx(setup[family], out, recipe=f"uniform:{fmt}")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rope_theta"] == ROPE_THETA and cfg["rms_norm_eps"] == RMS_EPS
    assert cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False
    # every quantized tensor: MLX's dequantization equals Slice-and-Scale of the anchor, bit for bit
    anchor = mfqat.read_anchor(setup[family])
    weights = {}
    for f in sorted(out.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    want = expected_weights(anchor, fmt)
    assert len(want) == len(anchor.quantized) + 2  # + embed_tokens, lm_head
    for name, w in want.items():
        got = mlx_dequantized(out, name[: -len(".weight")], weights, cfg["quantization"])
        assert np.array_equal(got, w.numpy()), name
        assert rep["tensors"][name]["source"] == fmt
    # logits on a long prompt, against load_anchor(fmt) in PyTorch
    model, tok = mlx_lm.load(str(out))
    ids = tok.encode(PROMPT)
    assert len(ids) >= 150
    mlx_logits = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    ref = pytorch_reference(setup[family], fmt)
    with torch.no_grad():
        pt_logits = ref(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(pt_logits).max() > 1.0  # logits large enough for the tolerance to mean something
    d = np.abs(mlx_logits - pt_logits)
    if family == "fp":
        # MXFP exports run in bfloat16 in MLX (uint8 E8M0 scales, bf16 embeddings): observed max 0.07,
        # mean 0.006 here; a wrong rope_theta / rms_norm_eps moves logits by ~1
        assert d.max() < 0.15 and d.mean() < 0.02
        assert (mlx_logits.argmax(-1) == pt_logits.argmax(-1)).mean() > 0.95
        return
    assert d.max() < 1e-4  # observed 2e-6 over 600 tokens (float32 scales: MLX computes in float32)
    assert rep["verify"]["max_abs_logit_diff"] < 1e-4
    assert_same_greedy_generation(out, ref, PROMPT[:200])
