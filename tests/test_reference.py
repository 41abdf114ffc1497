"""The reference quantizer against docs/numerics.md: tables, ties, saturation, edge blocks, STE.

The exact-oracle tests run once per backend (reference, cpp, triton under TRITON_INTERPRET=1).
"""
import contextlib
import math
import os
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mfqat
from mfqat.formats import get_format
from mfqat.quant.reference import (exp2i, floor_log2, mx_codes_to_values, mx_round_elements,
                                   mx_values_to_codes)

from .conftest import MX_FORMATS, MXFP_FORMATS
from .oracle import fake_quantize_block


def _backend_params():
    """Every backend, each tied to the exact oracle on its own (a missing one is a visible skip;
    tests/test_environment.py makes it a failure in CI)."""
    from mfqat.quant.kernels import cpp, triton_mx

    why = {"cpp": None if cpp.AVAILABLE else f"C++ extension not built ({cpp.LOAD_ERROR})",
           "triton": None if triton_mx.usable_on(torch.device("cpu")) else "triton missing or TRITON_INTERPRET unset"}
    return [pytest.param(b, marks=pytest.mark.skipif(bool(why.get(b)), reason=why.get(b) or ""))
            for b in ("reference", "cpp", "triton")]


BACKENDS = _backend_params()


@contextlib.contextmanager
def forced_backend(name):
    """MFQAT_BACKEND=name for the block (read per call by mfqat.quant.kernels.select_backend); a
    context manager rather than monkeypatch so that hypothesis tests can use it per example."""
    from mfqat.quant import kernels

    with mock.patch.dict(os.environ, {"MFQAT_BACKEND": name}):
        assert kernels.requested_backend() == name
        yield


def all_codes(f):
    if f.family == "mxint":
        return torch.arange(f.code_min, f.code_max + 1, dtype=torch.int8)
    codes = torch.arange(0, 2 ** f.bits, dtype=torch.int32)
    if f.name == "mxfp8_e4m3":  # S.1111.111 is NaN
        codes = codes[(codes & 0x7F) != 0x7F]
    if f.name == "mxfp8_e5m2":  # exponent 31 is Inf/NaN
        codes = codes[((codes >> 2) & 0x1F) != 0x1F]
    return codes.to(torch.uint8)


def python_decode(code: int, f) -> float:
    if f.family == "mxint":
        return code / 2 ** f.int_shift
    sign = -1.0 if code >> (f.ebits + f.mbits) & 1 else 1.0
    e = (code >> f.mbits) & ((1 << f.ebits) - 1)
    m = code & ((1 << f.mbits) - 1)
    if e == 0:
        return sign * m * 2.0 ** (f.emin - f.mbits)
    return sign * (1 + m / 2 ** f.mbits) * 2.0 ** (e - f.bias)


@pytest.mark.parametrize("name", MX_FORMATS)
def test_every_code_decodes_and_reencodes(name):
    f = get_format(name)
    codes = all_codes(f)
    values = mx_codes_to_values(codes, f)
    expected = torch.tensor([python_decode(int(c), f) for c in codes.tolist()])
    assert torch.equal(values, expected)
    q, sat = mx_round_elements(values, f)
    assert torch.equal(q, values) and not sat.any()
    assert torch.equal(mx_values_to_codes(q, f).to(torch.int32), codes.to(torch.int32))
    assert values.abs().max().item() == f.max_normal


@pytest.mark.parametrize("name,dtype", [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2)])
def test_fp8_codes_are_torch_bit_patterns(name, dtype):
    f = get_format(name)
    codes = all_codes(f)
    assert torch.equal(mx_codes_to_values(codes, f), codes.view(dtype).float())


@pytest.mark.parametrize("name", MX_FORMATS)
def test_round_half_to_even_ties(name):
    f = get_format(name)
    grid = torch.unique(mx_codes_to_values(all_codes(f), f).abs())
    mids = (grid[1:] + grid[:-1]) / 2
    q, _ = mx_round_elements(mids, f)
    codes = mx_values_to_codes(q, f).to(torch.int32)
    if f.family == "mxint":
        assert (codes % 2 == 0).all()
    else:
        assert ((codes & 1) == 0).all(), "ties must go to the even mantissa"
    lo, hi = grid[:-1], grid[1:]
    assert ((q == lo) | (q == hi)).all()


@pytest.mark.parametrize("name", MX_FORMATS)
def test_saturation_and_block_max(name):
    f = get_format(name)
    block = torch.zeros(1, 32)
    block[0, 0] = 1.0 * 2 ** f.emax * 1.999  # block max just under the next power of two
    block[0, 1] = -block[0, 0]
    q = mfqat.quantize(block, f)
    out = q.dequantize()
    assert out[0, 0].item() == f.max_normal if block[0, 0] > f.max_normal else True
    assert out[0, 0] == -out[0, 1]
    assert q.scales.item() == 127  # s = floor(log2 amax) - emax = 0


def test_scale_rule_ceil_never_saturates(mx_format):
    torch.manual_seed(0)
    x = torch.randn(64, 64) * 3
    out = mfqat.fake_quantize(x, mx_format, scale_rule="ceil")
    q = mfqat.quantize(x, mx_format, scale_rule="ceil")
    f = get_format(mx_format)
    scale = torch.exp2(q.scales.float() - 127).repeat_interleave(32, -1)
    assert ((x / scale).abs().amax() <= f.max_normal)
    assert torch.equal(out, q.dequantize())
    floor = mfqat.quantize(x, mx_format)
    assert ((q.scales.int() - floor.scales.int()) >= 0).all()
    assert ((q.scales.int() - floor.scales.int()) <= 1).all()


def test_zero_block(mx_format):
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0
    q = mfqat.quantize(x, mx_format)
    assert q.scales[0].tolist() == [0, 0] and q.scales[1, 0].item() == 0
    assert (q.codes[0] == 0).all()
    assert torch.equal(q.dequantize()[0], torch.zeros(64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_block_gets_nan_scale(mx_format, bad):
    x = torch.ones(1, 64)
    x[0, 5] = bad
    q = mfqat.quantize(x, mx_format)
    assert q.scales[0, 0].item() == 255 and q.scales[0, 1].item() == 127 - get_format(mx_format).emax
    out = q.dequantize()
    assert out[0, :32].isnan().all() and torch.equal(out[0, 32:], torch.ones(32))
    fq = mfqat.fake_quantize(x, mx_format)
    assert fq[0, :32].isnan().all() and torch.equal(fq[0, 32:], torch.ones(32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_exponents(mx_format, backend):
    f = get_format(mx_format)
    x = torch.ones(4, 32)
    x[0] *= 3.0e38                    # near float32 max
    x[1] *= 2.0 ** -140               # subnormal float32
    x[2] = torch.linspace(-1, 1, 32) * 2.0 ** -127
    x[3] *= 2.0 ** -126
    with forced_backend(backend):
        q = mfqat.quantize(x, f)
        fq = mfqat.fake_quantize(x, f)
    assert q.scales[0, 0].item() == 127 + 127 - f.emax
    assert q.scales[1, 0].item() == 0 and q.scales[2, 0].item() == 0
    for row in range(4):
        expect = torch.tensor(fake_quantize_block(x[row].tolist(), f))
        assert torch.equal(q.dequantize()[row], expect), row
        assert torch.equal(fq[row], expect), row


@pytest.mark.parametrize("backend", BACKENDS)
def test_subnormal_elements_kept(backend):
    f = get_format("mxfp8_e4m3")
    x = torch.zeros(1, 32)
    x[0, 0] = 448.0            # s = 0
    x[0, 1] = 2.0 ** -9        # smallest E4M3 subnormal
    x[0, 2] = 3 * 2.0 ** -9
    x[0, 3] = 2.0 ** -10       # tie between 0 and the smallest subnormal -> 0 (even)
    x[0, 4] = 1.5 * 2.0 ** -9  # tie between 1 and 2 subnormal steps -> 2
    with forced_backend(backend):
        out = mfqat.fake_quantize(x, f)
    assert out[0, 1:5].tolist() == [2.0 ** -9, 3 * 2.0 ** -9, 0.0, 2 * 2.0 ** -9]


def test_exp2i_and_floor_log2_exact():
    e = torch.arange(-149, 128)
    assert torch.equal(exp2i(e), torch.tensor([math.ldexp(1.0, int(i)) for i in e], dtype=torch.float32))
    v = exp2i(torch.arange(-126, 128))
    assert torch.equal(floor_log2(v), torch.arange(-126, 128, dtype=torch.int32))
    near_two = torch.nextafter(torch.tensor(2.0), torch.tensor(0.0))  # float log2 rounds this to 1
    assert floor_log2(near_two).item() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtypes_and_shapes(mx_format, dtype):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 64).to(dtype)
    out = mfqat.fake_quantize(x, mx_format)
    assert out.dtype == dtype and out.shape == x.shape
    ref = mfqat.quantize(x, mx_format).dequantize()
    assert torch.equal(out, ref)
    # the result is exactly representable: casting to the dtype lost nothing
    assert torch.equal(out.float(), mfqat.quantize(x, mx_format).dequantize(torch.float32))


def test_bf16_exact_same_as_fp32_input(mx_format):
    torch.manual_seed(2)
    x = torch.randn(8, 64).bfloat16()
    a = mfqat.quantize(x, mx_format)
    b = mfqat.quantize(x.float(), mx_format)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)


@pytest.mark.parametrize("name", MX_FORMATS + ["nf4", "affine2", "affine3", "affine4", "affine5", "affine6", "affine8"])
def test_pack_unpack_round_trip(name):
    f = get_format(name)
    bs = 64 if f.family in ("nf4", "affine") else 32
    torch.manual_seed(3)
    x = torch.randn(3, 5, 128)
    q = mfqat.quantize(x, f, bs)
    packed = q.pack()
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 128 * f.bits // 8)
    u = mfqat.MXTensor.unpack(packed, q.scales, f, bs, tuple(x.shape), biases=q.biases)
    assert torch.equal(u.codes, q.codes)
    assert torch.equal(u.dequantize(), q.dequantize())


@given(st.sampled_from([2, 4]), st.sampled_from([torch.int8, torch.uint8]), st.integers(1, 5), st.integers(1, 16),
       st.integers(0, 2 ** 31 - 1))
def test_byte_codes_pack_as_their_int32_bit_stream(bits, dtype, rows, groups, seed):
    """pack_codes keeps 2- and 4-bit int8/uint8 codes in uint8 arithmetic: the same bytes as the int32 bit stream
    (negative int8 codes keep their low bits)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 128) if dtype == torch.int8 else (0, 256)
    codes = torch.randint(lo, hi, (rows, groups * 8), generator=g).to(dtype)
    from mfqat.quant.packing import pack_codes
    fast = pack_codes(codes, bits)
    assert fast.dtype == torch.uint8 and torch.equal(fast, pack_codes(codes.to(torch.int32), bits))


def _bit_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout by its definition: bit k of code i is bit i * bits + k of the row's LSB-first byte stream."""
    c = codes.to(torch.int64) & ((1 << bits) - 1)
    stream = ((c.unsqueeze(-1) >> torch.arange(bits)) & 1).reshape(*c.shape[:-1], -1, 8)
    return (stream << torch.arange(8)).sum(-1).to(torch.uint8)


@given(st.integers(1, 8), st.sampled_from([torch.int8, torch.uint8, torch.int32, torch.int64]),
       st.sampled_from([(1,), (3,), (2, 3)]), st.integers(1, 6), st.booleans(), st.integers(0, 2 ** 31 - 1))
def test_codes_pack_as_their_bit_stream_and_back(bits, dtype, lead, groups, signed_bytes, seed):
    """pack_codes (words of whole-byte groups) gives the bit stream's bytes at every width, for codes of any
    integer dtype (negative ones keep their low bits) and leading shape, and unpack_codes inverts it (sign-extended
    for signed codes), also from bytes held as int8."""
    from mfqat.quant.packing import pack_codes, unpack_codes
    g = torch.Generator().manual_seed(seed)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128) if dtype == torch.int8 else (-1000, 1000)
    codes = torch.randint(lo, hi, lead + (groups * 8,), generator=g).to(dtype)
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and torch.equal(packed, _bit_stream(codes, bits))
    if signed_bytes:
        packed = packed.view(torch.int8)
    low = codes.to(torch.int64) & ((1 << bits) - 1)
    assert torch.equal(unpack_codes(packed, bits, groups * 8, signed=False).to(torch.int64), low)
    signed = torch.where(low >= (1 << (bits - 1)), low - (1 << bits), low)
    assert torch.equal(unpack_codes(packed, bits, groups * 8, signed=True).to(torch.int64), signed)


def test_pack_layout_low_nibble_first():
    f = get_format("mxint4")
    codes = torch.tensor([[1, 2, -1, 3] + [0] * 28], dtype=torch.int8)
    q = mfqat.MXTensor(codes, torch.tensor([[127]], dtype=torch.uint8), f, 32)
    assert q.pack()[0, :2].tolist() == [0x21, 0x3F]
    f6 = get_format("mxfp6_e2m3")
    codes6 = torch.tensor([[0x01, 0x02, 0x03, 0x3F] + [0] * 28], dtype=torch.uint8)
    p6 = mfqat.MXTensor(codes6, torch.tensor([[127]], dtype=torch.uint8), f6, 32).pack()
    stream = 0x01 | 0x02 << 6 | 0x03 << 12 | 0x3F << 18
    assert p6[0, :3].tolist() == [stream & 0xFF, stream >> 8 & 0xFF, stream >> 16 & 0xFF]


def test_ste_gradient_identity_and_saturation_mask():
    x = torch.tensor([[0.1] * 31 + [100.0]], requires_grad=True)
    out = mfqat.fake_quantize(x, "mxint4")
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    # force saturation: the scale comes from the big element; saturate a neighbour with ceil off
    y = torch.tensor([[1.99] * 32], requires_grad=True)  # 1.99 > 7/4 saturates in mxint4
    out = mfqat.fake_quantize(y, "mxint4", mask_saturated=True)
    out.sum().backward()
    assert torch.equal(y.grad, torch.zeros_like(y))
    assert (out == 1.75).all()


def test_bad_inputs_are_clear():
    with pytest.raises(ValueError, match=r"shape \(4, 30\).*block_size=32"):
        mfqat.quantize(torch.randn(4, 30), "mxint8")
    with pytest.raises(ValueError, match="unknown format 'mxfp5'"):
        mfqat.quantize(torch.randn(4, 32), "mxfp5")
    with pytest.raises(TypeError, match="torch.int32"):
        mfqat.quantize(torch.ones(4, 32, dtype=torch.int32), "mxint8")
    with pytest.raises(ValueError, match="block_size=48 is not allowed for format 'mxint8'"):
        mfqat.quantize(torch.randn(4, 96), "mxint8", block_size=48)
    with pytest.raises(ValueError, match="block_size=16 is not allowed for format 'affine4'"):
        mfqat.quantize(torch.randn(4, 32), "affine4", block_size=16)
    with pytest.raises(ValueError, match="scale_rule"):
        mfqat.quantize(torch.randn(4, 32), "mxint8", scale_rule="round")


def test_affine_and_nf4_error_bounds():
    torch.manual_seed(4)
    x = torch.randn(16, 128)
    for k in range(2, 9):
        q = mfqat.quantize(x, f"affine{k}", 32)
        err = (q.dequantize() - x).abs().reshape(16, 4, 32)
        # MLX's rule makes the larger-magnitude edge exact and stretches the step to fit it, so the
        # far edge can clamp: at most one step (|scale|; scales are negative when max is the edge)
        assert (err <= q.scales.abs().unsqueeze(-1) + 1e-6).all()
    q = mfqat.quantize(x, "nf4", 64)
    assert (q.dequantize() - x).abs().max() < 0.2 * x.abs().max()


def nf4_tie_blocks():
    """Blocks whose absmax is exactly 1 (so y = w exactly) holding every NF4 threshold: the float32
    midpoints of adjacent code-book entries (the thresholds bitsandbytes and mfqat compare with).
    Row 1 holds them negated and shuffled, row 2 scaled by 2^-3 with absmax 2^-3 (still exact)."""
    from mfqat.formats import NF4_CODEBOOK

    book = torch.tensor(NF4_CODEBOOK)
    mids = (book[1:] + book[:-1]) / 2
    w = torch.zeros(3, 64)
    w[0, :15], w[0, 15] = mids, 1.0
    perm = torch.randperm(15, generator=torch.Generator().manual_seed(0))
    w[1, :15], w[1, 20] = mids[perm], -1.0
    w[2] = w[0] * 2.0 ** -3
    return w, mids, perm


def test_nf4_exact_ties_go_to_the_lower_entry():
    """The documented rule (reference_bnb.nf4_quantize_blocks): a value exactly on a threshold gets the
    lower code-book entry; just above it, the upper one."""
    w, mids, perm = nf4_tie_blocks()
    q = mfqat.quantize(w, "nf4", 64)
    assert q.scales.flatten().tolist() == [1.0, 1.0, 2.0 ** -3]
    lower = torch.arange(15, dtype=torch.uint8)
    assert torch.equal(q.codes[0, :15], lower) and torch.equal(q.codes[2, :15], lower)
    assert torch.equal(q.codes[1, :15], lower[perm])
    above = torch.zeros(1, 64)
    above[0, :15], above[0, 15] = torch.nextafter(mids, torch.tensor(2.0)), 1.0
    assert torch.equal(mfqat.quantize(above, "nf4", 64).codes[0, :15], lower + 1)


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@pytest.mark.parametrize("backend", BACKENDS)
@given(st.sampled_from(MX_FORMATS), st.lists(finite, min_size=32, max_size=32))
def test_hypothesis_matches_exact_oracle(backend, name, values):
    f = get_format(name)
    x = torch.tensor([values], dtype=torch.float32)
    with forced_backend(backend):
        out = mfqat.fake_quantize(x, f)
        codes = mfqat.quantize(x, f).dequantize()
    expect = torch.tensor([fake_quantize_block(values, f)], dtype=torch.float32)
    assert torch.equal(out, expect)
    assert torch.equal(codes, expect)


@pytest.mark.parametrize("backend", BACKENDS)
@given(st.sampled_from(MX_FORMATS), st.integers(-140, 120),
       st.lists(st.floats(-2, 2, allow_nan=False, width=32), min_size=64, max_size=64))
def test_hypothesis_scaled_blocks(backend, name, exponent, values):
    f = get_format(name)
    x = torch.tensor([values], dtype=torch.float32) * 2.0 ** exponent
    with forced_backend(backend):
        q = mfqat.quantize(x, f)
        fq = mfqat.fake_quantize(x, f)
    assert torch.equal(fq, q.dequantize())
    for b in range(2):
        expect = fake_quantize_block(x[0, 32 * b:32 * (b + 1)].tolist(), f)
        assert q.dequantize()[0, 32 * b:32 * (b + 1)].tolist() == expect
    # idempotent under the floor rule: quantizing the result again changes nothing
    with forced_backend(backend):
        again = mfqat.quantize(q.dequantize(), f)
    assert torch.equal(again.dequantize(), q.dequantize())


@given(st.sampled_from(MXFP_FORMATS), st.lists(finite, min_size=32, max_size=32))
def test_hypothesis_codes_round_trip(name, values):
    f = get_format(name)
    q = mfqat.quantize(torch.tensor([values]), f)
    assert torch.equal(mx_codes_to_values(q.codes, f), mx_round_elements(mx_codes_to_values(q.codes, f), f)[0])
    u = mfqat.MXTensor.unpack(q.pack(), q.scales, f, 32, (1, 32))
    assert torch.equal(u.codes, q.codes)


@pytest.mark.parametrize("name", ["mxint8", "affine4", "nvfp4"])
def test_rows_of_a_quantized_matrix_are_the_quantized_rows(name):
    """MXTensor.rows(lo, hi) is the quantization of rows lo:hi (blocks run along the last axis): codes, scales and
    affine biases sliced, every other field kept; it decodes to the whole tensor's rows."""
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(5))
    q = mfqat.quantize(x, name)
    part = q.rows(2, 7)
    want = mfqat.quantize(x[2:7], name)
    assert torch.equal(part.codes, want.codes) and torch.equal(part.scales, want.scales)
    assert (part.biases is None) == (want.biases is None)
    if want.biases is not None:
        assert torch.equal(part.biases, want.biases)
    assert torch.equal(part.dequantize(), q.dequantize()[2:7]) and part.fmt == q.fmt
