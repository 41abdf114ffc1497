"""The C++ op of MLX's affine quantization (csrc/affine_cpu.cpp) is bit-exact with the reference
(``affine_quantize_blocks``): codes, and scales and biases once rounded to the input dtype, on random,
adversarial and hypothesis inputs, for every width, group size and input dtype; tensors holding NaN or
Inf take the reference through the public API."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mfqat
from mfqat.quant import kernels
from mfqat.quant.kernels import cpp
from mfqat.quant.reference import affine_quantize_blocks, to_blocks

from .test_kernels import assert_bits_equal

pytestmark = pytest.mark.skipif(not cpp.AFFINE_AVAILABLE, reason="C++ extension built without quantize_affine")

DTYPES = [torch.bfloat16, torch.float32, torch.float16]


def both(x: torch.Tensor, bits: int, gs: int):
    """(reference, C++ op) as (codes in x's shape, scales, biases) for ``x``."""
    fmt = mfqat.get_format(f"affine{bits}")
    codes, scales, biases = affine_quantize_blocks(to_blocks(x, gs), fmt, x.dtype)
    ref = (codes.reshape(x.shape), scales, biases)
    c, s, b, finite = cpp.quantize_affine_cpp(x, fmt, gs)
    assert finite
    return ref, (c, s.to(x.dtype).float(), b.to(x.dtype).float())


def assert_same(ref, got, what: str) -> None:
    assert torch.equal(ref[0], got[0]), f"{what}: codes differ in {(ref[0] != got[0]).sum()} elements"
    assert_bits_equal(ref[1], got[1], f"{what}: scales")
    assert_bits_equal(ref[2], got[2], f"{what}: biases")


def adversarial_affine(cols: int = 256) -> torch.Tensor:
    """Finite blocks that stress each branch of MLX's rule: flat blocks (the 1e-7 floor, q0 != 0 of a large
    constant), ties of the code grid, the min edge against the max edge, signed zeros, subnormals, huge values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, cols, generator=g) * torch.logspace(-30, 30, cols).roll(cols // 5)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = 7.5  # flat: range 0, scale floored at 1e-7, edge / scale about 7.5e7
    x[3] = -1e30  # flat and huge: q0 = round(edge / 1e-7) beyond 2^22
    x[4] = torch.arange(cols) % 16 * 0.5 - 3.75  # ties of a 4-bit grid of step 0.5
    x[5] = torch.linspace(-1.0, 3.0, cols)  # max edge larger: scale negated
    x[6] = torch.linspace(-3.0, 1.0, cols)  # min edge larger
    x[7] = torch.linspace(-2.0, 2.0, cols)  # |min| == |max|: the max edge
    x[8] = torch.tensor(1e-45) * torch.arange(cols)  # float32 subnormals
    x[9] = 1e-8 * torch.randn(cols, generator=g)  # range below the floor times the bins
    x[10] = 3e38 * torch.sign(torch.randn(cols, generator=g))  # near float32's largest
    x[11] = torch.randint(0, 16, (cols,), generator=g).float() * 0.1 + 0.05  # midpoints of a 0.1 grid
    return x


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_and_adversarial_blocks_bit_exact(bits, gs, dtype):
    g = torch.Generator().manual_seed(bits * 1000 + gs)
    random = torch.randn(64, 512, generator=g) * torch.rand(64, 1, generator=g) * 4
    for name, x in (("random", random), ("adversarial", adversarial_affine())):
        x = x.to(dtype)
        if not bool(torch.isfinite(x).all()):  # float16 / bfloat16 overflow of the huge rows: a reference case
            x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)
        ref, got = both(x, bits, gs)
        assert_same(ref, got, f"{name} affine{bits} g{gs} {dtype}")


@settings(max_examples=150, deadline=None)
@given(bits=st.integers(2, 8), gs=st.sampled_from([32, 64]), exponent=st.integers(-40, 40),
       values=st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=64, max_size=64))
def test_hypothesis_blocks_bit_exact(bits, gs, exponent, values):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 64) * 2.0 ** exponent
    x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)
    for dtype in DTYPES:
        y = x.to(dtype)
        if bool(torch.isfinite(y).all()):
            ref, got = both(y, bits, gs)
            assert_same(ref, got, f"hypothesis affine{bits} g{gs} {dtype}")


def test_public_quantize_takes_the_op_and_leaves_non_finite_tensors_to_the_reference(monkeypatch):
    """``mfqat.quantize`` of an affine format equals the reference on finite tensors (through the op) and on
    tensors holding NaN/Inf (the op says so and the reference takes over), whatever MFQAT_BACKEND says."""
    x = adversarial_affine().to(torch.bfloat16)
    x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)
    x[12, 3], x[13, 70], x[14, 200] = float("nan"), float("inf"), float("-inf")
    fmt = mfqat.get_format("affine4")
    finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    for t in (finite, x):
        codes, scales, biases = affine_quantize_blocks(to_blocks(t, 64), fmt, t.dtype)
        for backend in ("auto", "reference", "cpp"):
            monkeypatch.setenv("MFQAT_BACKEND", backend)
            q = mfqat.quantize(t, "affine4", 64)
            assert torch.equal(q.codes, codes.reshape(t.shape)), backend
            assert_bits_equal(q.scales, scales, f"{backend}: scales")
            assert_bits_equal(q.biases, biases, f"{backend}: biases")
    monkeypatch.setenv("MFQAT_BACKEND", "auto")
    calls = []
    real = cpp.quantize_affine_cpp
    monkeypatch.setattr(cpp, "quantize_affine_cpp", lambda *a: calls.append(a) or real(*a))
    mfqat.quantize(finite, "affine4", 64)
    assert len(calls) == 1, "mfqat.quantize of an affine format takes the C++ op on CPU"
    monkeypatch.setenv("MFQAT_BACKEND", "reference")
    mfqat.quantize(finite, "affine4", 64)
    assert len(calls) == 1, "MFQAT_BACKEND=reference keeps the reference"


def test_op_schema_fake_tensor_and_bad_input():
    x = torch.randn(8, 64)
    torch.library.opcheck(torch.ops.mfqat.quantize_affine.default, (x, 32, 4), test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="multiple of block_size"):
        torch.ops.mfqat.quantize_affine(torch.randn(4, 30), 32, 4)
    with pytest.raises(RuntimeError, match="bits must be in 1..8"):
        torch.ops.mfqat.quantize_affine(torch.randn(4, 32), 32, 9)
    assert kernels.affine_quantize_dispatch(x, mfqat.get_format("affine3"), 32)[0].shape == x.shape
    for bad in (float("nan"), float("inf"), float("-inf")):
        for dtype in DTYPES:
            y = torch.randn(64, 256).to(dtype)
            y[63, 255] = bad  # in the last block, whichever thread takes it
            assert cpp.quantize_affine_cpp(y, mfqat.get_format("affine4"), 64)[3] is False, (bad, dtype)
