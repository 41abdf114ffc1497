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
from mfqat.data.sources import load_model
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


def test_a_moe_release_streams_tensor_by_tensor_as_its_loaded_model_quantizes(tok, tmp_path, monkeypatch):
    """Per-expert tensors on disk are stacked into the fused parameters as transformers stacks them (12
    experts: numeric order, not the names' order) one parameter at a time; the PTQ anchor equals the loaded
    model's and the export from the folder writes the bytes of the export of that anchor."""
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.anchor.stream import anchor_from_folder, streamable

    monkeypatch.setitem(MOE, "num_experts", 12)
    folder = tmp_path / "src"
    build_release("qwen3_5_moe", len(tok)).to(torch.bfloat16).save_pretrained(folder, max_shard_size="2MB")
    tok.save_pretrained(folder)
    assert any(".experts.11.gate_proj" in k for k in _safetensors_keys(folder))
    assert streamable(folder) is None
    streamed = read_anchor(anchor_from_folder(folder, tmp_path / "s"))
    model, tok2 = load_model(str(folder))
    loaded = read_anchor(mfqat.save_anchor(model, tmp_path / "l", "mxint8", tok2))
    assert list(streamed.quantized) == list(loaded.quantized)
    assert any(k.endswith("experts.gate_up_proj") for k in loaded.quantized)
    for k, q in loaded.quantized.items():
        assert torch.equal(streamed.quantized[k].codes, q.codes) and torch.equal(streamed.quantized[k].scales, q.scales), k
    assert set(streamed.plain) == set(loaded.plain)
    assert all(torch.equal(streamed.plain[k].float(), v.float()) for k, v in loaded.plain.items())
    assert streamed.meta["full_precision"] == loaded.meta["full_precision"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = to_mlx(folder, tmp_path / "d", recipe="uniform:affine4")
        to_mlx(tmp_path / "l", tmp_path / "two", recipe="uniform:affine4")
    assert rep["ptq"] == "tensor by tensor"
    files = lambda d: {f.name: f.read_bytes() for f in sorted(d.glob("model*.safetensors*"))}  # noqa: E731
    assert files(tmp_path / "d") == files(tmp_path / "two")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eval_of_a_release_anchor_builds_the_whole_vl_model(releases, tmp_path, capsys, dtype):
    """`mfqat eval ANCHOR --dtype bfloat16` fills an empty model tensor by tensor: it must be the release's own
    class (model.language_model.*, the vision tower), not the text-only causal LM."""
    from mfqat.anchor.stream import anchor_from_folder
    from mfqat.cli import main as cli_main

    anchor = anchor_from_folder(releases["qwen3_5_moe"], tmp_path / "a")
    cli_main(["eval", str(anchor), "--formats", "mxint4", "--blocks", "2", "--seq-len", "32", "--dtype", dtype,
              "--plot", str(tmp_path / "p.png")])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| mxint4")]
    assert rows and float(rows[0].split("|")[3]) > 1 and (tmp_path / "p.png").is_file()


@pytest.mark.slow
def test_a_moe_whose_router_is_close_to_a_tie_passes_the_logits_check(tok, tmp_path):
    """16 experts, every weight random and every norm at 1: the router's k-th and (k+1)-th logits are close, so
    a reference that dequantizes in bfloat16 arithmetic while the upcast MLX model computes in float32 routed
    some tokens to other experts (logits off by 0.56, tolerance 0.23). The reference now computes as MLX does."""
    import transformers

    text = dict(TEXT, hidden_size=128, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                vocab_size=len(tok), layer_types=LAYERS["qwen3_5_moe"], num_experts=16, num_experts_per_tok=2,
                moe_intermediate_size=128, shared_expert_intermediate_size=128)
    config = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=dict(VISION, out_hidden_size=128))
    model = transformers.Qwen3_5MoeForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in n and p.dim() == 1 else torch.randn(p.shape, generator=gen) * 0.02)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = to_mlx(tmp_path / "src", tmp_path / "mlx", recipe="uniform:affine4")
    v = rep["verify"]
    from mfqat.export.verify import LOGIT_RTOL
    max_logit = v["logit_tolerance"] / LOGIT_RTOL["float32-upcast"]  # max(1, max |logit|)
    assert v["mlx_compute"] == "float32-upcast" and v["max_abs_logit_diff"] < 1e-4 * max_logit


def test_the_cut_checks_config_of_a_release_keeps_image_ids_beyond_the_vocabulary_as_ids(releases):
    """The image and video ids of a release built on a smaller vocabulary lie beyond it; the cut check's
    config must keep them integers (transformers refuses None) beyond the cut vocabulary, or mlx_lm.load of
    the cut model fails."""
    from transformers import AutoConfig

    from mfqat.export.verify import VocabCut

    config = json.loads((releases["qwen3_5_moe"] / "config.json").read_text())
    vocab = config["text_config"]["vocab_size"]
    assert config["image_token_id"] >= vocab
    cut = VocabCut(vocab, [5, 7], config)
    cfg = cut.config(config)
    n = len(cut.ids)
    assert cfg["text_config"]["vocab_size"] == n and cfg["image_token_id"] >= n
    assert cfg["image_token_id"] != cfg["video_token_id"]
    assert AutoConfig.for_model(cfg.pop("model_type"), **cfg).image_token_id == cfg["image_token_id"]


def test_an_auto_budget_counts_the_stored_bytes_of_the_moe_release(releases, tmp_path):
    """`auto:BPW` on the MoE release (experts split per expert for mlx-lm, routers and the linear attention's
    own tensors kept as they are, the vision tower dropped): the files store at most BPW bits per parameter,
    and sensitivity.json's accounting is their bytes up to the header bound's few bytes per entry."""
    from mfqat.export.mlx_sizes import tensor_bytes

    out = tmp_path / "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = to_mlx(releases["qwen3_5_moe"], out, recipe="auto:5:affine", calib_text="def f(x): return x\n" * 200,
                     verify=False)
    assert 4.9 < rep["stored_bits_per_weight"] <= 5 and rep["dropped"]
    s = json.loads((out / "sensitivity.json").read_text())
    counted = (s["fixed_bits"] + sum(s["stored_level_bits"][t["chosen"]] * t["numel"] for t in s["tensors"].values())) / 8
    assert 0 <= counted - rep["stored_bytes"] <= 6 * len(tensor_bytes(out)) + 16


def test_tied_release_and_awq_on_the_release(tok, tmp_path):
    """A release with tied embeddings (the small Qwen3.5 checkpoints) keeps one table in the anchor and mlx-lm
    reads the tying from text_config; AWQ on a release folder finds the language model's decoder layers."""
    import transformers

    text = {**TEXT, "vocab_size": len(tok), "layer_types": LAYERS["qwen3_5_moe"], "intermediate_size": 128,
            "tie_word_embeddings": True}
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=VISION, tie_word_embeddings=True))
    model.save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = to_mlx(tmp_path / "src", tmp_path / "mlx", recipe="seed", awq=True)
    assert rep["awq"] and rep["verify"]["max_abs_logit_diff"] <= rep["verify"]["logit_tolerance"]
    cfg = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert cfg["text_config"]["tie_word_embeddings"]
    assert cfg["quantization"]["language_model.model.embed_tokens"]["bits"] == 8  # the tied table: the lm_head row
    assert not [k for k in _safetensors_keys(tmp_path / "mlx") if "lm_head" in k]
    model_mlx, tok_mlx = mlx_lm.load(str(tmp_path / "mlx"))
    assert isinstance(mlx_lm.generate(model_mlx, tok_mlx, prompt="def f", max_tokens=3), str)


def test_mx_qlora_on_a_release_anchor(releases, tok, tmp_path):
    """MX-QLoRA builds the anchor's whole model (vision tower included) and, with the adapters at B = 0, gives
    exactly load_anchor's logits in each format."""
    pytest.importorskip("peft")
    from mfqat.mxqlora.model import mx_qlora_model, set_base_format

    model, _ = load_model(str(releases["qwen3_5"]))
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    qlora = mx_qlora_model(anchor, rank=4)
    assert type(qlora).__name__.endswith("ForConditionalGeneration")
    ids = _ids(tok)
    for fmt in ("mxint8", "mxint4"):
        set_base_format(qlora, fmt)
        with torch.no_grad():
            assert torch.equal(qlora(input_ids=ids).logits, mfqat.load_anchor(anchor, fmt)(input_ids=ids).logits)


def test_hf_trainer_on_a_release(releases, tok, tmp_path):
    """MFQATTrainer (the HF Trainer callback) trains a release's language model, the tower frozen, and saves an
    anchor of the whole checkpoint."""
    from transformers import TrainingArguments

    from mfqat.integrations.hf import MFQATTrainer

    model, _ = load_model(str(releases["qwen3_5_moe"]))
    mfqat.prepare(model, mfqat.QATConfig(formats=["mxint8", "mxint4"]))
    tower = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.visual.")}
    ds = [{"input_ids": r, "labels": r} for r in _ids(tok)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2,
                             save_strategy="no", report_to=[], use_cpu=True, learning_rate=1e-3)
    trainer = MFQATTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    trainer.train()
    assert all(torch.equal(p.detach(), tower[n]) for n, p in model.named_parameters() if n in tower)
    trainer.save_model(str(tmp_path / "final"))
    anchor = tmp_path / "final" / "mfqat_anchor"
    assert "model.visual.pos_embed.weight" in mfqat.read_anchor(anchor).plain
    assert type(mfqat.load_anchor(anchor, "mxint4")).__name__ == "Qwen3_5MoeForConditionalGeneration"


# --- the release as published: per-expert FP8 (e4m3 + weight_scale_inv per block) in two shards + index ---

FP8_BLOCK = 32
# HF module (inside a decoder layer) -> the GGUF tensor convert_hf_to_gguf.py names it for qwen35 / qwen35moe (by
# hand: checks gguf-py's map and the family's model.language_model. -> model. renaming)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
              "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta", "linear_attn.out_proj": "ssm_out",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.gate": "ffn_gate_inp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
GGUF_ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


def _to_fp8(weight: torch.Tensor):
    """(e4m3 codes, float32 scale_inv per FP8_BLOCK x FP8_BLOCK block), as the FP8 releases store a matrix."""
    out, inp = weight.shape
    blocks = weight.reshape(out // FP8_BLOCK, FP8_BLOCK, inp // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    return (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(out, inp), scale.float()


def _from_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out, inp = codes.shape
    return (codes.float().reshape(out // FP8_BLOCK, FP8_BLOCK, inp // FP8_BLOCK, FP8_BLOCK)
            * scale[:, None, :, None]).reshape(out, inp)


@pytest.fixture(scope="module", params=["qwen3_5_moe", "qwen3_5"])
def fp8_release(request, releases, tmp_path_factory):
    """The tiny release as an FP8 checkpoint: the language model's block matrices (the MoE's per expert) in e4m3
    with a block scale_inv, the rest (vision tower, routers, norms, lm_head) as they are, in two safetensors
    shards with an index; (kind, folder, {name: the float value it holds})."""
    import shutil

    from safetensors.torch import load_file, save_file

    kind = request.param
    src, dst = releases[kind], tmp_path_factory.mktemp("fp8") / f"{kind}_fp8"
    dst.mkdir()
    tensors, expect = {}, {}
    for k, v in load_file(src / "model.safetensors").items():
        if k.startswith("model.language_model.layers.") and k.endswith("proj.weight") and v.shape[0] % FP8_BLOCK == 0:
            tensors[k], tensors[f"{k}_scale_inv"] = _to_fp8(v)
            expect[k] = _from_fp8(tensors[k], tensors[f"{k}_scale_inv"])
        else:
            tensors[k] = expect[k] = v
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, dst / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
                                  "modules_to_not_convert": ["lm_head", "model.visual", "mlp.gate", "shared_expert_gate",
                                                             "linear_attn.in_proj_a", "linear_attn.in_proj_b"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, dst / f.name)
    return kind, dst, expect


def test_fp8_release_loads_whole_experts_stacked_after_dequantizing(fp8_release):
    kind, folder, expect = fp8_release
    assert any(k.endswith("layers.3.mlp.down_proj.weight_scale_inv" if kind == "qwen3_5" else
                          "experts.2.down_proj.weight_scale_inv") for k in _safetensors_keys(folder))
    model, _ = load_model(str(folder))
    sd = model.state_dict()
    layer = "model.language_model.layers.3.mlp.experts"
    for e in range(4 if kind == "qwen3_5_moe" else 0):
        gate, up = (expect[f"{layer}.{e}.{p}_proj.weight"] for p in ("gate", "up"))
        assert torch.equal(sd[f"{layer}.gate_up_proj"][e], torch.cat([gate, up]))
        assert torch.equal(sd[f"{layer}.down_proj"][e], expect[f"{layer}.{e}.down_proj.weight"])
    for k in ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight", "model.visual.blocks.0.attn.qkv.weight",
              "model.language_model.layers.3.mlp.gate.weight" if kind == "qwen3_5_moe" else
              "model.language_model.layers.3.mlp.down_proj.weight"):
        assert torch.equal(sd[k], expect[k]), k
    assert "quantization_config" not in model.config.to_dict()


def _write_imatrix(path, model, ids):
    """An imatrix GGUF of ``model`` (llama-imatrix's layout, qwen35 / qwen35moe names) measured on ``ids``."""
    import numpy as np
    from gguf import GGUFWriter

    from mfqat.anchor.importance import activation_sums

    sums, counts = activation_sums(model, ids)
    w = GGUFWriter(str(path), arch=GGUF_ARCH[model.config.model_type])
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["random ids"])
    for module in sorted(sums):
        prefix, _, rest = module.partition(".layers.")
        if prefix != "model.language_model" or rest.split(".", 1)[1] not in GGUF_NAMES:
            continue
        i, sub = rest.split(".", 1)
        name = f"blk.{i}.{GGUF_NAMES[sub]}.weight"
        w.add_tensor(name + ".in_sum2", sums[module].numpy().astype(np.float32).reshape(1, -1))
        w.add_tensor(name + ".counts", np.array([[counts[module]]], dtype=np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


@pytest.mark.slow  # mfqat train + export-mlx + mlx_lm generate: 17-35 s on 2 shared cores
def test_fp8_release_train_then_seed_export_with_imatrix(fp8_release, tok, tmp_path, capsys):
    """The issue's done-when: the FP8 release (the MoE per expert) in two shards -> mfqat train -> export-mlx
    --recipe seed --base-bits 3 --imatrix-path -> mlx_lm.load + generate; the design's per-tensor table in
    config.json under language_model.model.* keys, the vision tower named as dropped, nothing else left in 16
    bits without a stated reason, stored bits = bytes on disk."""
    from mfqat.cli import main
    from mfqat.models import family_for

    kind, folder, _ = fp8_release
    moe = kind == "qwen3_5_moe"
    run = tmp_path / "run"
    main(["train", "--model", str(folder), "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-3",
          "--out", str(run)])
    anchor = run / "anchor"
    meta = json.loads((anchor / "mfqat.json").read_text())
    assert ("model.language_model.layers.3.mlp.experts.gate_up_proj" in meta["tensors"]) == moe
    assert meta["full_precision"]["model.visual.blocks.0.attn.qkv.weight"].startswith("vision tower")
    imatrix = _write_imatrix(tmp_path / "imatrix.gguf", mfqat.load_anchor(anchor), _ids(tok))
    capsys.readouterr()
    with pytest.warns(UserWarning, match="vision tower"):
        main(["export-mlx", str(anchor), "--out", str(tmp_path / "mlx"), "--recipe", "seed", "--base-bits", "3",
              "--imatrix-path", str(imatrix)])
    out = tmp_path / "mlx"
    rep = json.loads((out / "mfqat_export.json").read_text())
    assert rep["dropped"][0]["why"].startswith("vision tower") and rep["dropped"][0]["tensors"] == 21
    assert rep["scale_search"]["tensors"] == len([k for k, e in meta["tensors"].items() if len(e["shape"]) == 2])
    assert rep["verify"]["weights_bit_exact"]
    quant = json.loads((out / "config.json").read_text())["quantization"]
    lm = "language_model.model.layers"
    assert (quant["bits"], quant["mode"]) == (3, "affine")  # gate/up (the experts' too): the base
    want = {f"{lm}.3.self_attn.q_proj": 5, f"{lm}.0.linear_attn.in_proj_qkv": 5, f"{lm}.0.linear_attn.in_proj_z": 5,
            "language_model.model.embed_tokens": 5, "language_model.lm_head": 6}
    want.update({f"{lm}.1.mlp.switch_mlp.down_proj": 4, f"{lm}.1.mlp.shared_expert.down_proj": 4, f"{lm}.2.mlp.gate": 8,
                 f"{lm}.2.mlp.shared_expert_gate": 8} if moe else {f"{lm}.1.mlp.down_proj": 4})
    assert {k: quant[k]["bits"] for k in want} == want
    assert quant[f"{lm}.3.self_attn.o_proj"] is False and quant[f"{lm}.0.linear_attn.out_proj"] is False
    assert f"{lm}.0.mlp.{'switch_mlp.' if moe else ''}gate_proj" not in quant  # at the base bits: no entry
    assert all(k.startswith(("language_model.model.", "language_model.lm_head")) for k in quant
               if k not in ("group_size", "bits", "mode"))
    written = _safetensors_keys(out)
    family = family_for(kind)
    unquantized = [k for k in written if k.endswith(".weight") and f"{k[:-7]}.scales" not in written
                   and ".layers." in k and "norm" not in k]
    assert unquantized and all(family.kept_high(k) or quant.get(k[:-7]) is False for k in unquantized), unquantized
    on_disk = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    assert rep["stored_bytes"] == on_disk
    assert rep["stored_bits_per_weight"] == pytest.approx(8 * on_disk / rep["parameters"])
    text = sum(int(torch.Size(e["shape"]).numel()) for k, e in meta["tensors"].items())
    assert rep["parameters"] < text + 100_000  # the text model's count, not the tower's 156k on top of it
    model_mlx, tok_mlx = mlx_lm.load(str(out))
    assert isinstance(mlx_lm.generate(model_mlx, tok_mlx, prompt="def f", max_tokens=3), str)


def test_an_imatrix_that_would_weigh_nothing_is_refused(releases, tok, tmp_path):
    """seed:affine derives MLX's affine codes, which the imatrix-weighted MX scale search never touches: the
    export is refused with the file named instead of carrying an imatrix that changed nothing."""
    model, _ = load_model(str(releases["qwen3_5"]))
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    imatrix = _write_imatrix(tmp_path / "imatrix.gguf", model, _ids(tok))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="imatrix.gguf: recipe 'seed:affine' plans no format"):
            to_mlx(anchor, tmp_path / "mlx", recipe="seed:affine", imatrix_path=str(imatrix), verify=False)
        assert not (tmp_path / "mlx").exists()
        rep = to_mlx(anchor, tmp_path / "mlx4", recipe="uniform:mxint4", imatrix_path=str(imatrix), verify=False)
    assert rep["scale_search"]["tensors"] > 0 and "mxint4" in rep["scale_search"]["formats"]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_text"])
def test_trained_norms_are_written_as_one_plus_w(kind, releases, tok, tmp_path):
    """Qwen3.5's (1 + w) norms after training (small w): written as bfloat16(1 + w) with conv1d as C x K x 1, so
    mlx-lm's sanitize (which would add 1 in bfloat16, losing w) leaves them; the float32 export check holds."""
    from mfqat.export.mlx_files import load_weights

    if kind == "qwen3_5":
        model, _ = load_model(str(releases["qwen3_5"]))
    else:
        from mfqat.models.catalog import SUPPORTED, build
        model = build(*SUPPORTED["qwen3_5"], len(tok))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight")):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 2e-3)
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = to_mlx(anchor, tmp_path / "mlx", recipe="uniform:mxint4")  # float32 scales: the tight tolerance
    assert rep["verify"]["mlx_compute"] == "float32" and rep["verify"]["max_abs_logit_diff"] < 1e-4
    written = load_weights(tmp_path / "mlx")
    prefix = "model.language_model." if kind == "qwen3_5" else "model."
    w = model.get_parameter(f"{prefix}layers.1.input_layernorm.weight").detach()
    got = torch.from_numpy(np_array(written["language_model.model.layers.1.input_layernorm.weight"]))
    assert torch.equal(got, (1 + w).to(torch.bfloat16).float())
    assert written["language_model.model.layers.0.linear_attn.conv1d.weight"].shape[-1] == 1


def np_array(a):
    import mlx.core as mx
    import numpy as np

    return np.array(a.astype(mx.float32))


def test_train_vision_flag_reaches_the_config():
    from mfqat.train.args import build_parser
    from mfqat.train.setup import load_qat_config

    assert load_qat_config(build_parser().parse_args(["--train-vision"])).train_vision
    assert not load_qat_config(build_parser().parse_args([])).train_vision
