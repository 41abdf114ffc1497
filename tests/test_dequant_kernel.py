"""The C++ op of MX dequantization (csrc/mx_dequant.cpp) is bit-exact with the reference
(``mx_dequantize_blocks``) for every MX format: every code of the format against every E8M0 byte
(255 = NaN, 254 overflowing to Inf, the subnormal 2^-127), random and hypothesis codes and scales; and
``MXTensor.dequantize`` gives the same bits through it as under ``MFQAT_BACKEND=reference``."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mfqat
from mfqat.quant import kernels
from mfqat.quant.kernels import cpp
from mfqat.quant.reference import mx_dequantize_blocks

from .conftest import MX_FORMATS
from .test_kernels import assert_bits_equal

pytestmark = pytest.mark.skipif(not cpp.DEQUANT_AVAILABLE, reason="C++ extension built without dequantize_mx")


def codes_of(fmt, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` random stored codes of ``fmt`` (int8 for MXINT, uint8 bit patterns for MXFP)."""
    if fmt.family == "mxint":
        return torch.randint(fmt.code_min, fmt.code_max + 1, (n,), generator=g).to(torch.int8)
    return torch.randint(0, 2 ** fmt.bits, (n,), generator=g).to(torch.uint8)


def reference(codes: torch.Tensor, scales: torch.Tensor, fmt, bs: int) -> torch.Tensor:
    return mx_dequantize_blocks(codes.reshape(*codes.shape[:-1], -1, bs), scales, fmt).reshape(codes.shape)


@pytest.mark.parametrize("name", MX_FORMATS)
def test_every_code_against_every_scale_byte(name):
    fmt = mfqat.get_format(name)
    bs = 32
    if fmt.family == "mxint":
        every = torch.arange(fmt.code_min, fmt.code_max + 1).to(torch.int8)
    else:
        every = torch.arange(2 ** fmt.bits).to(torch.uint8)
    reps = -(-bs // every.numel())
    block = every.repeat(reps)[:bs] if every.numel() < bs else every
    rows = [block.roll(k)[:bs] for k in range(max(1, every.numel() // bs) * 2)]
    codes = torch.stack([torch.cat(rows)] * 256)  # each row: every code, in blocks of bs
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).expand(256, codes.shape[1] // bs).contiguous()
    assert_bits_equal(cpp.dequantize_mx_cpp(codes, scales, fmt, bs), reference(codes, scales, fmt, bs), name)


@pytest.mark.parametrize("name", MX_FORMATS)
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_random_codes_and_scales_in_any_shape(name, bs):
    fmt = mfqat.get_format(name)
    g = torch.Generator().manual_seed(bs)
    codes = codes_of(fmt, 3 * 5 * 4 * bs, g).reshape(3, 5, 4 * bs)
    scales = torch.randint(0, 256, (3, 5, 4), generator=g, dtype=torch.uint8)
    assert_bits_equal(cpp.dequantize_mx_cpp(codes, scales, fmt, bs), reference(codes, scales, fmt, bs), name)


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(MX_FORMATS), seed=st.integers(0, 2 ** 31 - 1), scale=st.integers(0, 255))
def test_hypothesis_blocks(name, seed, scale):
    fmt = mfqat.get_format(name)
    g = torch.Generator().manual_seed(seed)
    codes = codes_of(fmt, 64, g).reshape(2, 32)
    scales = torch.tensor([[scale], [(scale * 7 + seed) % 256]], dtype=torch.uint8)
    assert_bits_equal(cpp.dequantize_mx_cpp(codes, scales, fmt, 32), reference(codes, scales, fmt, 32), name)


def test_mxtensor_dequantize_takes_the_op_with_the_references_bits(monkeypatch):
    x = torch.randn(16, 256) * torch.logspace(-40, 30, 256)
    x[3, :32] = float("nan")
    for name in ("mxint8", "mxint4", "mxfp8_e4m3", "mxfp4_e2m1"):
        q = mfqat.quantize(x, name)
        outs = {}
        for backend in ("reference", "auto"):
            monkeypatch.setenv("MFQAT_BACKEND", backend)
            outs[backend] = q.dequantize(torch.float32)
        assert_bits_equal(outs["auto"], outs["reference"], name)
    calls = []
    real = cpp.dequantize_mx_cpp
    monkeypatch.setattr(cpp, "dequantize_mx_cpp", lambda *a: calls.append(a) or real(*a))
    q = mfqat.quantize(x, "mxint8")
    q.dequantize()
    assert len(calls) == 1, "MXTensor.dequantize takes the C++ op on CPU"
    monkeypatch.setenv("MFQAT_BACKEND", "reference")
    q.dequantize()
    assert len(calls) == 1, "MFQAT_BACKEND=reference keeps the reference"


def test_op_schema_fake_tensor_and_bad_input():
    fmt = mfqat.get_format("mxint8")
    codes, scales = torch.zeros(4, 64, dtype=torch.int8), torch.full((4, 2), 127, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.mfqat.dequantize_mx.default, (codes, scales, 32, True, 6, 0, 0, 0, 0),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="one block of block_size per scale"):
        cpp.dequantize_mx_cpp(codes, scales[:, :1], fmt, 32)
    with pytest.raises(RuntimeError, match="uint8 E8M0 scales"):
        cpp.dequantize_mx_cpp(codes, scales.float(), fmt, 32)
    assert kernels.mx_dequantize_dispatch(codes, scales, fmt, 32).shape == codes.shape
