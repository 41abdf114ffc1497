"""The MXINT scale search kernels - the C++ op (csrc/mx_search.cpp) and the Triton kernel
(mfqat/quant/kernels/triton_search.py; interpreted on CPU here, compiled on CUDA by
scripts/gpu_check.sh) - are bit-exact with the PyTorch oracle (mfqat.quant.scale_search.
mx_search_exponent and its MXINT decoder), on random, adversarial and hypothesis inputs, with and
without importance weights, in float32, bfloat16 and float16."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mfqat.formats import get_format
from mfqat.quant import scale_search
from mfqat.quant.kernels import cpp, triton_mx, triton_search
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.reference import dtype_max_exponent, mx_encode_blocks, to_blocks

from .test_kernels import DTYPES, adversarial, assert_bits_equal

MXINT = ["mxint8", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2"]
PATHS = []
if cpp.SEARCH_AVAILABLE:
    PATHS.append(("cpp", "cpu"))
if triton_mx.usable_on(torch.device("cpu")):
    PATHS.append(("triton", "cpu"))
if torch.cuda.is_available() and triton_mx.AVAILABLE:
    PATHS.append(("triton", "cuda"))
needs_cpp = pytest.mark.skipif(not cpp.SEARCH_AVAILABLE, reason="C++ extension (search ops) not built")


def oracle_values(x: torch.Tensor, f, bs: int, s: torch.Tensor, nonfinite: torch.Tensor) -> torch.Tensor:
    """x encoded with exponents s and decoded by the pure-PyTorch path: MXINT's direct decode, MXFP's
    codes decoded by MXTensor (what every reader does)."""
    blocks = to_blocks(x, bs)
    if f.family == "mxint":
        return scale_search._mxint_values(blocks, f, s, nonfinite).reshape(x.shape).to(x.dtype)
    codes, scales = mx_encode_blocks(blocks, f, s, nonfinite)
    return MXTensor(codes.reshape(x.shape), scales, f, bs, x.dtype, None, "search").dequantize(x.dtype)


def oracle(x: torch.Tensor, name: str, bs: int, importance):
    """(exponents, non-finite mask, decoded values) of the pure-PyTorch path."""
    f = get_format(name)
    s, nonfinite = scale_search.mx_search_exponent(to_blocks(x, bs), f, importance, dtype_max_exponent(x.dtype))
    return s, nonfinite, oracle_values(x, f, bs, s, nonfinite)


def kernel(x: torch.Tensor, name: str, bs: int, importance, path=("cpp", "cpu")):
    """The same three from a kernel: ``path`` = (backend, device)."""
    f = get_format(name)
    backend, device = path
    x = x.to(device)
    w = None if importance is None else importance.to(device=device, dtype=torch.float64)
    if backend == "cpp":
        s, nonfinite = cpp.search_cpp(x, f, bs, w, scale_search.SEARCH_OFFSETS)
        return s, nonfinite, cpp.decode_exponents_cpp(x, f, bs, s, nonfinite)
    s, nonfinite = triton_search.search_triton(x, f, bs, w)
    values = triton_search.decode_exponents_triton(x, f, bs, s, nonfinite)
    return s.cpu(), nonfinite.cpu(), values.cpu()


def assert_same(x: torch.Tensor, name: str, bs: int, importance, what: str, path=("cpp", "cpu")) -> None:
    s_ref, nf_ref, v_ref = oracle(x, name, bs, importance)
    s, nf, v = kernel(x, name, bs, importance, path)
    assert torch.equal(nf, nf_ref), f"{what}: non-finite blocks differ"
    bad = (s != s_ref).nonzero()
    assert bad.numel() == 0, f"{what}: {len(bad)} exponents differ, first at {bad[0].tolist()}"
    assert_bits_equal(v, v_ref, what)


@pytest.mark.parametrize("path", PATHS, ids="-".join)
@pytest.mark.parametrize("name", MXINT + ["mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1"])
@pytest.mark.parametrize("weighted", [False, True])
def test_search_kernel_matches_oracle_on_adversarial_and_random_input(path, name, weighted):
    g = torch.Generator().manual_seed(1)
    cases = {"adversarial": adversarial(), "random": torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g)}
    for label, x in cases.items():
        imp = None
        if weighted:  # uneven weights with exact zeros: the weighted error decides the exponent
            imp = torch.rand(x.shape[-1], generator=g) ** 4
            imp[::7] = 0.0
        for dtype in DTYPES:
            assert_same(x.to(dtype), name, 32, imp, f"{name} {label} {dtype} weighted={weighted}", path)


@pytest.mark.parametrize("path", PATHS, ids="-".join)
def test_search_kernel_changes_exponents_where_the_oracle_does(path):
    """Not a vacuous comparison: on random weights the search moves many blocks off floor."""
    x = torch.randn(64, 512)
    s, _, _ = kernel(x, "mxint4", 32, torch.rand(512), path)
    floor, _ = scale_search.mx_shared_exponent(to_blocks(x, 32), get_format("mxint4"), "floor")
    assert 0.05 < (s != floor).float().mean() < 0.95


@needs_cpp
@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(MXINT), bs=st.sampled_from([1, 2, 3, 5, 8, 24, 32, 33]),
       rows=st.integers(1, 4), blocks=st.integers(1, 4), log_scale=st.integers(-140, 120),
       seed=st.integers(0, 2 ** 31 - 1), weighted=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_search_kernel_matches_oracle_property(name, bs, rows, blocks, log_scale, seed, weighted, dtype):
    x, imp = property_case(seed, rows, blocks, bs, log_scale, weighted)
    assert_same(x.to(dtype), name, bs, imp, f"{name} bs={bs} {dtype}")


def property_case(seed: int, rows: int, blocks: int, bs: int, log_scale: int, weighted: bool, ties: bool = True):
    """(x, importance or None) of a hypothesis example: normal values scaled by 2^log_scale (tiny,
    subnormal, huge: inf in float16), or with ``ties`` sometimes grid ties and zeros of both signs."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((rows, blocks * bs)).astype(np.float32))
    x = x * float(2.0 ** max(-149, min(log_scale, 127)))
    if ties and rng.random() < 0.3:
        x = torch.from_numpy(rng.integers(-16, 17, x.shape).astype(np.float32)) * 0.125
        x[x == 0] = -0.0 if rng.random() < 0.5 else 0.0
    imp = torch.from_numpy(rng.random(blocks * bs).astype(np.float32)) if weighted else None
    return x, imp


@pytest.mark.skipif(not any(p[0] == "triton" for p in PATHS), reason="Triton not usable here")
@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(MXINT), bs=st.sampled_from([8, 16, 32, 64, 256]), rows=st.integers(1, 3),
       blocks=st.integers(1, 3), log_scale=st.integers(-140, 120), seed=st.integers(0, 2 ** 31 - 1),
       weighted=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_triton_search_matches_oracle_property(name, bs, rows, blocks, log_scale, seed, weighted, dtype):
    x, imp = property_case(seed, rows, blocks, bs, log_scale, weighted, ties=False)
    path = next(p for p in PATHS if p[0] == "triton")
    assert_same(x.to(dtype), name, bs, imp, f"{name} bs={bs} {dtype}", path)


def order_sensitive_case(n_blocks: int = 1000):
    """One row of mxint4 blocks (32 wide) whose exponent depends on the order of the float64 error
    sum: a 2^52 error term shared by every candidate (x = 1/16 rounds to 0 on each grid, weight 2^60),
    dyadic elements with power-of-two weights (exact terms, near-tied candidates), and a clipped block
    maximum (floor's exponent is 0). Each block has its own weights (the importance of its columns)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (n_blocks, 32), generator=g).float() / 64
    w = 2.0 ** torch.randint(-2, 9, (n_blocks, 32), generator=g).double()
    x[:, 0], w[:, 0], x[:, 31] = 1 / 16, 2.0 ** 60, 1.96875
    return x.reshape(1, -1), w.reshape(-1)


@pytest.mark.parametrize("path", PATHS, ids="-".join)
def test_search_kernel_repeats_the_oracles_sum_order(path, monkeypatch):
    x, imp = order_sensitive_case()
    assert_same(x, "mxint4", 32, imp, "order-sensitive blocks", path)
    s_ref, _, _ = oracle(x, "mxint4", 32, imp)
    for other in (lambda e: e.sum(-1), lambda e: e[..., 0::2].sum(-1) + e[..., 1::2].sum(-1)):
        monkeypatch.setattr(scale_search, "fixed_order_sum", other)  # the case can fail: other orders differ
        assert (oracle(x, "mxint4", 32, imp)[0] != s_ref).sum() >= 3


def test_fixed_order_sum_is_the_documented_pairwise_order():
    """The reference's sum order, which the kernel repeats: pairs (i, i + n // 2), odd last carried."""
    rng = np.random.default_rng(0)
    for n in range(1, 41):
        v = (rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).tolist()
        e = list(v)
        while len(e) > 1:
            h = len(e) // 2
            e = [e[i] + e[i + h] for i in range(h)] + e[2 * h:]
        got = scale_search.fixed_order_sum(torch.tensor(v, dtype=torch.float64)).item()
        assert got == e[0] and math.isfinite(got), n


@needs_cpp
def test_search_entry_points_use_the_kernel_and_the_oracle_alike(monkeypatch):
    """search_exponents / dequantize_with_exponents give the same bits on every backend."""
    x = adversarial()[:, :128].to(torch.bfloat16)
    imp = torch.rand(128)
    results = {}
    backends = ("cpp", "reference") + (("triton",) if triton_mx.usable_on(torch.device("cpu")) else ())
    for backend in backends:
        monkeypatch.setenv("MFQAT_BACKEND", backend)
        exps = scale_search.search_exponents(x, "mxint4", 32, imp)
        results[backend] = (exps, scale_search.dequantize_with_exponents(x, "mxint4", 32, exps))
    (s2, nf2), v2 = results.pop("reference")
    for backend, ((s1, nf1), v1) in results.items():
        assert torch.equal(s1, s2) and torch.equal(nf1, nf2), backend
        assert_bits_equal(v1, v2, f"entry points, {backend}")


@needs_cpp
def test_search_ops_pass_opcheck_and_reject_bad_weights():
    x = torch.randn(4, 64)
    f = get_format("mxint4")
    w = torch.rand(64, dtype=torch.float64)
    args = (32, *cpp._format_args(f, "floor")[:-1], [-1, 1])
    torch.library.opcheck(torch.ops.mfqat.search_mx.default, (x, w, *args), test_utils=("test_schema", "test_faketensor"))
    s, nf = torch.ops.mfqat.search_mx(x, w, *args)
    torch.library.opcheck(torch.ops.mfqat.decode_mx_exponents.default, (x, s, nf, *args[:-1]),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(RuntimeError, match="one per input column"):
        torch.ops.mfqat.search_mx(x, torch.rand(63, dtype=torch.float64), *args)


@pytest.mark.parametrize("path", PATHS, ids="-".join)
def test_search_kernel_takes_non_contiguous_input(path):
    """A transposed view (the kernel makes it contiguous) gives the oracle's result."""
    x = torch.randn(96, 64).t()  # (64, 96), not contiguous
    assert not x.is_contiguous()
    assert_same(x, "mxint4", 32, torch.rand(96), "transposed view", path)


def reference_through(x: torch.Tensor, anchor: str, name: str, bs: int, exps) -> torch.Tensor:
    """The oracle composition: the anchor's reference quantize-dequantize, then the decode."""
    from mfqat.quant.reference import fake_quantize_reference

    base, _ = fake_quantize_reference(x, get_format(anchor), bs, "floor")
    return oracle_values(base, get_format(name), bs, *exps)


@needs_cpp
@pytest.mark.parametrize("anchor", ["mxint8", "mxfp8_e4m3"])
@pytest.mark.parametrize("name", ["mxint6", "mxint4", "mxint3", "mxint2"])
def test_fused_anchor_decode_matches_the_composition(anchor, name):
    """decode_mx_exponents_through = the anchor's quantize-dequantize then the decode, bit for bit, for
    the searched exponents and for exponents one off either way (saturating and coarse blocks)."""
    a, f = get_format(anchor), get_format(name)
    for dtype in DTYPES:
        x = adversarial(seed=11).to(dtype)
        x[0, :32] = torch.linspace(-1.0, 1.0, 32) * 1.999  # the anchor's largest codes
        base, _ = cpp.fake_quantize_cpp(x, a, 32)
        s, nonfinite = cpp.search_cpp(base, f, 32, torch.rand(x.shape[-1], dtype=torch.float64), (-1, 1))
        for d in (0, -1, 1):
            exps = ((s + d).clamp(-127, 127).to(torch.int32), nonfinite)
            what = f"{anchor}->{name} {dtype} exponents{d:+d}"
            fused = cpp.decode_exponents_through_cpp(x, a, "floor", f, 32, *exps)
            assert_bits_equal(fused, cpp.decode_exponents_cpp(base, f, 32, *exps), what)
            assert_bits_equal(fused, reference_through(x, anchor, name, 32, exps), what + " (oracle)")


@needs_cpp
def test_searched_weight_uses_the_fused_op_with_the_same_bits(monkeypatch):
    """The public entry point gives the same bits fused (C++) and composed (reference backend)."""
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 2, 256)
    x[0, :32] = torch.linspace(-1.0, 1.0, 32) * 1.999  # saturates mxint8 under floor, not ceil: the rule matters
    exps = scale_search.search_exponents(cpp.fake_quantize_cpp(x, get_format("mxint8"), 32)[0], "mxint4", 32, None)
    fused = scale_search.dequantize_through_with_exponents(x, "mxint8", "floor", "mxint4", 32, exps)
    monkeypatch.setenv("MFQAT_BACKEND", "reference")
    assert_bits_equal(fused, scale_search.dequantize_through_with_exponents(x, "mxint8", "floor", "mxint4", 32, exps),
                      "entry point")
    f, a = get_format("mxint4"), get_format("mxint8")
    torch.library.opcheck(torch.ops.mfqat.decode_mx_exponents_through.default,
                          (x, *exps, 32, *cpp._format_args(a, "floor"), *cpp._format_args(f, "floor")[:-1]),
                          test_utils=("test_schema", "test_faketensor"))


@needs_cpp
@pytest.mark.parametrize("anchor", ["mxint8", "mxfp8_e4m3"])
@pytest.mark.parametrize("name", ["mxint6", "mxint4", "mxint3"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_anchor_search_matches_the_composition(anchor, name, weighted):
    """search_mx_through = the anchor's quantize-dequantize, the search and the decode, bit for bit."""
    a, f = get_format(anchor), get_format(name)
    for dtype in DTYPES:
        x = adversarial(seed=13).to(dtype)
        x[0, :32] = torch.linspace(-1.0, 1.0, 32) * 1.999
        w = torch.rand(x.shape[-1], dtype=torch.float64) if weighted else None
        s, nonfinite, values = cpp.search_through_cpp(x, a, "floor", f, 32, w, (-1, 1))
        base, _ = cpp.fake_quantize_cpp(x, a, 32)
        s_ref, nf_ref, v_ref = oracle(base, name, 32, None if w is None else w.float())
        what = f"{anchor}->{name} {dtype} weighted={weighted}"
        assert torch.equal(nonfinite, nf_ref), what
        assert torch.equal(s, s_ref), what
        assert_bits_equal(values, v_ref, what)


@needs_cpp
def test_searched_format_search_entry_point_is_the_same_fused_or_not(monkeypatch):
    x = torch.randn(16, 256) * torch.logspace(-3, 2, 256)
    imp = torch.rand(256)
    (s1, n1), v1 = scale_search.search_through_anchor(x, "mxint8", "floor", "mxint4", 32, imp)
    monkeypatch.setenv("MFQAT_BACKEND", "reference")
    (s2, n2), v2 = scale_search.search_through_anchor(x, "mxint8", "floor", "mxint4", 32, imp)
    assert torch.equal(s1, s2) and torch.equal(n1, n2)
    assert_bits_equal(v1, v2, "search_through_anchor")
    f, a = get_format("mxint4"), get_format("mxint8")
    torch.library.opcheck(torch.ops.mfqat.search_mx_through.default,
                          (x, imp.double(), 32, *cpp._format_args(a, "floor"), *cpp._format_args(f, "floor")[:-1],
                           [-1, 1]), test_utils=("test_schema", "test_faketensor"))
