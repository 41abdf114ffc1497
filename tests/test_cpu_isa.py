"""The C++ ops' two builds of their block loops (AVX2 where the CPU has it, the SSE4.2 baseline
otherwise; csrc/mx_common.h) give the same bits. The other kernel tests prove the build this
machine picks equal to the oracle; this one pins the other build to it."""
import os

import pytest
import torch

import mfqat
from mfqat.quant.kernels import cpp

from .test_kernels import DTYPES, adversarial, assert_bits_equal
from .test_through_kernel import PAIRS, through_input

pytestmark = pytest.mark.skipif(not cpp.SEARCH_AVAILABLE, reason="C++ extension not built")

FORMATS = ["mxint8", "mxint6", "mxint4", "mxint2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp4_e2m1"]


def cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


def both_builds(monkeypatch, fn):
    """fn() under the build this CPU picks, then under the baseline build."""
    monkeypatch.delenv("MFQAT_CPU_ISA", raising=False)
    picked = torch.ops.mfqat.cpu_isa()
    first = fn()
    monkeypatch.setenv("MFQAT_CPU_ISA", "baseline")
    assert torch.ops.mfqat.cpu_isa() == "baseline"
    second = fn()
    monkeypatch.delenv("MFQAT_CPU_ISA")
    return picked, first, second


def test_avx2_is_picked_where_the_cpu_has_it(monkeypatch):
    monkeypatch.delenv("MFQAT_CPU_ISA", raising=False)
    if not cpu_has_avx2() or os.uname().machine != "x86_64":
        pytest.skip("no AVX2 here: only the baseline build runs")
    assert torch.ops.mfqat.cpu_isa() == "avx2"


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_fake_quant_and_quantize_same_bits_in_both_builds(monkeypatch, name, rule):
    f = mfqat.get_format(name)
    for dtype in DTYPES:
        x = adversarial(seed=3).to(dtype)
        for bs in (32, 8):
            what = f"{name} {dtype} bs={bs} {rule}"
            _, (a, am), (b, bm) = both_builds(monkeypatch, lambda: cpp.fake_quantize_cpp(x, f, bs, rule, True))
            assert_bits_equal(a, b, what)
            assert torch.equal(am, bm), what
            _, (ac, asc), (bc, bsc) = both_builds(monkeypatch, lambda: cpp.quantize_cpp(x, f, bs, rule))
            assert torch.equal(ac, bc) and torch.equal(asc, bsc), what


@pytest.mark.parametrize("anchor,fmt", PAIRS)
def test_through_same_bits_in_both_builds(monkeypatch, anchor, fmt):
    a, f = mfqat.get_format(anchor), mfqat.get_format(fmt)
    for dtype in DTYPES:
        x = through_input(seed=5).to(dtype)
        _, (o1, m1), (o2, m2) = both_builds(
            monkeypatch, lambda: cpp.fake_quantize_through_cpp(x, a, f, 32, "floor", "floor", True))
        assert_bits_equal(o1, o2, f"{anchor}->{fmt} {dtype}")
        assert torch.equal(m1, m2)


@pytest.mark.parametrize("name", ["mxint6", "mxint4", "mxint3", "mxfp6_e2m3", "mxfp4_e2m1"])
def test_search_and_decode_same_bits_in_both_builds(monkeypatch, name):
    f = mfqat.get_format(name)
    x = adversarial(seed=7)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    weights = torch.rand(x.shape[-1], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for w in (None, weights):
        _, (s1, n1), (s2, n2) = both_builds(monkeypatch, lambda: cpp.search_cpp(x, f, 32, w, (-1, 1)))
        assert torch.equal(s1, s2) and torch.equal(n1, n2), f"{name} search, weighted={w is not None}"
        _, d1, d2 = both_builds(monkeypatch, lambda: cpp.decode_exponents_cpp(x, f, 32, s1, n1))
        assert_bits_equal(d1, d2, f"{name} decode")
        anchor = mfqat.get_format("mxint8" if f.family == "mxint" else "mxfp8_e4m3")
        _, t1, t2 = both_builds(monkeypatch,
                                lambda: cpp.decode_exponents_through_cpp(x, anchor, "floor", f, 32, s1, n1))
        assert_bits_equal(t1, t2, f"{name} decode through the anchor")
        _, r1, r2 = both_builds(monkeypatch, lambda: cpp.search_through_cpp(x, anchor, "floor", f, 32, w, (-1, 1)))
        assert torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1]), f"{name} search through the anchor"
        assert_bits_equal(r1[2], r2[2], f"{name} search through the anchor, values")
