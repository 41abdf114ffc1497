"""Qwen3.5 as it is released: the vision-language checkpoints (``model_type`` ``qwen3_5`` / ``qwen3_5_moe``,
``Qwen3_5(Moe)ForConditionalGeneration``, ``text_config`` + ``vision_config``, weights under
``model.language_model.*``, ``model.visual.*``, ``lm_head.*``; the MoE's experts per expert on disk), built
here as tiny random models from transformers' own configs and saved with ``save_pretrained``.

End to end: load (the whole model) -> prepare (language model trained, vision tower frozen in full
precision) -> 2 joint MF-QAT steps -> anchor (every key, ``from_pretrained(ANCHOR)`` gives the whole model
back) -> mxint4 slice equals the trained forward -> MLX export as mlx-lm's ``qwen3_5`` / ``qwen3_5_moe`` read
it (vision tower dropped and reported) -> mlx_lm.load + generate."""
import json
import warnings

import pytest
import torch

import mfqat
from mfqat.data.sources import load_model, tiny_tokenizer
from mfqat.export import to_mlx
from mfqat.qat.prepare import qat_modules

mlx_lm = pytest.importorskip("mlx_lm")

VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
              temporal_patch_size=2)
TEXT = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_hidden_layers=4)
# one full-attention layer every 2 (dense) or 4 (MoE): mlx-lm builds the stack from full_attention_interval
# (default 4), which the export must write into text_config for the dense model to load at all.
LAYERS = {"qwen3_5": ["linear_attention", "full_attention"] * 2,
          "qwen3_5_moe": ["linear_attention"] * 3 + ["full_attention"]}
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)


def build_release(kind: str, vocab: int):
    """The tiny VL model of ``kind`` (qwen3_5 or qwen3_5_moe) from transformers' own config classes."""
    import transformers

    text = {**TEXT, "vocab_size": vocab, "layer_types": LAYERS[kind]}
    text.update(MOE if kind == "qwen3_5_moe" else dict(intermediate_size=128))
    name = "Qwen3_5Moe" if kind == "qwen3_5_moe" else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=VISION)
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForConditionalGeneration")(config)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def releases(tok, tmp_path_factory):
    """{kind: folder} of the tiny releases as save_pretrained writes them."""
    root = tmp_path_factory.mktemp("releases")
    out = {}
    for kind in LAYERS:
        build_release(kind, len(tok)).save_pretrained(root / kind)
        tok.save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def _train_two_joint_steps(model, ids):
    cfg = model.mfqat_controller.config
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        mfqat.joint_backward(model, model, {"input_ids": ids, "labels": ids},
                             model.mfqat_controller.step_formats(step, 2), cfg.weight_of, lambda loss: loss.backward())
        opt.step()
        opt.zero_grad()


def _ids(tok):
    return torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(1))


def _safetensors_keys(folder):
    from safetensors import safe_open

    keys = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            keys += list(h.keys())
    return keys


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_release_end_to_end(kind, releases, tok, tmp_path):
    from transformers import AutoModelForImageTextToText

    on_disk = set(_safetensors_keys(releases[kind]))
    assert any(k.startswith("model.visual.") for k in on_disk)
    assert (kind == "qwen3_5_moe") == any(".experts.0.gate_proj" in k for k in on_disk)  # per-expert names
    model, _ = load_model(str(releases[kind]))
    assert type(model).__name__.endswith("ForConditionalGeneration")  # the whole model, vision tower included
    vision = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.visual.")}
    assert vision
    mfqat.prepare(model, mfqat.QATConfig())
    assert not [n for n, _ in qat_modules(model) if n.startswith("model.visual")]
    text = {n: p.detach().clone() for n, p in model.named_parameters() if ".layers." in n and p.dim() >= 2}
    ids = _ids(tok)
    _train_two_joint_steps(model, ids)
    for n, p in model.named_parameters():
        if n in vision:  # frozen: left exactly as loaded
            assert not p.requires_grad and torch.equal(p.detach(), vision[n]), n
    trained = [n for n, p in model.named_parameters() if n in text and not torch.equal(p.detach(), text[n])]
    assert any(".experts." in n for n in trained) == (kind == "qwen3_5_moe") and any("in_proj_qkv" in n for n in trained)
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    meta = json.loads((anchor / "mfqat.json").read_text())
    assert all(k.startswith(("model.language_model.", "lm_head.")) for k in meta["tensors"])
    visual_matrices = [n for n in vision if vision[n].dim() >= 2]
    assert all(meta["full_precision"][n].startswith("vision tower") for n in visual_matrices)
    full = AutoModelForImageTextToText.from_pretrained(str(anchor))  # the whole checkpoint back, every key
    sd = full.state_dict()
    assert set(sd) == set(model.state_dict())
    assert all(torch.equal(sd[n], v) for n, v in vision.items())
    mfqat.set_format(model, "mxint4")
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, mfqat.load_anchor(anchor, "mxint4")(ids).logits)
    for recipe in ("uniform:affine4", "seed:affine"):
        out = tmp_path / recipe.replace(":", "_")
        with pytest.warns(UserWarning, match=r"leaves out 21 tensors .* of the vision tower"):
            rep = to_mlx(anchor, out, recipe=recipe)
        assert rep["verify"]["weights_bit_exact"] and rep["verify"]["prompt_tokens"] >= 64
        assert [d["tensors"] for d in rep["dropped"]] == [len(vision)]
        assert rep["dropped"][0]["parameters"] == sum(v.numel() for v in vision.values())
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["model_type"] == kind and cfg["text_config"]["full_attention_interval"] == LAYERS[kind].index(
            "full_attention") + 1
        per_module = [k for k, v in cfg["quantization"].items() if isinstance(v, dict)]
        assert all(k.startswith(("language_model.model.", "language_model.lm_head")) for k in per_module)
        assert (recipe == "seed:affine") == bool(per_module)
        written = _safetensors_keys(out)
        assert not [k for k in written if "visual" in k] and all(k.startswith("language_model.") for k in written)
        assert any(".switch_mlp." in k for k in written) == (kind == "qwen3_5_moe")
        model_mlx, tok_mlx = mlx_lm.load(str(out))
        assert isinstance(mlx_lm.generate(model_mlx, tok_mlx, prompt="def f", max_tokens=3), str)


def test_train_vision_makes_the_towers_linears_mfqat_targets(releases, tok, tmp_path):
    """QATConfig(train_vision=True): the vision tower's block Linears are trained and stored quantized; the
    export to mlx-lm still leaves the whole tower out."""
    model, _ = load_model(str(releases["qwen3_5"]))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.visual.blocks.")}
    mfqat.prepare(model, mfqat.QATConfig(train_vision=True))
    prepared = [n for n, _ in qat_modules(model) if n.startswith("model.visual.")]
    assert "model.visual.blocks.0.attn.qkv" in prepared and "model.visual.blocks.0.mlp.linear_fc1" in prepared
    pixels = torch.randn(16, 3 * 2 * 16 * 16, generator=torch.Generator().manual_seed(3))
    features = model.get_image_features(pixels, torch.tensor([[1, 4, 4]])).pooler_output[0]
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
    features.pow(2).mean().backward()  # an image reaches the tower's MF-QAT layers, which train
    torch.optim.SGD([p for p in model.parameters() if p.grad is not None], lr=0.1).step()
    changed = [n for n, p in model.named_parameters() if n in before and not torch.equal(p.detach(), before[n])]
    assert "model.visual.blocks.0.attn.qkv.weight" in changed and "model.visual.blocks.0.mlp.linear_fc1.weight" in changed
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    meta = json.loads((anchor / "mfqat.json").read_text())
    assert "model.visual.blocks.0.attn.qkv.weight" in meta["tensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = to_mlx(anchor, tmp_path / "mlx", recipe="uniform:affine4")
    assert rep["dropped"][0]["tensors"] == len([k for k in model.state_dict() if k.startswith("model.visual.")])
    assert rep["verify"]["weights_bit_exact"]


def test_release_folder_exports_directly(releases, tmp_path):
    """`mfqat export-mlx FOLDER` of the release (post-training): the vision tower is dropped, not refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = to_mlx(releases["qwen3_5_moe"], tmp_path / "mlx", recipe="uniform:mxint4")
    assert rep["verify"]["weights_bit_exact"] and rep["dropped"]
