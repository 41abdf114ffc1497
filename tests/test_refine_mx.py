"""``export-mlx --refine`` on MX tensors lowered from the anchor (issue 49 item 3): each block's E8M0 exponent is a
learned choice among its derived one and the two neighbours, the codes encoded again from the anchor's values at
the chosen exponent; the export stays an ordinary MX layout, bit-exact in MLX."""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402

import mfqat  # noqa: E402
from mfqat.export.mlx_files import load_weights  # noqa: E402
from mfqat.export.recipes import LearnedExponents  # noqa: E402
from mfqat.export.refine import RefineConfig, _Exponents  # noqa: E402
from mfqat.quant.api import quantize  # noqa: E402
from mfqat.quant.slice import slice_and_scale  # noqa: E402

SMALL = dict(steps=40, lr=8e-3, exponent_lr=0.1, batch=2, seq_len=32, n_blocks=16, n_valid=4)


def _np(x) -> np.ndarray:
    return np.array(x.astype(mx.float32)) if x.dtype == mx.bfloat16 else np.array(x)


@pytest.fixture(scope="module")
def sharp_anchors(tok, tmp_path_factory):
    """The tiny tied Llama with its matrices times 4 (sharp next-token distributions: a KL refine can lower), as an
    MXINT8 and an MXFP8 anchor."""
    from mfqat.data.sources import tiny_llama

    model = tiny_llama(vocab_size=len(tok), tie=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    d = tmp_path_factory.mktemp("sharp_mx")
    return {fmt: mfqat.save_anchor(model, d / fmt, fmt, tok) for fmt in ("mxint8", "mxfp8_e4m3")}


@pytest.fixture(scope="module", params=[("mxint8", "uniform:mxint3"), ("mxfp8_e4m3", "uniform:mxfp4_e2m1")],
                ids=["mxint3", "mxfp4"])
def exports(request, sharp_anchors, tmp_path_factory):
    anchor_fmt, recipe = request.param
    d = tmp_path_factory.mktemp("refine_mx")
    plain = mfqat.export.to_mlx(sharp_anchors[anchor_fmt], d / "plain", recipe=recipe)
    refined = mfqat.export.to_mlx(sharp_anchors[anchor_fmt], d / "refined", recipe=recipe,
                                  refine=RefineConfig(**SMALL))
    return d / "plain", plain, d / "refined", refined


def test_refine_lowers_the_kl_of_an_mx_export_and_it_stays_bit_exact(exports):
    _, plain, out, rep = exports
    r = rep["refine"]
    assert r["kept"] and r["validation_kl_after"] < r["validation_kl_before"]
    assert r["tensors"] == sum(1 for t in rep["tensors"].values() if t.get("origin") == "anchor")
    v = rep["verify"]
    assert v["weights_bit_exact"] and v["max_abs_logit_diff"] <= v["logit_tolerance"]
    assert json.loads((out / "mfqat_export.json").read_text())["refine"]["kept"]
    assert rep["stored_bytes"] == plain["stored_bytes"]


def test_refine_moves_exponents_by_at_most_one_and_encodes_the_codes_again(exports):
    plain_dir, _, out, _ = exports
    a, b = load_weights(plain_dir), load_weights(out)
    assert sorted(a) == sorted(b)
    moved = recoded = 0
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if not k.endswith(".scales") or k[: -len(".scales")] + ".weight" not in a:
            continue
        s0, s = _np(a[k]), _np(b[k])
        w0, w = _np(a[k[: -len(".scales")] + ".weight"]), _np(b[k[: -len(".scales")] + ".weight"])
        if s0.dtype == np.uint8:  # E8M0 exponents (mxfp4)
            step = np.abs(s.astype(np.int32) - s0.astype(np.int32))
        else:  # MXINT stored in MLX's affine layout: scale 2^e, a power of two in bfloat16
            step = np.abs(np.log2(np.abs(s)) - np.log2(np.abs(s0)))
        assert step.max() <= 1, f"{k}: an exponent moved by more than one"
        moved += int((step > 0).sum())
        recoded += not np.array_equal(w0, w)
    assert moved > 0 and recoded > 0, "refine wrote the derived exponents and codes unchanged"


def _anchor_tensor(fmt: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=gen) * torch.logspace(-30, 30, 8).unsqueeze(-1)  # extreme exponents
    x[1, 32:64] = 0  # an all-zero block
    x[2, :32] = torch.linspace(-1, 1, 32) * 2.0 ** -128  # subnormal float32 values
    x[3, 64:96] = float("nan")  # a non-finite block
    x[4, 96:] = torch.tensor([1.0, -0.5, 0.25, 0.75] * 8)  # values on the grid: ties when lowered
    return quantize(x, fmt, 32)


@pytest.mark.parametrize("anchor_fmt,fmt", [("mxint8", "mxint4"), ("mxint8", "mxint2"), ("mxfp8_e4m3", "mxfp4_e2m1"),
                                            ("mxfp8_e4m3", "mxfp6_e2m3")])
def test_the_learner_starts_at_slice_and_scale_and_writes_what_it_trained_on(anchor_fmt, fmt):
    """At u = 0 the learner's weight is Slice-and-Scale's tensor bit for bit; after moving, the tensor the exporter
    writes (LearnedExponents.on: the anchor encoded again) dequantizes to the weight the refine trained on, every
    exponent within one of the derived one and a non-finite block kept."""
    a = _anchor_tensor(anchor_fmt)
    q = slice_and_scale(a, fmt)
    learner = _Exponents(a, q)
    assert np.array_equal(learner.weight().detach().numpy(), q.dequantize(torch.float32).numpy(), equal_nan=True)
    with torch.no_grad():
        learner.u.copy_(torch.randn(learner.u.shape, generator=torch.Generator().manual_seed(1)) * 2)
    w = learner.weight().detach()
    written = learner.learned_scales().on(a, fmt)
    assert written.fmt.name == q.fmt.name and written.codes.dtype == q.codes.dtype
    assert np.array_equal(written.dequantize(torch.float32).numpy(), w.numpy(), equal_nan=True)
    step = written.scales.int() - q.scales.int()
    assert step.abs().max() <= 1 and (step != 0).any()
    assert written.scales[3, 2] == 255 and q.scales[3, 2] == 255


def test_the_exponent_gradient_moves_a_block_where_the_loss_wants_it():
    """LSQ's estimate through the rounding: blocks whose loss cares only about their small elements (one outlier
    each, the rest small: a finer grid helps) learn the lower exponent; blocks whose loss cares only about the
    outlier (1.9, which mxint4's floor exponent saturates at 1.75) learn the higher one, where it rounds to 2.0. A sign
    error, or a saturated element's gradient taken as an in-range one's, sends them the wrong way."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen) * 0.05
    x[:, ::32] = 1.9  # one outlier a block, just under 2: mxint4's floor exponent keeps it, the lower one saturates it
    a = quantize(x, "mxint8", 32)
    q = slice_and_scale(a, "mxint4")
    learner = _Exponents(a, q)
    values = a.dequantize(torch.float32)
    small = torch.ones_like(values)
    small[:, ::32] = 0
    care = torch.zeros_like(values, dtype=torch.bool).reshape(4, 2, 32)
    care[:, 0] = True  # first block of each row: the small elements; second block: the outlier
    care = care.reshape(4, 64)
    mask = torch.where(care, small, 1 - small)
    opt = torch.optim.Adam([learner.u], lr=0.1)
    for _ in range(20):
        opt.zero_grad()
        loss = ((learner.weight() - values) ** 2 * mask).sum()
        loss.backward()
        opt.step()
    step = learner.learned_scales().scales.int() - q.scales.int()
    assert (step[:, 0] == -1).all(), step
    assert (step[:, 1] == 1).all(), step  # 1.9 saturates at 1.75 under floor; 2.0 a step up is nearer
    assert ((learner.weight().detach() - values) ** 2 * mask).sum() < ((q.dequantize(torch.float32) - values) ** 2 * mask).sum()


def test_learned_exponents_keep_a_nan_block_and_clamp_at_the_e8m0_range():
    a = _anchor_tensor("mxint8")
    q = slice_and_scale(a, "mxint3")
    learner = _Exponents(a, q)
    with torch.no_grad():
        learner.u.fill_(-5.0)  # every block asks to go down by five: one step at most, never below 2^-127
    e = learner.learned_scales().scales
    finite = q.scales != 255
    assert (e[finite] != 255).all() and (e[finite].int() >= (q.scales[finite].int() - 1).clamp(min=0)).all()
    assert e[1, 1] == 0 and q.scales[1, 1] == 0  # the all-zero block sits at 2^-127 and stays there
    assert (e[~finite] == 255).all()
    assert isinstance(learner.learned_scales(), LearnedExponents)
    with torch.no_grad():
        learner.u.fill_(float("nan"))  # a diverged parameter keeps the derived exponents
    assert torch.equal(learner.learned_scales().scales, q.scales)


@pytest.mark.parametrize("dtype,cap", [(torch.float16, 15), (torch.bfloat16, 127)])
def test_no_exponent_rises_past_the_anchor_dtypes_range(dtype, cap):
    """A block of a float16 anchor near float16's largest value sits at exponent 15: moving it up would decode past
    float16's range, so it stays (the scale search's cap); a bfloat16 anchor's cap is E8M0's own."""
    x = torch.full((2, 32), 60000.0 if dtype == torch.float16 else 2.0 ** 127, dtype=dtype)
    a = quantize(x, "mxint8", 32)
    q = slice_and_scale(a, "mxint4")
    learner = _Exponents(a, q)
    with torch.no_grad():
        learner.u.fill_(5.0)
    e = learner.learned_scales().scales.int() - 127
    assert (q.scales.int() - 127 == cap).all() and (e == cap).all()
    assert torch.isfinite(learner.learned_scales().on(a, "mxint4").dequantize()).all()


def test_a_refined_mx_export_written_in_row_chunks_has_the_same_bytes(exports, sharp_anchors, tmp_path, monkeypatch):
    """Large matrices are lowered, written and checked in row chunks (Plan.chunk_rows); learned exponents are
    chunked with them (each chunk encoded again at its rows' exponents) and give the whole tensor's bytes."""
    import mfqat.export.recipes as recipes

    _, _, out, rep = exports
    monkeypatch.setattr(recipes, "CHUNK_ELEMENTS", 1024)  # every matrix of the tiny model in several chunks
    anchor_fmt = "mxint8" if rep["recipe"] == "uniform:mxint3" else "mxfp8_e4m3"
    chunked = mfqat.export.to_mlx(sharp_anchors[anchor_fmt], tmp_path / "c", recipe=rep["recipe"],
                                  refine=RefineConfig(**SMALL))
    assert chunked["verify"]["weights_bit_exact"]
    a, b = load_weights(out), load_weights(tmp_path / "c")
    assert sorted(a) == sorted(b) and all(np.array_equal(_np(a[k]), _np(b[k])) for k in a)


def test_the_default_refine_learns_a_mixed_plans_affine_tensors_and_refine_its_mx_ones_too(anchor):
    """A plan mixing affine widths with lowered MX tensors: the default refine (optional) learns the affine ones
    only, --refine both; the anchor's own format is never learned."""
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.export import build_plan
    from mfqat.export.refine import plan_refine

    a = read_anchor(anchor)
    plan = build_plan(a, "uniform:affine4")
    names = [n for n in plan.formats if n in a.quantized]
    plan.formats[names[0]], plan.formats[names[1]] = "mxint4", "mxint8"  # lowered MX; the anchor's own format
    default = plan_refine(a, plan, RefineConfig(optional=True))["names"]
    asked = plan_refine(a, plan, RefineConfig())["names"]
    assert names[0] not in default and names[1] not in default and len(default) == len(plan.formats) - 2
    assert names[0] in asked and names[1] not in asked and len(asked) == len(plan.formats) - 1
