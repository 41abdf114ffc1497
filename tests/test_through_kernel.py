"""Train-through-anchor in one pass (C++ op, Triton kernel) is bit-exact with the two-pass
reference composition ``fake_quantize(fake_quantize(x, anchor), fmt)``, masks included."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mfqat
from mfqat.quant import kernels
from mfqat.quant.kernels import cpp, triton_mx
from mfqat.quant.reference import dtype_max_exponent, fake_quantize_reference, mx_fake_quantize_blocks

from .conftest import MX_FORMATS
from .test_kernels import DTYPES, FAST_PATHS, adversarial, assert_bits_equal

PAIRS = [("mxint8", f) for f in ("mxint7", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2")] + [
    ("mxfp8_e4m3", f) for f in ("mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1")] + [
    ("mxfp8_e5m2", "mxfp4_e2m1"), ("mxint8", "mxfp4_e2m1")]
RULES = [("floor", "floor"), ("ceil", "floor"), ("floor", "ceil")]


def two_pass(x, anchor, fmt, bs, anchor_rule, rule):
    """The reference composition: (output, union of both stages' saturation masks, each mask)."""
    mid, m1 = fake_quantize_reference(x, anchor, bs, anchor_rule)
    out, m2 = fake_quantize_reference(mid, fmt, bs, rule)
    return out, m1 | m2, m1, m2


def run_through(backend, x, anchor, fmt, bs, anchor_rule, rule, need_mask=True):
    if backend == "cpp":
        return cpp.fake_quantize_through_cpp(x, anchor, fmt, bs, anchor_rule, rule, need_mask)
    return triton_mx.fake_quantize_through_triton(x, anchor, fmt, bs, anchor_rule, rule, need_mask)


def through_input(seed: int = 0) -> torch.Tensor:
    """The kernels' adversarial blocks, plus blocks that saturate in the anchor and not in the target."""
    x = adversarial(seed=seed)
    x[12, :32] = torch.linspace(-1.0, 1.0, 32) * 1.999  # the anchor's largest codes and beyond
    x[13, :32] = torch.linspace(-460.0, 460.0, 32)  # past mxfp8_e4m3's 448 after scaling
    x[14, :32] = 2.0 ** -14 * torch.arange(32)  # float16 subnormals after the anchor's rounding
    return x


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("anchor,fmt", PAIRS)
@pytest.mark.parametrize("anchor_rule,rule", RULES)
def test_through_bit_exact_adversarial(backend, device, anchor, fmt, anchor_rule, rule):
    a, f = mfqat.get_format(anchor), mfqat.get_format(fmt)
    for dtype in DTYPES:
        xx = through_input().to(dtype)
        for bs in (32, 8, 256):
            out, mask = run_through(backend, xx.to(device), a, f, bs, anchor_rule, rule)
            ref, ref_mask, _, _ = two_pass(xx, a, f, bs, anchor_rule, rule)
            what = f"{backend} {anchor}->{fmt} {dtype} bs={bs} {anchor_rule}/{rule}"
            assert_bits_equal(out, ref, what)
            assert torch.equal(mask.cpu(), ref_mask), f"{what}: saturation mask"


def test_adversarial_input_saturates_each_stage_alone():
    """The mask test above has power: on its input, each stage saturates where the other does not
    (only the target under floor/floor; only the anchor under floor/ceil, where the target's ceil
    never saturates the block max that saturated the anchor)."""
    for anchor, fmt in (("mxint8", "mxint4"), ("mxfp8_e4m3", "mxfp4_e2m1")):
        a, f = mfqat.get_format(anchor), mfqat.get_format(fmt)
        _, _, m1, m2 = two_pass(through_input(), a, f, 32, "floor", "floor")
        assert (m2 & ~m1).any(), (anchor, fmt)
        _, _, m1, m2 = two_pass(through_input(), a, f, 32, "floor", "ceil")
        assert (m1 & ~m2).any(), (anchor, fmt)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@settings(deadline=None, max_examples=60)
@given(pair=st.sampled_from(PAIRS), dtype=st.sampled_from(DTYPES), exponent=st.integers(-140, 120),
       values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=64, max_size=64))
def test_through_hypothesis_random_blocks(backend, device, pair, dtype, exponent, values):
    a, f = (mfqat.get_format(n) for n in pair)
    x = (torch.tensor(np.array(values, dtype=np.float32)) * torch.tensor(2.0 ** max(exponent, -126)))
    x = x.reshape(2, 32).to(dtype)
    out, mask = run_through(backend, x.to(device), a, f, 32, "floor", "floor")
    ref, ref_mask, _, _ = two_pass(x, a, f, 32, "floor", "floor")
    assert_bits_equal(out, ref, f"{backend} {pair} {dtype}")
    assert torch.equal(mask.cpu(), ref_mask)


@pytest.mark.parametrize("backend", ["reference"] + [b for b, d in FAST_PATHS if d == "cpu"])
@pytest.mark.parametrize("mask_saturated", [False, True])
def test_public_api_equals_composition_and_passes_gradient_straight(monkeypatch, backend, mask_saturated):
    monkeypatch.setenv("MFQAT_BACKEND", backend)
    x = (through_input(seed=3)[10:16] * 1).requires_grad_()
    got = mfqat.fake_quantize_through(x, "mxint8", "mxint4", 32, mask_saturated=mask_saturated)
    x2 = x.detach().clone().requires_grad_()
    want = mfqat.fake_quantize(mfqat.fake_quantize(x2, "mxint8", 32, mask_saturated=mask_saturated), "mxint4", 32,
                               mask_saturated=mask_saturated)
    assert_bits_equal(got.detach(), want.detach(), backend)
    g = torch.randn_like(x)
    got.backward(g)
    want.backward(g)
    assert torch.equal(x.grad, x2.grad)
    if mask_saturated:
        assert (x.grad == 0).any()
    else:
        assert torch.equal(x.grad, g)


def test_without_a_fused_op_the_dispatch_runs_two_passes(monkeypatch):
    """An older C++ build (no through op) or a non-MX anchor: the same bits from two passes."""
    monkeypatch.setattr(cpp, "THROUGH_AVAILABLE", False)
    x = through_input(seed=4)
    a, f = mfqat.get_format("mxfp8_e4m3"), mfqat.get_format("mxfp4_e2m1")
    for anchor_rule, rule in RULES:  # floor/ceil: the anchor stage saturates where the target does not
        out, mask = kernels.fake_quantize_through_dispatch(x, a, f, 32, anchor_rule, rule, need_mask=True)
        ref, ref_mask, _, _ = two_pass(x, a, f, 32, anchor_rule, rule)
        assert_bits_equal(out, ref, f"two passes {anchor_rule}/{rule}")
        assert torch.equal(mask, ref_mask), f"two passes {anchor_rule}/{rule}: saturation mask"
    nf4 = mfqat.get_format("nf4")
    out, _ = kernels.fake_quantize_through_dispatch(x[:2].clamp(-10, 10), mfqat.get_format("mxint8"), nf4, 64)
    mid, _ = fake_quantize_reference(x[:2].clamp(-10, 10), mfqat.get_format("mxint8"), 64)
    assert_bits_equal(out, fake_quantize_reference(mid, nf4, 64)[0], "nf4 target")


def test_bad_input_names_the_tensor_and_the_fix():
    with pytest.raises(ValueError, match="multiple of block_size=32"):
        mfqat.fake_quantize_through(torch.randn(4, 48), "mxint8", "mxint4")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mfqat.fake_quantize_through(torch.randn(4, 64, dtype=torch.float64), "mxint8", "mxint4")


@pytest.mark.skipif(not cpp.THROUGH_AVAILABLE, reason="C++ extension not built")
def test_cpp_through_op_passes_opcheck_and_compile():
    """Schema, fake (meta) implementation and torch.compile tracing of the fused op."""
    a, f = mfqat.get_format("mxint8"), mfqat.get_format("mxint4")
    args = (32, *cpp._format_args(a, "floor"), *cpp._format_args(f, "floor"))
    for need_mask in (True, False):
        torch.library.opcheck(torch.ops.mfqat.fake_quant_mx_through.default, (torch.randn(8, 64), *args, need_mask),
                              test_utils=("test_schema", "test_faketensor"))

    def fn(t):
        return mfqat.fake_quantize_through(t, "mxint8", "mxint4") * 2

    x = torch.randn(8, 64)
    assert_bits_equal(torch.compile(fn, backend="aot_eager", fullgraph=True)(x), fn(x), "compiled")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_mx_rounding_is_exact_in_the_input_dtype(dtype):
    """What lets the fused kernels keep the anchor's output in float32 instead of storing it in the
    dtype as the two-pass composition does: for every finite value of the dtype (in blocks of mixed
    and of similar magnitudes), one MX qdq is exactly representable in that dtype."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    vals = bits[torch.isfinite(bits)]
    vals = vals[: vals.numel() // 32 * 32]
    shuffled = vals[torch.randperm(vals.numel(), generator=torch.Generator().manual_seed(0))]
    for name in MX_FORMATS:
        for rule in ("floor", "ceil"):
            for v in (vals.abs().sort().values, shuffled):
                out, _ = mx_fake_quantize_blocks(v.float().reshape(-1, 32), mfqat.get_format(name), rule,
                                                 dtype_max_exponent(dtype))
                assert_bits_equal(out.to(dtype).float(), out, f"{name} {rule} {dtype}")
