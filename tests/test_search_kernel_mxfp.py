"""The MX scale search for the float family (MXFP6/MXFP4 searched inside training, through an MXFP8
anchor): the C++ ops (csrc/mx_search.cpp) are bit-exact with the PyTorch oracle
(mfqat.quant.scale_search.mx_search_exponent and the MXFP encode + decode) on random, adversarial and
hypothesis inputs (the adversarial and random cases in test_search_kernel.py), weighted and not, in
float32, bfloat16 and float16; the fused train-through-anchor ops equal the composition; the public
entry points give the same bits with and without the kernel. The Triton kernels are checked the same way (under TRITON_INTERPRET=1 here, compiled on CUDA by
scripts/gpu_check.sh)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mfqat.formats import get_format
from mfqat.quant import scale_search
from mfqat.quant.kernels import cpp, search_dispatch

from .test_kernels import DTYPES, adversarial, assert_bits_equal
from .test_search_kernel import PATHS, assert_same, oracle, property_case, reference_through

MXFP = ["mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1"]
needs_cpp = pytest.mark.skipif(not cpp.SEARCH_AVAILABLE, reason="C++ extension (search ops) not built")


@needs_cpp
def test_mxfp_search_moves_blocks_both_ways_off_floor():
    """Not a vacuous comparison: the weighted search picks floor-1, floor and floor+1 on random weights."""
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3))
    f = get_format("mxfp4_e2m1")
    s, _ = search_dispatch(x, f, 32, torch.rand(512, dtype=torch.float64), scale_search.SEARCH_OFFSETS)
    floor, _ = scale_search.mx_shared_exponent(x.reshape(64, 16, 32), f, "floor")
    moved = (s - floor).unique().tolist()
    assert moved == [-1, 0, 1], moved


@needs_cpp
@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(MXFP), bs=st.sampled_from([1, 2, 3, 5, 8, 24, 32, 33]),
       rows=st.integers(1, 4), blocks=st.integers(1, 4), log_scale=st.integers(-140, 120),
       seed=st.integers(0, 2 ** 31 - 1), weighted=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_mxfp_search_kernel_matches_oracle_property(name, bs, rows, blocks, log_scale, seed, weighted, dtype):
    x, imp = property_case(seed, rows, blocks, bs, log_scale, weighted)
    assert_same(x.to(dtype), name, bs, imp, f"{name} bs={bs} {dtype}")


@needs_cpp
@pytest.mark.parametrize("name", MXFP)
def test_mxfp_fused_anchor_ops_match_the_composition(name):
    """decode_mx_exponents_through and search_mx_through from an MXFP8 anchor = the anchor's
    quantize-dequantize, then the search / decode, bit for bit (exponents as searched and one off)."""
    a, f = get_format("mxfp8_e4m3"), get_format(name)
    for dtype in DTYPES:
        x = adversarial(seed=17).to(dtype)
        x[0, :32] = torch.linspace(-1.0, 1.0, 32) * 448.0  # the anchor's largest codes
        w = torch.rand(x.shape[-1], dtype=torch.float64)
        base, _ = cpp.fake_quantize_cpp(x, a, 32)
        s, nonfinite, values = cpp.search_through_cpp(x, a, "floor", f, 32, w, (-1, 1))
        s_ref, nf_ref, v_ref = oracle(base, name, 32, w)
        assert torch.equal(nonfinite, nf_ref) and torch.equal(s, s_ref), f"{name} {dtype} search"
        assert_bits_equal(values, v_ref, f"{name} {dtype} fused search values")
        for d in (0, -1, 1):
            exps = ((s + d).clamp(-127, 127).to(torch.int32), nonfinite)
            fused = cpp.decode_exponents_through_cpp(x, a, "floor", f, 32, *exps)
            assert_bits_equal(fused, reference_through(x, "mxfp8_e4m3", name, 32, exps), f"{name} {dtype} {d:+d}")


@pytest.mark.skipif(not any(p[0] == "triton" for p in PATHS), reason="Triton not usable here")
@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(MXFP), bs=st.sampled_from([8, 16, 32, 64, 256]), rows=st.integers(1, 3),
       blocks=st.integers(1, 3), log_scale=st.integers(-140, 120), seed=st.integers(0, 2 ** 31 - 1),
       weighted=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_mxfp_triton_search_matches_oracle_property(name, bs, rows, blocks, log_scale, seed, weighted, dtype):
    x, imp = property_case(seed, rows, blocks, bs, log_scale, weighted)
    path = next(p for p in PATHS if p[0] == "triton")
    assert_same(x.to(dtype), name, bs, imp, f"{name} bs={bs} {dtype}", path)


@needs_cpp
def test_mxfp_entry_points_are_the_same_with_and_without_the_kernel(monkeypatch):
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 2, 256)
    imp = torch.rand(256)
    results = {}
    for backend in ("cpp", "reference"):
        monkeypatch.setenv("MFQAT_BACKEND", backend)
        exps, values = scale_search.search_through_anchor(x, "mxfp8_e4m3", "floor", "mxfp4_e2m1", 32, imp)
        decoded = scale_search.dequantize_through_with_exponents(x, "mxfp8_e4m3", "floor", "mxfp4_e2m1", 32, exps)
        results[backend] = (exps, values, decoded, scale_search.quantize_search(x, "mxfp4_e2m1", 32, imp).dequantize())
    (e1, v1, d1, q1), (e2, v2, d2, q2) = results["cpp"], results["reference"]
    assert torch.equal(e1[0], e2[0]) and torch.equal(e1[1], e2[1])
    for a, b, what in ((v1, v2, "search values"), (d1, d2, "decode"), (v1, d1, "kept exponents"), (q1, q2, "ptq")):
        assert_bits_equal(a, b, what)
