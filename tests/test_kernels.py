"""Every fast path (C++ CPU op, Triton kernels) is bit-exact with the pure-PyTorch reference.

Triton runs under ``TRITON_INTERPRET=1`` here (scripts/test.sh sets it); on a CUDA machine the
same tests also run the compiled kernels on the GPU (scripts/gpu_check.sh).
"""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mfqat
from mfqat.quant import kernels
from mfqat.quant.kernels import cpp, triton_mx, triton_slice
from mfqat.quant.reference import fake_quantize_reference, mx_quantize_blocks, to_blocks

from .conftest import MX_FORMATS

FAST_PATHS = []
if cpp.AVAILABLE:
    FAST_PATHS.append(("cpp", "cpu"))
if triton_mx.usable_on(torch.device("cpu")):
    FAST_PATHS.append(("triton", "cpu"))
if torch.cuda.is_available() and triton_mx.AVAILABLE:
    FAST_PATHS.append(("triton", "cuda"))

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_path(backend: str, x: torch.Tensor, fmt, bs: int, rule: str, need_mask: bool = True):
    if backend == "cpp":
        return cpp.fake_quantize_cpp(x, fmt, bs, rule, need_mask)
    return triton_mx.fake_quantize_triton(x, fmt, bs, rule, need_mask)


def run_quantize(backend: str, x: torch.Tensor, fmt, bs: int, rule: str):
    if backend == "cpp":
        return cpp.quantize_cpp(x, fmt, bs, rule)
    return triton_mx.quantize_triton(x, fmt, bs, rule)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Same shape and dtype, NaN at the same places, every other element equal bit for bit."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    a, b = a.cpu(), b.cpu()
    assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN positions differ"
    int_view = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    ai, bi = torch.nan_to_num(a).view(int_view), torch.nan_to_num(b).view(int_view)
    bad = (ai != bi).nonzero()
    assert bad.numel() == 0, f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}: {a[tuple(bad[0])]} vs {b[tuple(bad[0])]}"


def adversarial(rows: int = 24, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Blocks of ties, zeros (both signs), subnormals, saturation, NaN/Inf, huge and tiny exponents."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-45, 38.5, cols).roll(cols // 3)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[2, :32] = torch.arange(32) * 0.25 - 4.0  # exact ties of many grids
    x[3, :32] = torch.arange(32) * 0.125 + 0.0625  # midpoints
    x[4, 5] = float("nan")
    x[5, 40] = float("inf")
    x[6, 70] = float("-inf")
    x[7, :32] = 3.4e38
    x[8, :32] = torch.tensor(1e-45) * torch.arange(32)  # float32 subnormals
    x[9, :32] = 2.0 ** -127
    x[10, :32] = torch.linspace(-6.5, 6.5, 32)  # saturates 4-bit grids with a small max
    x[10, 0] = 1e4
    x[11, :] = 1.0
    return x


def sweep(x: torch.Tensor):
    for dtype in DTYPES:
        yield x.to(dtype)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("name", MX_FORMATS)
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_fake_quant_bit_exact_adversarial(backend, device, name, rule):
    fmt = mfqat.get_format(name)
    for xx in sweep(adversarial()):
        xx = xx.to(device)
        for bs in (32, 8, 256):
            out, mask = run_path(backend, xx, fmt, bs, rule)
            ref, ref_mask = fake_quantize_reference(xx.cpu(), fmt, bs, rule)
            what = f"{backend} {name} {xx.dtype} bs={bs} {rule}"
            assert_bits_equal(out, ref, what)
            assert torch.equal(mask.cpu(), ref_mask), f"{what}: saturation mask"


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("name", MX_FORMATS)
def test_quantize_codes_and_scales_bit_exact(backend, device, name):
    fmt = mfqat.get_format(name)
    for rule in ("floor", "ceil"):
        for xx in sweep(adversarial(seed=1)):
            codes, scales = run_quantize(backend, xx.to(device), fmt, 32, rule)
            ref_codes, ref_scales = mx_quantize_blocks(to_blocks(xx, 32), fmt, rule)
            assert codes.dtype == ref_codes.dtype
            assert torch.equal(codes.cpu(), ref_codes.reshape(xx.shape)), f"{backend} {name} {xx.dtype} codes"
            assert torch.equal(scales.cpu(), ref_scales), f"{backend} {name} {xx.dtype} scales"


@pytest.mark.parametrize("backend,device", FAST_PATHS)
def test_awkward_shapes_and_layouts(backend, device):
    fmt = mfqat.get_format("mxfp4_e2m1")
    base = torch.randn(6, 64, 96).to(device)
    cases = {
        "non-contiguous": base.transpose(0, 1)[..., :64],
        "one row": base[0, :1, :32],
        "1-d": base[0, 0],
        "3-d": base,
        "sliced rows": base[:, ::3, :],
    }
    for label, xx in cases.items():
        out, _ = run_path(backend, xx, fmt, 32, "floor", need_mask=False)
        ref, _ = fake_quantize_reference(xx.cpu(), fmt, 32, "floor")
        assert_bits_equal(out, ref, label)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@given(name=st.sampled_from(MX_FORMATS), exponent=st.integers(-140, 120),
       values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=32, max_size=32))
def test_hypothesis_random_blocks(backend, device, name, exponent, values):
    fmt = mfqat.get_format(name)
    x = torch.tensor(np.array(values, dtype=np.float32)) * torch.tensor(2.0 ** max(exponent, -126))
    x = x.reshape(1, 32).to(device)
    out, mask = run_path(backend, x, fmt, 32, "floor")
    ref, ref_mask = fake_quantize_reference(x.cpu(), fmt, 32, "floor")
    assert_bits_equal(out, ref, f"{backend} {name}")
    assert torch.equal(mask.cpu(), ref_mask)


def test_dispatch_picks_and_overrides(monkeypatch):
    x = torch.randn(4, 64)
    fmt = mfqat.get_format("mxint4")
    monkeypatch.setenv("MFQAT_BACKEND", "reference")
    assert kernels.select_backend(x, fmt) == "reference"
    monkeypatch.setenv("MFQAT_BACKEND", "auto")
    assert kernels.select_backend(x, fmt) == ("cpp" if cpp.AVAILABLE else "reference")
    assert kernels.select_backend(x, mfqat.get_format("nf4")) == "reference"
    monkeypatch.setenv("MFQAT_BACKEND", "bogus")
    with pytest.raises(ValueError, match="MFQAT_BACKEND"):
        kernels.select_backend(x, fmt)
    monkeypatch.setenv("MFQAT_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        kernels.select_backend(x, fmt)


@pytest.mark.parametrize("backend", [b for b, d in FAST_PATHS if d == "cpu"])
def test_public_api_through_each_backend(monkeypatch, backend):
    """quantize / fake_quantize (with the STE and saturation mask) give the reference's results."""
    monkeypatch.setenv("MFQAT_BACKEND", backend)
    x = adversarial(seed=3)[11:, :].clone().requires_grad_(True)
    y = mfqat.fake_quantize(x, "mxint4", mask_saturated=True)
    y.sum().backward()
    monkeypatch.setenv("MFQAT_BACKEND", "reference")
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = mfqat.fake_quantize(x_ref, "mxint4", mask_saturated=True)
    y_ref.sum().backward()
    assert_bits_equal(y.detach(), y_ref.detach(), "fake_quantize")
    assert torch.equal(x.grad, x_ref.grad)
    monkeypatch.setenv("MFQAT_BACKEND", backend)
    q = mfqat.quantize(x.detach(), "mxfp6_e2m3")
    monkeypatch.setenv("MFQAT_BACKEND", "reference")
    q_ref = mfqat.quantize(x.detach(), "mxfp6_e2m3")
    assert torch.equal(q.codes, q_ref.codes) and torch.equal(q.scales, q_ref.scales)


@pytest.mark.skipif(not cpp.AVAILABLE, reason="C++ extension not built")
def test_cpp_ops_pass_opcheck_and_compile():
    """Schemas, fake (meta) implementations and torch.compile tracing of the custom ops."""
    x = torch.randn(8, 64)
    fmt = mfqat.get_format("mxfp8_e4m3")
    args = (32, *cpp._format_args(fmt, "floor"))
    torch.library.opcheck(torch.ops.mfqat.fake_quant_mx.default, (x, *args, True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.mfqat.quantize_mx.default, (x, *args, fmt.bias, fmt.ebits),
                          test_utils=("test_schema", "test_faketensor"))

    def f(t):
        return mfqat.fake_quantize(t, "mxfp8_e4m3") * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert_bits_equal(compiled(x), f(x), "compiled")


@pytest.mark.skipif(not cpp.AVAILABLE, reason="C++ extension not built")
def test_cpp_op_rejects_bad_input_clearly():
    fmt = mfqat.get_format("mxint8")
    with pytest.raises(RuntimeError, match="not a multiple of block_size"):
        cpp.fake_quantize_cpp(torch.randn(4, 30), fmt, 32)
    with pytest.raises(RuntimeError, match="not supported"):
        cpp.fake_quantize_cpp(torch.randn(4, 32, dtype=torch.float64), fmt, 32)


def test_missing_extension_never_breaks_import():
    """Without the compiled extension mfqat still imports and dispatch falls back to the reference."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mfqat._C'] = None\n"
            "import torch, mfqat\n"
            "from mfqat.quant import kernels\n"
            "assert not kernels.cpp.AVAILABLE and kernels.cpp.LOAD_ERROR\n"
            "assert kernels.auto_backend('cpu') == 'reference'\n"
            "print(mfqat.fake_quantize(torch.randn(2, 32), 'mxint4').shape)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]


SLICES = [("mxint8", f"mxint{k}") for k in range(2, 8)] + [
    ("mxfp8_e4m3", "mxfp6_e2m3"), ("mxfp8_e4m3", "mxfp6_e3m2"), ("mxfp8_e4m3", "mxfp4_e2m1"),
    ("mxfp8_e5m2", "mxfp4_e2m1"), ("mxfp6_e3m2", "mxfp4_e2m1"), ("mxfp8_e4m3", "mxfp8_e4m3")]


def run_slice(backend: str, codes, scales, src, dst, bs):
    if backend == "cpp":
        return cpp.slice_cpp(codes, scales, src, dst, bs)
    return triton_slice.slice_triton(codes, scales, src, dst, bs)


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("src,dst", SLICES)
def test_slice_and_scale_bit_exact(backend, device, src, dst):
    from mfqat.quant.slice import slice_reference

    x = adversarial(seed=7)
    for bs in (32, 8):
        q = mfqat.quantize(x, src, bs)
        ref = slice_reference(q, mfqat.get_format(dst))
        codes, scales = run_slice(backend, q.codes.to(device), q.scales.to(device), q.fmt, mfqat.get_format(dst), bs)
        assert torch.equal(codes.cpu().reshape(ref.codes.shape), ref.codes), f"{backend} {src}->{dst} codes"
        assert torch.equal(scales.cpu().reshape(ref.scales.shape), ref.scales), f"{backend} {src}->{dst} scales"
