"""Issue 48: behaviours of the newer code that no test of their module pinned down, each one a plausible
one-line bug away from a wrong result with exit status 0 (scripts/dev/mutation_check.py plants each bug).
Fast, no MLX: real tiny models and real files built here."""
import json

import pytest
import torch
from safetensors.torch import load_file

import mfqat
from mfqat.anchor.checkpoint import AnchorError, read_anchor
from mfqat.data.sources import load_text, tiny_llama, tiny_tokenizer
from mfqat.formats import get_format
from mfqat.storage.manifest import canonical_digest


# --- learned scales and biases: their own optimizer group, without weight decay ----------------------------

def test_learned_scales_get_no_weight_decay_the_weights_do():
    """mfqat train's optimizer groups (param_groups): one AdamW step with weight decay 0.5 and zero gradients
    moves every weight (decay) and no learned scale or bias (their group has none)."""
    from mfqat.qat.learned_scales import learned_parameters, param_groups

    model = mfqat.prepare(tiny_llama(), mfqat.QATConfig(formats=["mxint8", "affine4"], affine_group_size=32,
                                                        learn_scales=True))
    learned = learned_parameters(model)
    assert learned
    with torch.no_grad():
        for p in learned:
            p.fill_(0.25)  # a value decay would shrink
    groups = param_groups(model, lr=1e-2, weight_decay=0.5, scales_lr=1e-2)
    opt = torch.optim.AdamW(groups)
    before = {id(p): p.detach().clone() for g in groups for p in g["params"]}
    for g in groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    ids = {id(p) for p in learned}
    for g in groups:
        for p in g["params"]:
            moved = not torch.equal(p.detach(), before[id(p)])
            if id(p) in ids:
                assert not moved, "weight decay reached a learned scale / bias"
            elif p.abs().max() > 0:
                assert moved, "the weights lost their weight decay"
    assert sum(len(g["params"]) for g in groups) == sum(1 for p in model.parameters() if p.requires_grad)


# --- a text folder: every .txt and .md file under it ----------------------------------------------------

def test_a_text_folder_reads_md_and_txt_files_in_sorted_order_and_nothing_else(tmp_path):
    from mfqat.data.mix import mixed_text

    d = tmp_path / "notes"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha text")
    (d / "b.md").write_text("# beta markdown")
    (d / "sub" / "c.md").write_text("gamma nested markdown")
    (d / "d.rst").write_text("not read")
    (d / "e.json").write_text('{"not": "read"}')
    assert load_text(str(d)) == "alpha text\n\n# beta markdown\n\ngamma nested markdown"
    assert mixed_text(str(d)) == load_text(str(d))  # --calib-text DIR reads the same
    only_md = tmp_path / "md"
    only_md.mkdir()
    (only_md / "readme.md").write_text("markdown only")
    assert load_text(str(only_md)) == "markdown only"
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "x.rst").write_text("x")
    with pytest.raises(ValueError, match=r"none: no \.txt or \.md files"):
        load_text(str(tmp_path / "none"))


# --- MX-QLoRA --schedule fixed trains the first named format ------------------------------------------------

def test_mx_qlora_fixed_schedule_trains_the_first_named_format(tmp_path):
    """With --lr 1e-30 (0 is refused) the adapters stay at B ~ 0, so each step's logged loss is the anchor's loss on that step's
    batch in the format the step trained: with --schedule fixed, always the first of --formats (here not
    the anchor's format), never the anchor's or the next one."""
    pytest.importorskip("peft")
    from mfqat.data.sources import split_text, token_blocks
    from mfqat.mxqlora.train import main as mx_qlora_main, step_formats

    formats = ["mxint4", "mxint8", "mxint2"]
    assert [step_formats("fixed", formats, s) for s in range(4)] == [["mxint4"]] * 4
    tok = tiny_tokenizer()
    anchor = mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path / "anchor", "mxint8", tokenizer=tok)
    s = mx_qlora_main([str(anchor), "--formats", ",".join(formats), "--schedule", "fixed", "--steps", "3",
                       "--lr", "1e-30", "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "1", "--lora-rank", "2",
                       "--eval-formats", "mxint4", "--out", str(tmp_path / "run")])
    train = token_blocks(tok, split_text(load_text(None))[0], 32, max_blocks=6)
    g = torch.Generator().manual_seed(0)
    batches = [train[torch.randint(0, train.shape[0], (2,), generator=g)] for _ in range(3)]
    models = {f: mfqat.load_anchor(anchor, f).eval() for f in formats}
    with torch.no_grad():
        per = [{f: m(input_ids=b, labels=b).loss.item() for f, m in models.items()} for b in batches]
    for step, losses in enumerate(per):
        assert max(losses.values()) - min(losses.values()) > 1e-3  # the formats tell apart
        assert s["losses"][step] == pytest.approx(losses["mxint4"], rel=1e-5), (step, losses, s["losses"])


# --- perplexity leaves the model in the mode it found ---------------------------------------------------

def _modes(model):
    return [m.training for m in model.modules()]


def test_perplexity_restores_every_modules_train_eval_mode_and_evaluates_in_eval_mode():
    from mfqat.eval.perplexity import perplexity

    model = tiny_llama()
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # dropout in train mode: the score would differ run to run
    blocks = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.train()
        assert not torch.equal(model(input_ids=blocks).logits, model.eval()(input_ids=blocks).logits)
    model.eval()
    want = perplexity(model, blocks)
    assert not any(_modes(model))
    model.train()
    model.model.layers[0].eval()  # a mixed model: one block frozen in eval mode
    modes = _modes(model)
    assert perplexity(model, blocks) == want  # scored in eval mode
    assert _modes(model) == modes
    with pytest.raises(IndexError):
        perplexity(model, torch.full((1, 16), 10_000))  # an id outside the vocabulary: the forward raises
    assert _modes(model) == modes


# --- safetensors shards at the exact boundary -----------------------------------------------------------

def test_a_tensor_that_fills_a_shard_exactly_stays_in_it(tmp_path):
    from mfqat.storage.shard_files import INDEX_FILE, WEIGHTS_FILE, plan_shards
    from mfqat.storage.tensor_files import write_safetensors

    assert plan_shards({"a": 16, "b": 16, "c": 32, "d": 4, "e": 40}, 32) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_shards({"a": 32}, 32) == [["a"]]
    t = {"a": torch.zeros(4), "b": torch.ones(4), "c": torch.arange(8.0)}  # 16 + 16 + 32 bytes
    files = write_safetensors(tmp_path / "", t, max_shard_bytes=64)
    assert files == [WEIGHTS_FILE] and not (tmp_path / INDEX_FILE).exists()
    (tmp_path / WEIGHTS_FILE).unlink()
    files = write_safetensors(tmp_path, t, max_shard_bytes=32)
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["weight_map"] == {"a": files[0], "b": files[0], "c": files[1]}
    assert index["metadata"]["total_size"] == 64


def test_an_anchor_exactly_at_max_shard_bytes_is_one_file_and_one_byte_less_is_two(tmp_path):
    model = tiny_llama()
    one = mfqat.save_anchor(model, tmp_path / "one")
    total = sum(v.numel() * v.element_size() for v in load_file(str(one / "model.safetensors")).values())
    exact = mfqat.save_anchor(model, tmp_path / "exact", max_shard_bytes=total)
    assert sorted(p.name for p in exact.glob("*.safetensors")) == ["model.safetensors"]
    split = mfqat.save_anchor(model, tmp_path / "split", max_shard_bytes=total - 1)
    assert len(list(split.glob("model-*.safetensors"))) == 2
    a, b = read_anchor(exact), read_anchor(split)
    assert all(torch.equal(a.plain[k], b.plain[k]) for k in a.plain)


# --- an mfqat.json with a manifest but no digest -------------------------------------------------------

@pytest.fixture
def anchor_with_tokenizer(tmp_path):
    tok = tiny_tokenizer()
    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path / "a", tokenizer=tok)


@pytest.mark.parametrize("version", [1, "same"])
def test_a_manifest_without_its_digest_is_refused(anchor_with_tokenizer, version):
    """Removing the digest (and calling the file version 1, which needs none) does not turn the manifest
    off: the metadata is refused as edited, naming mfqat.json and its digest."""
    path = anchor_with_tokenizer
    meta = json.loads((path / "mfqat.json").read_text())
    assert "manifest" in meta and meta.pop("digest")
    if version != "same":
        meta["format_version"] = version
    (path / "mfqat.json").write_text(json.dumps(meta))
    with pytest.raises(AnchorError, match=r"mfqat\.json.*digest"):
        read_anchor(path)


def test_a_manifest_listed_file_changed_is_refused_with_or_without_the_digest(anchor_with_tokenizer):
    path = anchor_with_tokenizer
    meta = json.loads((path / "mfqat.json").read_text())
    listed = [n for n in meta["manifest"] if n.startswith("tokenizer")]
    assert listed
    with open(path / listed[0], "a") as f:
        f.write(" ")
    with pytest.raises(AnchorError, match=f"{listed[0]}: sha256 mismatch"):
        read_anchor(path)
    meta.pop("digest")
    meta["format_version"] = 1
    (path / "mfqat.json").write_text(json.dumps(meta))
    with pytest.raises(AnchorError):
        read_anchor(path)
    meta["digest"] = canonical_digest(meta)  # a version-1 file with a manifest and a matching digest
    (path / "mfqat.json").write_text(json.dumps(meta))
    with pytest.raises(AnchorError, match=f"{listed[0]}: sha256 mismatch"):
        read_anchor(path)


# --- MoE experts back to plain parameters: the learned scales go --------------------------------------

def test_unprepare_of_moe_experts_with_learned_scales_is_a_drop_in_model_again():
    """unprepare() leaves the pairs out (docs/numerics.md): the fused experts' class, parameters and
    state_dict keys are the model's own again, and no learned scale stays behind."""
    from mfqat.qat.experts import MFQATExperts
    from mfqat.qat.learned_scales import learned_parameters
    from mfqat.models.catalog import MOE, build

    model = build("qwen3_moe", dict(head_dim=16, **MOE), 320)
    keys = list(model.state_dict())
    experts_cls = type(model.model.layers[0].mlp.experts)
    mfqat.prepare(model, mfqat.QATConfig(formats=["mxint8", "affine4"], affine_group_size=32, learn_scales=True))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, MFQATExperts) and "learned_scales" in experts._modules
    mfqat.unprepare(model)
    assert type(model.model.layers[0].mlp.experts) is experts_cls
    assert list(model.state_dict()) == keys
    assert learned_parameters(model) == []
    assert not [n for n, _ in model.named_parameters() if "learned" in n]


# --- Qwen3.5: both Gated DeltaNet gate projections stay high --------------------------------------------

@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_keeps_in_proj_a_and_in_proj_b_high_and_quantizes_qkv_and_z(name, tmp_path):
    from mfqat.models import family_for
    from mfqat.qat.modules import MFQATLinear
    from mfqat.models.catalog import SUPPORTED, build

    model_type, extra = SUPPORTED[name]
    family = family_for(model_type)
    model = mfqat.prepare(build(model_type, extra, 320), mfqat.QATConfig())
    linear = [i for i, layer in enumerate(model.model.layers) if hasattr(layer, "linear_attn")]
    assert linear
    for i in linear:
        la = model.model.layers[i].linear_attn
        for proj in ("in_proj_a", "in_proj_b"):
            assert not isinstance(getattr(la, proj), MFQATLinear), (i, proj)
            assert "decay" in family.kept_high(f"model.layers.{i}.linear_attn.{proj}.weight")
        for proj in ("in_proj_qkv", "in_proj_z", "out_proj"):
            assert isinstance(getattr(la, proj), MFQATLinear), (i, proj)
    meta = json.loads((mfqat.save_anchor(model, tmp_path / "anchor") / "mfqat.json").read_text())
    for i in linear:
        for proj in ("in_proj_a", "in_proj_b"):
            key = f"model.layers.{i}.linear_attn.{proj}.weight"
            assert key not in meta["tensors"] and key in meta["full_precision"], key
        assert f"model.layers.{i}.linear_attn.in_proj_qkv.weight" in meta["tensors"]


# --- a recipe's width the family lacks: the next wider one, never a narrower one ---------------------

def test_seed_recipe_rounds_a_missing_width_up(tmp_path):
    """seed:affine at base 4 and 5: lm_head/embeddings want 7 bits and attention inputs (base 5) want 7,
    which MLX's affine lacks: they get 8, never 6. An mxfp anchor: 5 bits -> mxfp6, 7 -> mxfp8."""
    from mfqat.export.recipes import FAMILY_BY_BITS, _fmt_for_bits, build_plan, mlx_storage

    assert _fmt_for_bits("affine", 7, 8) == "affine8"
    assert [_fmt_for_bits("mxfp", b, 8) for b in (4, 5, 6, 7, 8)] == \
        ["mxfp4_e2m1", "mxfp6_e2m3", "mxfp6_e2m3", "mxfp8_e4m3", "mxfp8_e4m3"]
    for fam, table in FAMILY_BY_BITS.items():  # every width a recipe can ask for: the table's or wider
        for b in range(2, 9):
            got = _fmt_for_bits(fam, b, 8)
            assert get_format(got).bits >= min(max(b, min(table)), max(table)), (fam, b, got)
    assert mlx_storage("mxint7") == ("affine", 8)  # MLX has no 7-bit mode: stored in 8, not 6
    tok = tiny_tokenizer()
    anchor = read_anchor(mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path / "a", tokenizer=tok))
    plan = build_plan(anchor, "seed:affine", base_bits=4)
    assert plan.formats["lm_head.weight"] == "affine8"
    assert plan.formats["model.layers.0.self_attn.q_proj.weight"] == "affine6"
    plan5 = build_plan(anchor, "seed:affine", base_bits=5)
    assert plan5.formats["model.layers.0.self_attn.q_proj.weight"] == "affine8"
    assert plan5.formats["model.layers.0.mlp.down_proj.weight"] == "affine6"
    fp = read_anchor(mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path / "fp", "mxfp8_e4m3",
                                       tokenizer=tok))
    planfp = build_plan(fp, "seed:mxfp", base_bits=4)
    assert planfp.formats["model.layers.0.mlp.down_proj.weight"] == "mxfp6_e2m3"
    assert planfp.formats["lm_head.weight"] == "mxfp8_e4m3"
