"""The CUDA C++ op (csrc/cuda/): MX fake-quantize and train-through-anchor, one warp per block.

Without a GPU (the usual case here) three things are checked:

* the kernels compile with nvcc to sm_80 / sm_90 / sm_100 cubins, with zero spills (ptxas -v), and the
  torch binding passes the compiler against torch's headers;
* the block math (csrc/cuda/mx_block.cuh, the same __host__ __device__ functions the kernels call) built
  for the host is bit-exact with the reference on adversarial and hypothesis inputs, run serially and
  as 32 emulated lanes with the kernel's layout and xor butterfly;
* setup.py adds the CUDA sources exactly when torch has CUDA and nvcc is found, and --version says so.

Where a GPU and the built op exist (scripts/gpu_check.sh), the real kernels run against the reference.
What the host build cannot show is the shuffle instruction and the device's arithmetic themselves.
"""
import ast
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import setuptools
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mfqat
from mfqat.quant import kernels
from mfqat.quant.kernels import cpp
from mfqat.quant.reference import fake_quantize_reference

from . import cuda_host
from .conftest import MX_FORMATS
from .test_kernels import DTYPES, adversarial, assert_bits_equal
from .test_through_kernel import PAIRS, RULES, through_input, two_pass

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
ARCHS = ("sm_80", "sm_90", "sm_100")


def _setup_nvcc_flags() -> list:
    """setup.py's NVCC_FLAGS (read from its source, so the tests compile with the flags the build uses)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NVCC_FLAGS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py defines no NVCC_FLAGS")


NVCC_FLAGS = _setup_nvcc_flags()
N_KERNELS = 12  # {fake_quant, through} x {float32, bfloat16, float16} x {bs 32, any bs}


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return str(Path(home, "bin", "nvcc")) if Path(home, "bin", "nvcc").exists() else None


NVCC = _nvcc()
NO_NVCC = "nvcc not found (no CUDA toolkit here): the CUDA kernels are compiled only where nvcc exists"


def _cuda_include():
    """The CUDA toolkit's include folder (cuda_runtime.h): $CUDA_HOME, next to nvcc, /usr/local/cuda."""
    homes = [os.environ.get("CUDA_HOME", ""), str(Path(NVCC).resolve().parents[1]) if NVCC else "", "/usr/local/cuda"]
    found = [Path(h, "include") for h in homes if h and Path(h, "include", "cuda_runtime.h").exists()]
    return found[0] if found else None


CUDA_INCLUDE = _cuda_include()
ON_GPU = cpp.CUDA_AVAILABLE and torch.cuda.is_available()
NO_GPU = "needs a GPU and the CUDA op built (scripts/gpu_check.sh)"


# ----------------------------------------------------------------------------- nvcc, no GPU


def ptxas_report(text: str) -> dict:
    """{kernel entry: (registers, spill stores + loads bytes, stack frame bytes)} from ptxas -v."""
    out, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and name:
            out[name] = [None, int(m.group(2)) + int(m.group(3)), int(m.group(1))]
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name][0] = int(m.group(1))
    return out


def nvcc_cubin(arch: str, out_dir: Path, source: Path = CUDA_DIR / "mx_kernels.cu") -> subprocess.CompletedProcess:
    return subprocess.run([NVCC, "-cubin", f"-arch={arch}", *NVCC_FLAGS, "-Xptxas", "-v", "--Werror", "all-warnings",
                           "-o", str(out_dir / f"mx_{arch}.cubin"), str(source)],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(NVCC is None, reason=NO_NVCC)
@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_compiles_every_kernel_for_the_target_without_spills(arch, tmp_path):
    """A compile error (or warning) fails; each of the 12 kernels must use no spill and no stack."""
    run = nvcc_cubin(arch, tmp_path)
    assert run.returncode == 0, f"nvcc -arch={arch} failed:\n{run.stderr[-4000:]}"
    report = ptxas_report(run.stdout + run.stderr)
    assert len(report) == N_KERNELS, sorted(report)
    bad = {k: v for k, v in report.items() if v[1] or v[2]}
    assert not bad, f"{arch}: spills or stack (registers, spill bytes, stack bytes): {bad}"
    assert all(0 < v[0] <= 128 for v in report.values()), report  # 8 warps a CTA: <= 128 keeps 2 CTAs an SM


@pytest.mark.skipif(NVCC is None, reason=NO_NVCC)
def test_device_code_has_no_fused_multiply_add_and_keeps_subnormals(tmp_path):
    """The PTX of setup.py's flags: no fma (PyTorch rounds a product and a sum separately), no .ftz
    (flush-to-zero would change every subnormal input and grid value), no approximate instruction."""
    out = tmp_path / "mx.ptx"
    run = subprocess.run([NVCC, "-ptx", "-arch=sm_90", *NVCC_FLAGS, "-o", str(out), str(CUDA_DIR / "mx_kernels.cu")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = out.read_text()
    bad = sorted(set(re.findall(r"\b(?:fma\.\S+|\w+(?:\.\w+)*\.ftz\S*|\w+\.approx\S*)", ptx)))
    assert not bad, f"fused, flushed or approximate instructions in the kernels: {bad[:10]}"
    assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx  # the float math is there


def _torch_include_args(tmp_path: Path) -> list:
    """-I flags for torch's headers; a CPU torch wheel lacks the generated c10/cuda/impl/cuda_cmake_macros.h,
    which a stub (the one #define a shared CUDA build writes) stands in for."""
    from torch.utils.cpp_extension import include_paths
    args = []
    if not any(Path(p, "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in include_paths()):
        stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        args.append(f"-I{tmp_path / 'stub'}")
    import sysconfig
    return args + [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]


@pytest.mark.skipif(CUDA_INCLUDE is None or not cuda_host.compiler(), reason=NO_NVCC)
def test_the_torch_binding_compiles_against_torch_and_cuda_headers(tmp_path):
    """mx_cuda_ops.cpp (checks, allocation, launch, TORCH_LIBRARY_IMPL) through the C++ compiler's front
    end: a type error in the binding fails here, not first on a GPU machine's install (~10 s)."""
    cmd = [cuda_host.compiler(), "-std=c++20", "-fsyntax-only", "-Wall", "-Werror", *_torch_include_args(tmp_path),
           f"-I{CUDA_INCLUDE}", str(CUDA_DIR / "mx_cuda_ops.cpp")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]


# ----------------------------------------------------------------------------- the block math on the host


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    if not cuda_host.compiler():
        pytest.skip("no C++ compiler: the CUDA block math cannot be built for the host")
    return cuda_host.build(tmp_path_factory.mktemp("cuda_host"))


def test_float16_and_bfloat16_conversions_are_torchs(host):
    """Every float16 to float32; float32 to float16 / bfloat16 at every float16 value, every tie between
    neighbours, one float32 ulp either side of each tie, the overflow edge, NaN/Inf and random bits."""
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    got = cuda_host.convert(host, halves, "float32")
    assert_bits_equal(got, halves.float(), "float16 -> float32")
    up = halves.float()
    fin = torch.isfinite(halves)
    nxt = (halves.view(torch.int16)[fin] + 1).view(torch.float16).float()  # neighbours away from zero
    ties = (up[fin] + nxt) / 2  # exact in float32
    tie_bits = ties.view(torch.int32)
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([65504.0, 65519.996, 65520.0, 2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -26,
                          float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 3.4e38, 1e-45])
    x = torch.cat([up, ties, (tie_bits + 1).view(torch.float32), (tie_bits - 1).view(torch.float32),
                   rand.view(torch.float32), edges, -edges])
    assert_bits_equal(cuda_host.convert(host, x, "float16"), x.to(torch.float16), "float32 -> float16")
    assert_bits_equal(cuda_host.convert(host, x, "bfloat16"), x.to(torch.bfloat16), "float32 -> bfloat16")


@pytest.mark.parametrize("name", MX_FORMATS)
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_host_fake_quant_bit_exact_adversarial(host, name, rule):
    """Ties, zeros, subnormals, saturation, NaN/Inf, huge/tiny exponents; every dtype, block 32, 8, 256."""
    fmt = mfqat.get_format(name)
    for dtype in DTYPES:
        x = adversarial().to(dtype)
        for bs in (32, 8, 256):
            out, mask = cuda_host.fake_quant(host, x, fmt, bs, rule)
            ref, ref_mask = fake_quantize_reference(x, fmt, bs, rule)
            what = f"host {name} {dtype} bs={bs} {rule}"
            assert_bits_equal(out, ref, what)
            assert torch.equal(mask, ref_mask), f"{what}: saturation mask"


@pytest.mark.parametrize("anchor,fmt", PAIRS)
@pytest.mark.parametrize("anchor_rule,rule", RULES)
def test_host_through_bit_exact_adversarial(host, anchor, fmt, anchor_rule, rule):
    a, f = mfqat.get_format(anchor), mfqat.get_format(fmt)
    for dtype in DTYPES:
        x = through_input().to(dtype)
        for bs in (32, 8, 256):
            out, mask = cuda_host.through(host, x, a, f, bs, anchor_rule, rule)
            ref, ref_mask, _, _ = two_pass(x, a, f, bs, anchor_rule, rule)
            what = f"host {anchor}->{fmt} {dtype} bs={bs} {anchor_rule}/{rule}"
            assert_bits_equal(out, ref, what)
            assert torch.equal(mask, ref_mask), f"{what}: saturation mask"


@pytest.mark.parametrize("bs", [32, 8, 256, 96])
def test_host_as_32_lanes_of_a_warp_is_bit_exact(host, bs):
    """The kernel's layout (lane l owns l, l + 32, ...; 1 element a lane at bs 32, up to 8 otherwise) with
    its xor butterfly, each lane a thread: fake-quant and through, every dtype, the special rows."""
    x = through_input()[:16, :{8: 96, 96: 192}.get(bs, 256)]  # the special blocks (NaN at column 5, Inf at 40, 70)
    for dtype in DTYPES:
        xx = x.to(dtype)
        for name, rule in (("mxint4", "ceil"), ("mxfp4_e2m1", "floor"), ("mxfp8_e4m3", "ceil")):
            fmt = mfqat.get_format(name)
            out, mask = cuda_host.fake_quant(host, xx, fmt, bs, rule, mode="warp")
            ref, ref_mask = fake_quantize_reference(xx, fmt, bs, rule)
            assert_bits_equal(out, ref, f"warp {name} {dtype} bs={bs}")
            assert torch.equal(mask, ref_mask)
        for anchor, name in (("mxint8", "mxint4"), ("mxfp8_e4m3", "mxfp4_e2m1")):
            a, f = mfqat.get_format(anchor), mfqat.get_format(name)
            out, mask = cuda_host.through(host, xx, a, f, bs, "floor", "ceil", mode="warp")
            ref, ref_mask, _, _ = two_pass(xx, a, f, bs, "floor", "ceil")
            assert_bits_equal(out, ref, f"warp {anchor}->{name} {dtype} bs={bs}")
            assert torch.equal(mask, ref_mask)


@settings(deadline=None, max_examples=150)
@given(name=st.sampled_from(MX_FORMATS), dtype=st.sampled_from(DTYPES), rule=st.sampled_from(["floor", "ceil"]),
       exponent=st.integers(-140, 120),
       values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=64, max_size=64))
def test_host_fake_quant_hypothesis(host, name, dtype, rule, exponent, values):
    fmt = mfqat.get_format(name)
    x = (torch.tensor(np.array(values, dtype=np.float32)) * torch.tensor(2.0 ** max(exponent, -126)))
    x = x.reshape(2, 32).to(dtype)
    out, mask = cuda_host.fake_quant(host, x, fmt, 32, rule)
    ref, ref_mask = fake_quantize_reference(x, fmt, 32, rule)
    assert_bits_equal(out, ref, f"host {name} {dtype} {rule}")
    assert torch.equal(mask, ref_mask)


@settings(deadline=None, max_examples=150)
@given(pair=st.sampled_from(PAIRS), dtype=st.sampled_from(DTYPES), rules=st.sampled_from(RULES),
       exponent=st.integers(-140, 120),
       values=st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=64, max_size=64))
def test_host_through_hypothesis(host, pair, dtype, rules, exponent, values):
    a, f = (mfqat.get_format(n) for n in pair)
    x = (torch.tensor(np.array(values, dtype=np.float32)) * torch.tensor(2.0 ** max(exponent, -126)))
    x = x.reshape(2, 32).to(dtype)
    out, mask = cuda_host.through(host, x, a, f, 32, *rules)
    ref, ref_mask, _, _ = two_pass(x, a, f, 32, *rules)
    assert_bits_equal(out, ref, f"host {pair} {dtype} {rules}")
    assert torch.equal(mask, ref_mask)


# ----------------------------------------------------------------------------- build, version, dispatch


def _run_setup(monkeypatch, torch_cuda, cuda_home):
    """setup.py's ext_modules with torch.version.cuda / CUDA_HOME as given (setuptools.setup not run)."""
    from torch.utils import cpp_extension
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("MFQAT_NO_EXT", raising=False)
    monkeypatch.delenv("MFQAT_NO_CUDA", raising=False)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", cuda_home)
    monkeypatch.setattr(setuptools, "setup", lambda **kw: None)
    return runpy.run_path(str(ROOT / "setup.py"))


def test_setup_builds_the_cuda_op_only_with_a_cuda_torch_and_nvcc(monkeypatch, tmp_path, capfd):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    g = _run_setup(monkeypatch, "12.8", str(tmp_path))
    (ext,) = g["ext_modules"]
    assert {"csrc/cuda/mx_kernels.cu", "csrc/cuda/mx_cuda_ops.cpp"} <= set(ext.sources), ext.sources
    assert ext.extra_compile_args["nvcc"] == NVCC_FLAGS == g["NVCC_FLAGS"]  # what the nvcc test compiles with
    assert set(ext.mfqat_cpu_sources) == {s for s in ext.sources if "cuda" not in s}  # a failed CUDA build's fallback
    assert "and the CUDA op (torch CUDA 12.8" in capfd.readouterr().err
    for torch_cuda, home, why in ((None, str(tmp_path), "has no CUDA"), ("12.8", None, "nvcc was not found")):
        (ext,) = _run_setup(monkeypatch, torch_cuda, home)["ext_modules"]
        assert not [s for s in ext.sources if "cuda" in s] and isinstance(ext.extra_compile_args, list)
        assert "CPU kernels only; CUDA op not built: " in (err := capfd.readouterr().err) and why in err


def test_a_failed_cuda_build_falls_back_to_the_cpu_kernels(monkeypatch, tmp_path, capsys):
    """setup.py's build_ext: when compiling the CUDA op fails, the same extension is built again from
    the CPU sources with the C++ flags, so the C++ CPU kernels still ship."""
    from torch.utils import cpp_extension
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    g = _run_setup(monkeypatch, "12.8", str(tmp_path))
    (ext,) = g["ext_modules"]
    tried = []

    def build(self, e):
        tried.append((list(e.sources), e.extra_compile_args))
        if any(src.endswith(".cu") for src in e.sources):
            raise RuntimeError("nvcc fatal: planted")

    monkeypatch.setattr(cpp_extension.BuildExtension, "build_extension", build)
    cls = g["cmdclass"]["build_ext"]
    cls.build_extension(cls.__new__(cls), ext)
    assert len(tried) == 2 and any(s.endswith(".cu") for s in tried[0][0])
    assert tried[1] == (sorted(ext.sources), g["CXX_FLAGS"]) and not any("cuda" in s for s in tried[1][0])
    assert "mfqat CUDA op not built (nvcc fatal: planted); building the C++ CPU kernels alone" in capsys.readouterr().out


def test_version_says_whether_the_cuda_op_is_built(monkeypatch, tmp_path):
    from mfqat.cli import backends
    fake = tmp_path / "_C.so"
    fake.write_bytes(b"\0ELF..." + backends.CUDA_OP_MARK + b"...")
    monkeypatch.setattr(backends, "_spec_origin", lambda name: str(fake) if name == "mfqat._C" else None)
    assert "CUDA op: built" in backends.version_text("0")
    fake.write_bytes(b"\0ELF a CPU-only build")
    assert "CUDA op: not built" in backends.version_text("0")


def test_the_binding_carries_the_mark_version_looks_for():
    from mfqat.cli import backends
    assert backends.CUDA_OP_MARK.decode() in (CUDA_DIR / "mx_cuda_ops.cpp").read_text()


def test_forced_cuda_backend_runs_the_op_and_says_why_it_cannot(monkeypatch):
    """MFQAT_BACKEND=cuda: the fake-quant and through dispatch call the torch op (whose CUDA kernel is
    this op); on a CPU tensor, or without the op built, one clear error."""
    calls = []
    monkeypatch.setattr(cpp, "fake_quantize_cpp", lambda *a, **k: calls.append("fq") or (a[0], None))
    monkeypatch.setattr(cpp, "fake_quantize_through_cpp", lambda *a, **k: calls.append("through") or (a[0], None))
    monkeypatch.setattr(kernels, "select_backend", lambda x, fmt: "cuda")
    x, f = torch.randn(2, 64), mfqat.get_format("mxint4")
    kernels.fake_quantize_dispatch(x, f, 32)
    kernels.fake_quantize_through_dispatch(x, mfqat.get_format("mxint8"), f, 32)
    assert calls == ["fq", "through"]
    monkeypatch.undo()
    monkeypatch.setenv("MFQAT_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match="MFQAT_BACKEND=cuda cannot run on cpu: the CUDA op takes CUDA tensors"):
        kernels.fake_quantize_dispatch(x, f, 32)
    monkeypatch.setattr(cpp, "CUDA_AVAILABLE", False)
    assert "cuda" not in kernels.available_backends("cuda")
    assert "not built" in kernels._why_unavailable("cuda", torch.device("cuda"))


# ----------------------------------------------------------------------------- on a GPU


@pytest.mark.skipif(not ON_GPU, reason=NO_GPU)
@pytest.mark.parametrize("name", MX_FORMATS)
@pytest.mark.parametrize("rule", ["floor", "ceil"])
def test_cuda_op_fake_quant_bit_exact_on_gpu(name, rule):
    fmt = mfqat.get_format(name)
    for dtype in DTYPES:
        x = adversarial().to(dtype)
        for bs in (32, 8, 256):
            out, mask = cpp.fake_quantize_cpp(x.cuda(), fmt, bs, rule, True)
            ref, ref_mask = fake_quantize_reference(x, fmt, bs, rule)
            assert_bits_equal(out, ref, f"cuda {name} {dtype} bs={bs} {rule}")
            assert torch.equal(mask.cpu(), ref_mask)


@pytest.mark.skipif(not ON_GPU, reason=NO_GPU)
@pytest.mark.parametrize("anchor,fmt", PAIRS)
@pytest.mark.parametrize("anchor_rule,rule", RULES)
def test_cuda_op_through_bit_exact_on_gpu(anchor, fmt, anchor_rule, rule):
    a, f = mfqat.get_format(anchor), mfqat.get_format(fmt)
    for dtype in DTYPES:
        x = through_input().to(dtype)
        for bs in (32, 8, 256):
            out, mask = cpp.fake_quantize_through_cpp(x.cuda(), a, f, bs, anchor_rule, rule, True)
            ref, ref_mask, _, _ = two_pass(x, a, f, bs, anchor_rule, rule)
            assert_bits_equal(out, ref, f"cuda {anchor}->{fmt} {dtype} bs={bs}")
            assert torch.equal(mask.cpu(), ref_mask)


@pytest.mark.skipif(not ON_GPU, reason=NO_GPU)
def test_cuda_op_layouts_large_tensors_and_opcheck_on_gpu():
    """Non-contiguous input, more blocks than one grid launches (2^23: the grid-stride loop, checked against
    the CPU op), the dispatch under MFQAT_BACKEND=cuda, and torch.library.opcheck on CUDA tensors."""
    fmt, anchor = mfqat.get_format("mxfp4_e2m1"), mfqat.get_format("mxfp8_e4m3")
    base = torch.randn(6, 64, 96, device="cuda")
    for xx in (base.transpose(0, 1)[..., :64], base[:, ::3, :]):
        out, _ = cpp.fake_quantize_cpp(xx, fmt, 32, "floor", False)
        assert_bits_equal(out, fake_quantize_reference(xx.cpu(), fmt, 32, "floor")[0], f"layout {tuple(xx.shape)}")
    big = torch.randn(2 ** 13 + 8, 2 ** 15, device="cuda", dtype=torch.bfloat16)  # 2^23 + 2^13 blocks of 32
    out, mask = cpp.fake_quantize_through_cpp(big, anchor, fmt, 32, "floor", "floor", True)
    want, want_mask = cpp.fake_quantize_through_cpp(big.cpu(), anchor, fmt, 32, "floor", "floor", True)
    assert_bits_equal(out, want, "2^23 + 2^13 blocks")
    assert torch.equal(mask.cpu(), want_mask)
    del big, out, mask
    os.environ["MFQAT_BACKEND"] = "cuda"
    try:
        out, _ = kernels.fake_quantize_through_dispatch(base, anchor, fmt, 32)
    finally:
        del os.environ["MFQAT_BACKEND"]
    assert_bits_equal(out, two_pass(base.cpu(), anchor, fmt, 32, "floor", "floor")[0], "dispatch")
    args = (32, *cpp._format_args(anchor, "floor"), *cpp._format_args(fmt, "ceil"), True)
    checks = ("test_schema", "test_faketensor")  # as the CPU op's opcheck (tests/test_through_kernel.py)
    torch.library.opcheck(torch.ops.mfqat.fake_quant_mx_through.default, (torch.randn(8, 64, device="cuda"), *args),
                          test_utils=checks)
    torch.library.opcheck(torch.ops.mfqat.fake_quant_mx.default,
                          (torch.randn(8, 64, device="cuda", dtype=torch.bfloat16), 32, *cpp._format_args(fmt, "floor"),
                           True), test_utils=checks)
