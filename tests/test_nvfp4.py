"""NVFP4 (issue 32 part 4): the reference (mfqat.quant.nvfp4) against MLX's mx.quantize / mx.dequantize
(mode "nvfp4") and torchao's NVFP4Tensor, the straight-through gradient, the kernel dispatch, and the
derived format end to end: MF-QAT through an MXFP8 anchor, load_anchor, export-mlx uniform:nvfp4."""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mfqat
from mfqat.formats import get_format
from mfqat.quant.api import quantize_nvfp4
from mfqat.quant.nvfp4 import LUT, e4m3_decode, e4m3_encode, nvfp4_dequantize_blocks, nvfp4_quantize_blocks

mx = pytest.importorskip("mlx.core")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MX_DTYPE = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
GLOBAL_SCALES = (None, 1.0, 0.37, 123.0)


def mlx_nvfp4(x, global_scale=None):
    """(codes uint8 with x's shape, E4M3 bytes, float32 dequantization) as MLX gives them."""
    kw = {} if global_scale is None else {"global_scale": mx.array(global_scale, dtype=mx.float32)}
    wq, s = mx.quantize(mx.array(x.float().numpy()).astype(MX_DTYPE[x.dtype]), mode="nvfp4", **kw)
    b = np.array(wq).view(np.uint8)
    codes = torch.from_numpy(np.stack([b & 15, b >> 4], -1).reshape(*x.shape).copy())
    deq = torch.from_numpy(np.array(mx.dequantize(wq, s, mode="nvfp4", dtype=mx.float32, **kw)))
    return codes, torch.from_numpy(np.array(s)), deq


def ours(x, global_scale=None, rule="nvidia"):
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    g = None if global_scale is None else torch.tensor(global_scale)
    codes, scales = nvfp4_quantize_blocks(blocks, g, rule, x.dtype)
    return codes.reshape(x.shape), scales, nvfp4_dequantize_blocks(codes, scales, g).reshape(x.shape)


def same_bits(a, b):
    """Equal values, NaN where the other has NaN, equal signs (of zeros too; a NaN's sign is free)."""
    return torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0)) and \
        torch.equal(a.signbit() & ~a.isnan(), b.signbit() & ~b.isnan())


def adversarial(rows_per_value=4):
    """Ties of the element grid, zeros, subnormal and tied E4M3 scales, saturation at 6 x 448, huge and tiny
    magnitudes, NaN and Inf - each value alone, in a random block scaled to it, and in a tie pattern."""
    vals = [0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 6.0, -0.25, -0.75, -5.0, -1e-3, 6 * 448, 6 * 464,
            6 * 500, 1e30, -3e38, 6 * 2 ** -9, 6 * 2 ** -10, 6 * 2 ** -10 * 1.01, 6 * 2 ** -11, 6 * 3 * 2 ** -10, 6.375,
            7.125, 1e-40, 2 ** -130, 65504.0, 1e6, 2.0 ** 20, float("nan"), float("inf"), -float("inf")]
    g = torch.Generator().manual_seed(0)
    rows = []
    for v in vals:
        for k in range(rows_per_value):
            r = torch.randn(16, generator=g) * (abs(v) / 6 if np.isfinite(v) and v else 1.0)
            r[(3 * k) % 16] = v
            if k == 2:
                r = torch.full((16,), v)
            if k == 3:
                r = r * torch.tensor([1, 0.75 / 6, 0.25 / 6, 1.25 / 6] * 4)
            rows.append(r)
    return torch.stack(rows).reshape(-1, 32)


def finite_for(x, dtype):
    x = x.to(dtype)
    return x if dtype != torch.float16 else torch.nan_to_num(x, posinf=6e4, neginf=-6e4)


# ----------------------------------------------------------------------------- against MLX


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", GLOBAL_SCALES)
@pytest.mark.parametrize("kind", ["random", "adversarial"])
def test_mlx_rule_is_mx_quantize_and_dequantize_is_mx_dequantize(kind, gs, dtype):
    torch.manual_seed(0)
    x = torch.randn(32, 256) * torch.exp(torch.randn(32, 1) * 4) if kind == "random" else adversarial()
    x = finite_for(x, dtype)
    codes, scales, deq = mlx_nvfp4(x, gs)
    c, s, d = ours(x, gs, rule="mlx")
    assert torch.equal(c, codes) and torch.equal(s.reshape(scales.shape), scales)
    g = None if gs is None else torch.tensor(gs)
    mine = nvfp4_dequantize_blocks(codes.reshape(*x.shape[:-1], -1, 16), scales.reshape(*x.shape[:-1], -1), g)
    assert same_bits(mine.reshape(x.shape), deq)


@pytest.mark.parametrize("gs,dtype", [(g, torch.float32) for g in GLOBAL_SCALES] + [(None, torch.bfloat16),
                                                                                  (None, torch.float16)])
def test_nvidia_rule_scales_equal_mlx_and_values_differ_only_on_documented_cases(gs, dtype):
    """Same scale bytes as MLX on finite blocks; values differ only where MLX's argmin breaks a tie
    towards zero (mfqat: to even), a negative rounds to zero (MLX +0, mfqat -0) or |y - 6| rounds to |y|.
    (With a global scale and a 16-bit input MLX also rounds x / s to that dtype before the product.)"""
    x = finite_for(adversarial(), dtype)
    x = x[torch.isfinite(x).all(-1)]
    codes, scales, deq = mlx_nvfp4(x, gs)
    c, s, d = ours(x, gs)
    assert torch.equal(s.reshape(scales.shape), scales)
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    g = torch.tensor(1.0 if gs is None else gs)
    sc = e4m3_decode(scales).unsqueeze(-1)
    y = (blocks / sc * (1 if gs is None else 2688.0 / g)).reshape(x.shape)
    ties = torch.isin(y.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))
    differ = d != deq
    assert not (differ & ~ties & (y.abs() < 2 ** 20)).any()


def test_nvidia_rule_rounds_ties_to_even_and_keeps_the_sign_of_zero():
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, -1e-3, 0.0, -0.0, 5.5, 4.0] * 2])
    _, s, d = ours(x)
    assert e4m3_decode(s).tolist() == [[1.0, 1.0]]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -4.0, -0.0, 0.0, -0.0, 6.0, 4.0] * 2
    assert same_bits(d[0], torch.tensor(want))
    _, _, m = ours(x, rule="mlx")  # MLX: ties towards zero, -0 lost
    assert same_bits(m[0], torch.tensor([6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 0.0, -0.5, -4.0, 0.0, 0.0, 0.0, 6.0, 4.0] * 2))


def test_scale_rounding_saturation_subnormals_and_nonfinite_blocks():
    amax = torch.tensor([6.375, 6.3750006, 7.125, 6 * 448, 6 * 500, 1e30, 6 * 2 ** -9, 6 * 2 ** -10, 6 * 3 * 2 ** -10, 0.0])
    x = torch.zeros(len(amax), 32)
    x[:, 0] = x[:, 16] = amax
    _, s, _ = ours(x)
    assert e4m3_decode(s[:, 0]).tolist() == [1.0, 1.125, 1.25, 448, 448, 448, 2 ** -9, 0.0, 2 ** -8, 0.0]
    bad = torch.tensor([[1.0, float("nan")] + [0.5] * 30, [float("inf")] + [0.5] * 31])
    c, s, d = ours(bad)
    assert s[:, 0].tolist() == [0x7F, 0x7F] and (c[:, :16] == 0).all() and torch.isnan(d[:, :16]).all()
    assert not torch.isnan(d[:, 16:]).any()


def test_e4m3_helpers_equal_torch_float8():
    v = torch.cat([torch.rand(4000) * 500, torch.rand(2000) * 2 ** -6, torch.tensor([0.0, 448.0, 464.0, 2 ** -10])])
    want = v.clamp(max=448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(e4m3_encode(v), want)
    every = torch.arange(256, dtype=torch.uint8)
    assert same_bits(e4m3_decode(every), every.view(torch.float8_e4m3fn).float())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=32, max_size=32),
       st.sampled_from(DTYPES), st.sampled_from(GLOBAL_SCALES))
def test_hypothesis_against_mlx(vals, dtype, gs):
    x = torch.tensor(vals, dtype=torch.float32).reshape(1, 32).repeat(2, 1).to(dtype)
    if not torch.isfinite(x).all():
        return
    codes, scales, deq = mlx_nvfp4(x, gs)
    c, s, d = ours(x, gs, rule="mlx")
    assert torch.equal(c, codes) and torch.equal(s.reshape(scales.shape), scales) and same_bits(d, deq)


# ----------------------------------------------------------------------------- torchao, API, gradient


def test_torchao_nvfp4_equals_ours_where_its_scale_is_normal_and_differs_only_at_exact_ties():
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="torchao's NVFP4 is not installed")
    torch.manual_seed(0)
    x = torch.randn(128, 512)  # every block's amax / 6 >= 2^-6: torchao's clamp never acts
    t = nv.NVFP4Tensor.to_nvfp4(x)
    c, s, d = ours(x)
    assert torch.equal(t.scale.view(torch.uint8).reshape(s.shape), s) and same_bits(t.dequantize(torch.float32), d)
    tiny = torch.full((1, 16), 0.02)  # torchao clamps the scale to 2^-6; mfqat keeps the subnormal 2^-8
    assert e4m3_decode(nv.NVFP4Tensor.to_nvfp4(tiny).scale.view(torch.uint8)).item() == 2 ** -6
    assert e4m3_decode(ours(tiny)[1]).item() == 2 ** -8
    xb = torch.randn(128, 512).bfloat16()  # torchao multiplies by fl(1 / s): exact ties may move
    c, s, d = ours(xb)
    y = xb.float().reshape(128, -1, 16) / e4m3_decode(s).unsqueeze(-1)
    ties = torch.isin(y.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).reshape(xb.shape)
    differ = nv.NVFP4Tensor.to_nvfp4(xb).dequantize(torch.float32) != d
    assert differ.any() and not (differ & ~ties).any()


def test_public_api_global_scale_and_packing():
    x = torch.randn(4, 64)
    q = mfqat.quantize(x, "nvfp4")
    assert q.block_size == 16 and q.scales.dtype == torch.uint8 and q.global_scale is None
    assert torch.equal(q.dequantize(), ours(x)[2]) and get_format("nvfp4").bits_per_weight() == 4.5
    assert torch.equal(mfqat.fake_quantize(x, "nvfp4"), q.dequantize())
    g = quantize_nvfp4(x, torch.tensor(0.37))
    assert torch.equal(g.dequantize(), ours(x, 0.37)[2])
    packed = q.pack()
    assert torch.equal(type(q).unpack(packed, q.scales, "nvfp4", 16, tuple(x.shape)).codes, q.codes)
    with pytest.raises(ValueError, match="block_size"):
        mfqat.quantize(x, "nvfp4", 32)


def test_fake_quant_gradient_is_straight_through_and_uses_the_reference(monkeypatch):
    from mfqat.quant import kernels

    x = (torch.randn(8, 64) * 3).requires_grad_()
    assert kernels.select_backend(x, get_format("nvfp4")) == "reference"
    monkeypatch.setenv("MFQAT_BACKEND", "cpp")
    assert kernels.select_backend(x, get_format("nvfp4")) == "reference"
    y = mfqat.fake_quantize(x, "nvfp4")
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


# ----------------------------------------------------------------------------- derived from an MXFP8 anchor


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(tiny Llama trained with MF-QAT over mxfp8_e4m3 + nvfp4 through the anchor, embeddings too, its
    MXFP8 anchor, ids)."""
    from mfqat.data.sources import tiny_llama, tiny_tokenizer
    from mfqat.qat.config import QATConfig

    d = tmp_path_factory.mktemp("nvfp4")
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), hidden=64, intermediate=128, tie=True)
    cfg = QATConfig(formats=["mxfp8_e4m3", "nvfp4"], quantize_embeddings=True)
    assert cfg.anchor_format == "mxfp8_e4m3" and cfg.through_anchor
    mfqat.prepare(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    for fmt in ("mxfp8_e4m3", "nvfp4"):
        mfqat.set_format(model, fmt)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    mfqat.save_anchor(model, d / "anchor", "mxfp8_e4m3", tok)
    return model, d / "anchor", ids


def test_training_forward_equals_the_anchors_nvfp4_weights(trained):
    model, anchor, ids = trained
    mfqat.set_format(model, "nvfp4")
    with torch.no_grad():
        want = model(ids).logits
        got = mfqat.load_anchor(anchor, fmt="nvfp4")(ids).logits
    assert torch.equal(got, want), f"max diff {(got - want).abs().max()}"


def test_anchor_in_format_is_nvfp4_of_the_anchor_values(trained):
    _, anchor, _ = trained
    a = mfqat.read_anchor(anchor)
    name = next(iter(a.quantized))
    q = a.in_format("nvfp4")[name]
    values = a.quantized[name].dequantize(torch.float32)
    assert q.fmt.name == "nvfp4" and q.block_size == 16 and torch.equal(q.dequantize(torch.float32), ours(values)[2])
    with pytest.raises(ValueError, match="one width"):
        from mfqat.export.recipes import build_plan
        build_plan(a, "seed:nvfp4")


def test_export_mlx_uniform_nvfp4_is_code_for_code(trained, tmp_path):
    pytest.importorskip("mlx_lm")
    from mfqat.export import to_mlx
    from mfqat.export.mlx_export import load_weights

    _, anchor, _ = trained
    rep = to_mlx(anchor, tmp_path / "mlx", recipe="uniform:nvfp4")
    assert rep["verify"]["weights_bit_exact"] and rep["bits_per_weight"] == pytest.approx(4.5)
    cfg = json.loads((tmp_path / "mlx" / "config.json").read_text())
    assert cfg["quantization"]["mode"] == "nvfp4" and cfg["quantization"]["group_size"] == 16
    a = mfqat.read_anchor(anchor)
    name = next(iter(a.quantized))
    q = a.in_format("nvfp4")[name]
    w = load_weights(tmp_path / "mlx")
    module = name[: -len(".weight")]
    assert np.array_equal(np.array(w[f"{module}.scales"]), q.scales.numpy())  # the E4M3 bytes, as stored
    got = mx.dequantize(w[name], w[f"{module}.scales"], mode="nvfp4", dtype=mx.float32)
    assert np.array_equal(np.array(got), q.dequantize(torch.float32).numpy())
