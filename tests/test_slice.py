"""Slice-and-Scale equals direct quantization of the anchor's dequantized values, bit for bit."""
import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mfqat
from mfqat.formats import get_format
from mfqat.quant.slice import double_rounding_fraction, slice_and_scale

MXINT = [f"mxint{k}" for k in range(8, 1, -1)]
MXFP_PAIRS = [("mxfp8_e4m3", "mxfp6_e2m3"), ("mxfp8_e4m3", "mxfp6_e3m2"), ("mxfp8_e4m3", "mxfp4_e2m1"),
              ("mxfp6_e2m3", "mxfp4_e2m1"), ("mxfp6_e3m2", "mxfp4_e2m1"), ("mxfp8_e5m2", "mxfp4_e2m1"),
              ("mxfp8_e5m2", "mxfp6_e3m2"), ("mxfp8_e4m3", "mxfp8_e4m3")]


def assert_same(a, b):
    assert torch.equal(a.codes.to(torch.int32), b.codes.to(torch.int32))
    assert torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("src,dst", [(a, b) for a, b in itertools.combinations_with_replacement(MXINT, 2)])
def test_mxint_exhaustive(src, dst):
    f = get_format(src)
    # every code of the source format in every position, block max pinned so the scale is 0
    codes = torch.arange(f.code_min, f.code_max + 1, dtype=torch.int32)
    n = (codes.numel() + 30) // 31 * 31
    codes = torch.cat([codes, torch.zeros(n - codes.numel(), dtype=torch.int32)]).reshape(-1, 31)
    top = torch.full((codes.shape[0], 1), f.code_max, dtype=torch.int32)
    codes = torch.cat([codes, top], dim=1).to(torch.int8)
    scales = torch.randint(1, 254, (codes.shape[0], 1), dtype=torch.int32).to(torch.uint8)
    anchor = mfqat.MXTensor(codes, scales, f, 32)
    sliced = slice_and_scale(anchor, dst)
    assert_same(sliced, mfqat.quantize(anchor.dequantize(), dst))


@pytest.mark.parametrize("src,dst", MXFP_PAIRS)
def test_mxfp_random_and_adversarial(src, dst):
    torch.manual_seed(0)
    x = torch.randn(128, 128) * torch.exp2(torch.randint(-140, 110, (128, 1)).float())
    x[0] = 0
    x[1, :32] = torch.arange(32) * 2.0 ** -8
    x[2, :32] = float("nan")
    anchor = mfqat.quantize(x, src)
    sliced = slice_and_scale(anchor, dst)
    direct = mfqat.quantize(anchor.dequantize(), dst)
    assert_same(sliced, direct)


@given(st.sampled_from(MXFP_PAIRS), st.integers(-150, 120),
       st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=64, max_size=64))
def test_mxfp_hypothesis(pair, exponent, values):
    src, dst = pair
    x = torch.tensor([values]) * 2.0 ** exponent
    anchor = mfqat.quantize(x, src)
    assert_same(slice_and_scale(anchor, dst), mfqat.quantize(anchor.dequantize(), dst))


@given(st.sampled_from(MXINT[1:]), st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=32, max_size=32))
def test_mxint_hypothesis_chain(dst, values):
    anchor = mfqat.quantize(torch.tensor([values]), "mxint8")
    mid = slice_and_scale(anchor, "mxint6") if get_format(dst).bits < 6 else anchor
    assert_same(slice_and_scale(mid, dst), mfqat.quantize(mid.dequantize(), dst))


def test_double_rounding_is_measurable():
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    frac = double_rounding_fraction(x, "mxint8", "mxint4")
    assert 0.0 < frac < 0.2  # double rounding exists but is rare


def test_bad_slices():
    q = mfqat.quantize(torch.randn(2, 32), "mxint4")
    with pytest.raises(ValueError, match="cannot slice mxint4 up to mxint8"):
        slice_and_scale(q, "mxint8")
    with pytest.raises(ValueError, match="stays inside one MX family"):
        slice_and_scale(q, "mxfp4")
