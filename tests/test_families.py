"""Every model family mfqat supports, end to end on a tiny random model built from its transformers
config: prepare -> 2 joint MF-QAT steps -> anchor -> mxint4 by Slice-and-Scale (equal to the trained
forward) -> MLX export (verified bit-exact and by mlx_lm's logits over 64 tokens) -> mlx_lm.load and
generate. Families mfqat has no rules for are refused by name, never exported half full precision."""
import json
import warnings

import numpy as np
import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_tokenizer
from mfqat.export import to_mlx
from mfqat.models import family_for

mlx_lm = pytest.importorskip("mlx_lm")

from mfqat.models.catalog import BASE, DEEPSEEK, DROP, LINEAR_ATTN, MOE, SUPPORTED, UNSUPPORTED, build  # noqa: E402,F401


def train_two_joint_steps(model, ids):
    cfg = model.mfqat_controller.config
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(2):
        mfqat.joint_backward(model, model, {"input_ids": ids, "labels": ids},
                             model.mfqat_controller.step_formats(step, 2), cfg.weight_of, lambda loss: loss.backward())
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_family_end_to_end(name, tok, tmp_path):
    model_type, extra = SUPPORTED[name]
    model = build(model_type, extra, len(tok))
    keys = list(model.state_dict())
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 3}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mfqat.prepare(model, mfqat.QATConfig())
    assert not [w for w in seen if "has no rule" in str(w.message)]
    assert list(model.state_dict()) == keys  # a drop-in: checkpoints keep their keys
    ids = torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(1))
    train_two_joint_steps(model, ids)
    for n, p in model.named_parameters():  # experts were trained, not left aside
        if n in before:
            assert not torch.equal(p.detach(), before[n]), n
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    meta = json.loads((anchor / "mfqat.json").read_text())
    family = family_for(model_type)
    for n, p in model.named_parameters():  # every block matrix is quantized or kept for a stated reason
        if ".layers." in n and p.dim() >= 2 and n not in meta["tensors"]:
            assert family.kept_high(n) and meta["full_precision"][n] == family.kept_high(n), n
    mfqat.set_format(model, "mxint4")
    model.eval()
    with torch.no_grad():
        trained = model(ids).logits
        sliced = mfqat.load_anchor(anchor, "mxint4")(ids).logits
    assert torch.equal(trained, sliced)  # what was trained is what Slice-and-Scale deploys
    rep = to_mlx(anchor, tmp_path / "mlx", recipe="uniform:mxint4")
    assert rep["verify"]["weights_bit_exact"] and rep["verify"]["prompt_tokens"] >= 64
    assert rep["verify"]["max_abs_logit_diff"] <= rep["verify"]["logit_tolerance"]
    from mfqat.export.mlx_files import load_weights
    written = load_weights(tmp_path / "mlx")
    big = [k for k, v in written.items() if k.endswith(".weight") and v.ndim >= 2 and ".layers." in k
           and not k.replace(".weight", ".scales") in written]
    assert all(family.kept_high(k.replace(".block_sparse_moe.", ".mlp.")) for k in big), big  # no silent 16-bit
    for k in meta["full_precision"]:  # and what the family keeps high precision is not quantized on export
        if family.kept_high(k):
            assert family.mlx_name(k) in written and family.mlx_name(k).replace(".weight", ".scales") not in written
    model_mlx, tok_mlx = mlx_lm.load(str(tmp_path / "mlx"))
    assert isinstance(mlx_lm.generate(model_mlx, tok_mlx, prompt="def f", max_tokens=3), str)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_export_splits_experts_code_for_code(name, tok, tmp_path):
    """switch_mlp's gate/up/down hold exactly the rows of the fused expert parameters, per expert, and
    every expert byte is counted in the stored size."""
    import mlx.core as mx

    model_type, extra = SUPPORTED[name]
    model = build(model_type, extra, len(tok))
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)  # post-training: no prepare
    rep = to_mlx(anchor, tmp_path / "mlx", recipe="uniform:mxint4", verify=False)
    from mfqat.export.mlx_files import load_weights
    w = load_weights(tmp_path / "mlx")
    a = mfqat.read_anchor(anchor)
    moe = "block_sparse_moe" if name == "mixtral" else "mlp"
    fused = a.in_format("mxint4")["model.layers.1.mlp.experts.gate_up_proj"].dequantize(torch.float32).numpy()
    half = fused.shape[1] // 2
    for piece, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None))):
        m = f"model.layers.1.{moe}.switch_mlp.{piece}"
        got = mx.dequantize(w[f"{m}.weight"], w[f"{m}.scales"], w[f"{m}.biases"], group_size=32, bits=4)
        assert np.array_equal(np.array(got), fused[:, rows, :])
    n_expert = sum(v.numel() for k, v in model.state_dict().items() if ".experts." in k)
    counted = sum(v for k, v in rep_numels(a, rep).items() if "switch_mlp" in k)
    assert counted == n_expert
    assert rep["stored_bits_per_weight_quantized"] == pytest.approx(6.0)  # mxint4 g32, float32 scale + bias


def rep_numels(anchor, rep):
    from mfqat.export.mlx_export import plan_from_report
    from mfqat.export.recipes import check_family

    plan = plan_from_report(rep)
    plan.family = check_family(anchor)
    return plan.numels(anchor)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unknown_experts_are_named_and_export_refused(name, tok, tmp_path):
    model_type, extra = UNSUPPORTED[name]
    model = build(model_type, extra, len(tok))
    with pytest.warns(UserWarning, match=r"has no rule for \d+ weight\(s\) that stay full precision: .*experts"):
        mfqat.prepare(model, mfqat.QATConfig())
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tokenizer=tok)
    with pytest.raises(ValueError, match="no MLX layout for"):
        to_mlx(anchor, tmp_path / "mlx", recipe="uniform:mxint4")
    assert not (tmp_path / "mlx").exists()


@pytest.mark.parametrize("name", sorted(n for n in SUPPORTED if family_for(SUPPORTED[n][0]).awq_groups))
def test_awq_keeps_the_full_precision_function(name, tok):
    """AWQ scales its groups (the family's norm -> linear folds, Gemma's 1 + w included) and the
    full-precision model computes the same logits."""
    import copy

    from mfqat.export.awq import apply_awq

    model_type, extra = SUPPORTED[name]
    model = build(model_type, extra, len(tok)).eval()
    with torch.no_grad():  # norms away from their init, so a wrong fold shows
        for n, p in model.named_parameters():
            if "norm" in n and p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.3)
    ids = torch.randint(0, len(tok), (2, 32), generator=torch.Generator().manual_seed(2))
    scaled = copy.deepcopy(model)
    stats = apply_awq(scaled, ids)
    assert stats and max(v["s_max"] for v in stats.values()) > 1.5  # the scales are far from 1
    with torch.no_grad():
        ref, got = model(ids).logits, scaled(ids).logits
    assert (got - ref).abs().max() <= 1e-4 * max(1.0, ref.abs().max())
    changed = [n for n, p in scaled.named_parameters() if not torch.equal(p, model.get_parameter(n))]
    assert changed  # something was rescaled


@pytest.mark.parametrize("name", ["gpt_neox", "gpt_oss"])
def test_awq_refuses_families_without_groups(name, tok):
    from mfqat.export.awq import apply_awq

    model_type, extra = {**SUPPORTED, **UNSUPPORTED}[name]
    model = build(model_type, extra, len(tok))
    with pytest.raises(ValueError, match=f"AWQ: {model_type}: .*export without --awq"):
        apply_awq(model, torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("name", ["phi3", "gpt_neox", "deepseek_v3", "qwen3_5", "qwen3_next"])
def test_seed_recipe_knows_every_familys_attention_projections(name, tok):
    """The seed table's +2 for attention inputs and 8 bits for attention outputs reach fused (qkv_proj,
    query_key_value), MLA and Gated DeltaNet projections, not only Llama's q/k/v/o: each family names its
    own roles (mfqat.models)."""
    from mfqat.export.recipes import seed_bits

    model_type, extra = SUPPORTED[name]
    names = [n for n, p in build(model_type, extra, len(tok)).named_parameters() if p.dim() >= 2 and ".layers." in n]
    inputs = [n for n in names if any(k in n for k in ("qkv", "query_key_value", "q_a_proj", "kv_a_proj", "q_proj"))]
    outputs = [n for n in names if any(k in n for k in ("o_proj", "out_proj", "attention.dense"))]
    assert inputs and outputs
    family = family_for(model_type)  # the family's own roles, not the table of every family's names
    assert all(seed_bits(n, 4, False, family) == 6 for n in inputs), [n for n in inputs
                                                                      if seed_bits(n, 4, False, family) != 6]
    assert all(seed_bits(n, 4, False, family) == 8 for n in outputs)


def _mlx_export(name, tok, tmp_path):
    model_type, extra = SUPPORTED[name]
    anchor = mfqat.save_anchor(build(model_type, extra, len(tok)), tmp_path / "anchor", "mxint8", tokenizer=tok)
    to_mlx(anchor, tmp_path / "mlx", recipe="uniform:mxint8", verify=False)
    return anchor, tmp_path / "mlx"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "glm4_moe", "gpt_neox"])
def test_mlx_mfqat_trains_experts_and_writes_the_anchor_back(name, tok, tmp_path):
    """On MLX, prepare makes MoE experts MF-QAT layers too; the mxint4 forward equals PyTorch's mxint4 of
    the anchor written back, and the round trip PyTorch -> MLX -> anchor keeps every code."""
    import mlx.core as mx

    from mfqat.mlx.anchor import save_anchor as mlx_save_anchor
    from mfqat.mlx.models import load_for_training
    from mfqat.mlx.qat import MFQATSwitchLinear, qat_layers
    from mfqat.mlx.qat import prepare as mlx_prepare
    from mfqat.mlx.qat import set_format as mlx_set_format

    anchor, export = _mlx_export(name, tok, tmp_path)
    model, _, src = load_for_training(str(export))
    mlx_prepare(model, mfqat.QATConfig(formats=["mxint8", "mxint4"]))
    switch = [n for n, m in qat_layers(model) if isinstance(m, MFQATSwitchLinear)]
    assert bool(switch) == (name != "gpt_neox")
    back = mlx_save_anchor(model, tmp_path / "back", "mxint8", source_dir=src)
    a, b = mfqat.read_anchor(anchor), mfqat.read_anchor(back)
    assert set(a.quantized) == set(b.quantized)
    for k, q in a.quantized.items():
        assert torch.equal(q.codes, b.quantized[k].codes) and torch.equal(q.scales, b.quantized[k].scales), k
    ids = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(0))
    mlx_set_format(model, "mxint4")
    got = np.array(model(mx.array(ids.numpy())).astype(mx.float32))
    with torch.no_grad():
        want = mfqat.load_anchor(back, "mxint4")(ids).logits.numpy()
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())  # gpt_neox: mlx-lm's tanh GELU


@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3_5_moe"])
def test_mlx_anchor_write_back_refused_where_mlx_lm_rewrites_weights(name, tok, tmp_path):
    from mfqat.mlx.anchor import save_anchor as mlx_save_anchor
    from mfqat.mlx.models import load_for_training

    _, export = _mlx_export(name, tok, tmp_path)
    model, _, src = load_for_training(str(export))
    with pytest.raises(ValueError, match="cannot be written back as an anchor yet"):
        mlx_save_anchor(model, tmp_path / "back", "mxint8", source_dir=src)
    assert not (tmp_path / "back").exists()


@pytest.mark.parametrize("recipe", ["dynamic2", "dynamic2:affine"])
def test_dynamic2_recipe_on_qwen3_5(recipe, tok, tmp_path):
    """dynamic2 on Qwen3.5: attention outputs (o_proj, linear_attn.out_proj) in bfloat16, embeddings and
    lm_head 8 bits, the rest 4 bits, the router-like gates kept high: mixed bits in one MLX file that
    mlx_lm loads and the export check accepts."""
    model_type, extra = SUPPORTED["qwen3_5_moe"]
    extra = {**extra, "intermediate_size": 128, "moe_intermediate_size": 64}
    anchor = mfqat.save_anchor(build(model_type, extra, len(tok)), tmp_path / "a", "mxint8", tokenizer=tok)
    rep = to_mlx(anchor, tmp_path / "mlx", recipe=recipe)
    assert rep["verify"]["weights_bit_exact"]
    quant = json.loads((tmp_path / "mlx" / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4
    outs = [k for k in quant if k.endswith((".o_proj", ".out_proj"))]
    assert outs and all(quant[k] is False for k in outs)
    assert any(".self_attn.o_proj" in k for k in outs) and any(".linear_attn.out_proj" in k for k in outs)
    assert quant["language_model.lm_head"]["bits"] == 8 and quant["language_model.model.embed_tokens"]["bits"] == 8
    kept = [n for n, t in rep["tensors"].items() if t["mlx"] == "bfloat16"]
    assert sorted(kept) == sorted(n for n in rep["tensors"] if n.endswith(("o_proj.weight", "out_proj.weight")))
    model_mlx, tok_mlx = mlx_lm.load(str(tmp_path / "mlx"))
    assert isinstance(mlx_lm.generate(model_mlx, tok_mlx, prompt="def f", max_tokens=3), str)


def test_gemma2_export_says_where_mlx_lm_stops_matching(tok, tmp_path):
    """mlx-lm's gemma2 has no sliding window: the export reports the context up to which it matches
    transformers, and a window shorter than the check's 64 tokens fails the check (nothing written)."""
    model_type, extra = SUPPORTED["gemma2"]
    anchor = mfqat.save_anchor(build(model_type, extra, len(tok)), tmp_path / "a128", "mxint8", tokenizer=tok)
    with pytest.warns(UserWarning, match="sliding_window = 128 tokens"):
        rep = to_mlx(anchor, tmp_path / "mlx128", recipe="uniform:mxint8")
    assert any("128" in c for c in rep["caveats"])
    short = mfqat.save_anchor(build(model_type, {**extra, "sliding_window": 8}, len(tok)), tmp_path / "a8", "mxint8",
                              tokenizer=tok)
    with pytest.warns(UserWarning, match="sliding_window = 8 tokens"), \
            pytest.raises(RuntimeError, match="export check failed: the logits"):
        to_mlx(short, tmp_path / "mlx8", recipe="uniform:mxint8")
    assert not (tmp_path / "mlx8").exists()
