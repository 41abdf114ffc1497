"""Ahead-of-time compilation of the Triton kernels for NVIDIA targets, without a GPU.

The launch configurations are not written out here: :func:`launches` calls the public wrappers
(``fake_quantize_triton``, ``quantize_triton``, ``slice_triton``, ...) on small CPU tensors with the
kernels swapped for recorders, so each :class:`Launch` holds exactly the pointer types, scalar
arguments, compile-time constants and launch options the real launch passes (bfloat16 as int16 bits,
the unweighted search's int32 placeholder, ``_constexprs``' values ...). :func:`compile_launch` then
builds the kernel with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` and reads
registers and spills from the ptxas log of that build. Under ``TRITON_INTERPRET=1`` every
``@triton.jit`` function (the kernels and Triton's own ``tl.max``) is an interpreter object that
cannot be compiled, so one spawned worker process with the interpreter off compiles instead: the
interpreter never accepts for the compiler.

Used by tests/test_triton_aot.py (compiles, zero spills) and scripts/bench/bench_kernels_static.py (table).
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib
import io
import multiprocessing
import os
import re
import tempfile
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from mfqat.formats import FORMATS, MX_BLOCK_SIZES
from mfqat.quant.kernels.triton_mx import AVAILABLE

KERNEL_MODULES: Tuple[str, ...] = ("mfqat.quant.kernels.triton_mx", "mfqat.quant.kernels.triton_slice",
                                   "mfqat.quant.kernels.triton_search")
TARGETS: Tuple[int, ...] = (80, 90, 100)  # sm_80 (A100), sm_90 (H100/H200), sm_100 (B200)
DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
# One format per family for the default tier (the element format only changes constants, not code paths).
REPRESENTATIVE = {"mxint": "mxint4", "mxfp": "mxfp4_e2m1"}
ANCHOR = {"mxint": "mxint8", "mxfp": "mxfp8_e4m3"}  # train-through-anchor / slice sources
EXAMPLE_ROWS, EXAMPLE_COLS = 64, 256  # the tensor the wrappers are called with (bytes/element are per its size)
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                 torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                 torch.bool: "i1"}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a wrapper makes it.

    Attributes:
        module, kernel: where the ``@triton.jit`` kernel lives and its name.
        config: a readable label (format, input dtype, block size, variant).
        signature: runtime argument name -> Triton type (``*fp32``, ``*i16``, ``i32`` ...), in order.
        constexprs: compile-time constants as passed at launch.
        options: launch options passed (``num_warps`` ...); empty means Triton's defaults.
        bytes_per_element: minimal global-memory traffic per input element: every distinct tensor
            the launch touches, read or written once, over the example tensor's element count.
        aligned: pointers 16-byte aligned (what Triton specializes on: fresh torch allocations);
            False is the variant a view at an odd offset gets.
    """

    module: str
    kernel: str
    config: str
    signature: Dict[str, str]
    constexprs: Dict[str, Any]
    options: Dict[str, Any] = field(default_factory=dict)
    bytes_per_element: float = 0.0
    aligned: bool = True

    @property
    def id(self) -> str:
        """A short stable id, e.g. ``_fake_quant_kernel[mxint4-bf16-bs32-ceil-mask]``."""
        return f"{self.kernel}[{self.config.replace('>', '-to-').replace(' ', '-')}]"


@dataclass(frozen=True)
class Compiled:
    """Resource use of one kernel compiled for one target (from ptxas -v and Triton's metadata)."""

    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared: int
    num_warps: int
    seconds: float

    @property
    def spills(self) -> int:
        """Spilled bytes, stores plus loads (0 is the rule)."""
        return self.spill_stores + self.spill_loads


_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the call instead of running."""

    def __init__(self, module: str, name: str, arg_names: List[str], calls: List[Tuple]) -> None:
        self.module, self.name, self.arg_names, self.calls = module, name, arg_names, calls

    def __getitem__(self, grid) -> Callable:
        return lambda *args, **kwargs: self.calls.append((self, args, kwargs))


def kernel_names(module: ModuleType) -> List[str]:
    """Names of the module's launched kernels (``@triton.jit`` functions named ``*_kernel``)."""
    return [n for n, v in vars(module).items() if n.endswith("_kernel") and hasattr(v, "arg_names")]


@contextlib.contextmanager
def _recording(calls: List[Tuple]) -> Iterator[None]:
    mods = [importlib.import_module(m) for m in KERNEL_MODULES]
    saved = [(m, n, getattr(m, n)) for m in mods for n in kernel_names(m)]
    try:
        for m, n, k in saved:
            setattr(m, n, _Recorder(m.__name__, n, list(k.arg_names), calls))
        yield
    finally:
        for m, n, k in saved:
            setattr(m, n, k)


def record(config: str, wrapper: Callable, *args, **kwargs) -> Launch:
    """Call ``wrapper(*args, **kwargs)`` with the kernels swapped for recorders -> its one launch.
    The first tensor argument is the one whose elements ``bytes_per_element`` counts."""
    calls: List[Tuple] = []
    with _recording(calls):
        wrapper(*args, **kwargs)
    if len(calls) != 1:
        raise RuntimeError(f"{wrapper.__name__} launched {len(calls)} kernels; expected one")
    rec, pos, kw = calls[0]
    n_elements = next(a for a in args if isinstance(a, torch.Tensor)).numel()
    bound = dict(zip(rec.arg_names, pos), **kw)
    signature, constexprs, seen, moved = {}, {}, set(), 0
    for name in rec.arg_names:
        value = bound[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            key = (value.data_ptr(), value.numel(), value.element_size())
            if value.numel() and key not in seen:  # a tensor passed twice (a placeholder) moves once
                seen.add(key)
                moved += value.numel() * value.element_size()
        elif name in kw:
            constexprs[name] = value
        else:
            signature[name] = "i32" if isinstance(value, int) and abs(value) < 2 ** 31 else "fp32"
    options = {k: v for k, v in kw.items() if k in _LAUNCH_OPTIONS}
    constexprs = {k: v for k, v in constexprs.items() if k not in _LAUNCH_OPTIONS}
    return Launch(rec.module, rec.name, config, signature, constexprs, options, moved / n_elements)


def launches(full: bool = False) -> List[Launch]:
    """Every kernel's launches: per family (one representative format), input dtype (float32, bfloat16,
    float16) at block 32, the heaviest variant (ceil, saturation mask, weighted search). ``full`` adds
    every MX format, every block size and the lighter variants (floor, no mask, unweighted)."""
    from mfqat.quant.kernels import triton_mx, triton_search, triton_slice

    fams = ("mxint", "mxfp")
    out: List[Launch] = []

    def add(kind: str, fmt: str, dtype: torch.dtype, bs: int, rule: str = "ceil", mask: bool = True,
            weighted: bool = True) -> None:
        f = FORMATS[fmt]
        x = torch.zeros(EXAMPLE_ROWS, EXAMPLE_COLS, dtype=dtype)
        tag = f"{fmt} {_SHORT[dtype]} bs{bs}"
        if kind == "fake_quant":
            out.append(record(f"{tag} {rule}{' mask' if mask else ''}", triton_mx.fake_quantize_triton,
                              x, f, bs, rule, mask))
        elif kind == "through":
            a = FORMATS[ANCHOR[f.family]]
            out.append(record(f"{a.name}>{tag} {rule}{' mask' if mask else ''}",
                              triton_mx.fake_quantize_through_triton, x, a, f, bs, rule, rule, mask))
        elif kind == "quantize":
            out.append(record(f"{tag} {rule}", triton_mx.quantize_triton, x, f, bs, rule))
        elif kind == "slice":
            a = FORMATS[ANCHOR[f.family]]
            codes = torch.zeros(EXAMPLE_ROWS, EXAMPLE_COLS, dtype=torch.int8 if f.family == "mxint" else torch.uint8)
            scales = torch.zeros(EXAMPLE_ROWS, EXAMPLE_COLS // bs, dtype=torch.uint8)
            out.append(record(f"{a.name}>{fmt} bs{bs}", triton_slice.slice_triton, codes, scales, a, f, bs))
        elif kind == "search":
            w = torch.ones(EXAMPLE_COLS, dtype=torch.float64) if weighted else None
            out.append(record(f"{tag}{' weighted' if weighted else ''}", triton_search.search_triton, x, f, bs, w))
        elif kind == "decode":
            s = torch.zeros(EXAMPLE_ROWS, EXAMPLE_COLS // bs, dtype=torch.int32)
            out.append(record(tag, triton_search.decode_exponents_triton, x, f, bs, s, s.to(torch.bool)))

    kinds = ("fake_quant", "through", "quantize", "slice", "search", "decode")
    for kind in kinds:
        for fam in fams:
            for dtype in (DTYPES if kind != "slice" else DTYPES[:1]):
                add(kind, REPRESENTATIVE[fam], dtype, 32)
    if full:
        for kind in kinds:
            for fmt in (n for n, f in FORMATS.items() if f.is_mx and n not in REPRESENTATIVE.values()):
                if kind != "slice" or FORMATS[fmt].bits < FORMATS[ANCHOR[FORMATS[fmt].family]].bits:
                    add(kind, fmt, torch.float32, 32)
            for fam in fams:
                for bs in (b for b in MX_BLOCK_SIZES if b != 32):
                    add(kind, REPRESENTATIVE[fam], torch.float32, bs)
                if kind in ("fake_quant", "through"):
                    add(kind, REPRESENTATIVE[fam], torch.float32, 32, rule="floor", mask=False)
                elif kind == "quantize":
                    add(kind, REPRESENTATIVE[fam], torch.float32, 32, rule="floor")
                elif kind == "search":
                    add(kind, REPRESENTATIVE[fam], torch.float32, 32, weighted=False)
    return out


def unaligned(launch: Launch) -> Launch:
    """The same launch with pointers Triton cannot assume 16-byte aligned (a separate compilation)."""
    return dataclasses.replace(launch, aligned=False, config=launch.config + " unaligned")


def kernel_modules_in_package() -> List[str]:
    """Modules under mfqat/ whose source has a ``@triton.jit`` (must equal :data:`KERNEL_MODULES`)."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    return sorted(".".join(p.relative_to(root.parent).with_suffix("").parts) for p in root.rglob("*.py")
                  if re.search(r"^\s*@triton\.jit", p.read_text(), re.M))


class KernelCompileError(RuntimeError):
    """A kernel failed to compile for a target (Triton front end, LLVM or ptxas): the message
    carries the original error's type and text (it crosses a process boundary under the interpreter)."""


_POOL: Optional[ProcessPoolExecutor] = None


def _compile_worker() -> ProcessPoolExecutor:
    """One spawned process that imports Triton with the interpreter off (started once, kept)."""
    global _POOL
    if _POOL is None:
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "0"  # read when the worker imports triton
        try:
            _POOL = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
            _POOL.submit(int).result()  # the worker starts now, under this environment
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old
        atexit.register(_POOL.shutdown)
    return _POOL


_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def compile_launch(launch: Launch, arch: int) -> Compiled:
    """Compile ``launch`` for ``sm_<arch>`` (no GPU, no cache: ptxas always runs) -> its resource use;
    :class:`KernelCompileError` when it does not compile. Under ``TRITON_INTERPRET=1`` (where the
    kernels, and Triton's own ``tl.max``/``tl.sum``, are interpreter objects) a spawned worker
    with the interpreter off compiles."""
    from triton import knobs

    if knobs.runtime.interpret:
        return _compile_worker().submit(compile_launch, launch, arch).result()
    try:
        return _compile(launch, arch)
    except Exception as e:
        raise KernelCompileError(f"{launch.id} on sm_{arch}: {type(e).__name__}: {e}") from None


def _compile(launch: Launch, arch: int) -> Compiled:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.kernel)
    signature = {n: launch.signature.get(n, "constexpr") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, t in launch.signature.items() if t.startswith("*") and launch.aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs=dict(launch.constexprs), attrs=attrs)
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, knobs.cache.scope(), knobs.nvidia.scope(), \
            knobs.compilation.scope(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        knobs.cache.dir = cache
        knobs.nvidia.dump_ptxas_log = True  # printed by Triton's ptxas step
        knobs.compilation.always_compile = True
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
        seconds = time.perf_counter() - start
    text = log.getvalue()
    stack, regs = _STACK.search(text), _REGS.search(text)
    if stack is None or regs is None:
        raise RuntimeError(f"no ptxas resource report for {launch.id} on sm_{arch}:\n{text}")
    md = kernel.metadata
    return Compiled(arch, int(regs.group(1)), int(stack.group(2)), int(stack.group(3)), int(stack.group(1)),
                    int(md.shared), int(md.num_warps), seconds)


def available() -> Optional[str]:
    """None when AOT compilation can run here, else why not."""
    if not AVAILABLE:
        return "triton is not installed"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton import knobs  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas
        missing = [a for a in TARGETS if not os.access(get_ptxas(a).path or "", os.X_OK)]
    except Exception as e:  # pragma: no cover - an older or newer Triton, no NVIDIA backend
        return f"this Triton has no ASTSource/GPUTarget/knobs/NVIDIA backend ({type(e).__name__}: {e})"
    return f"no ptxas for sm_{missing[0]} (the triton wheel ships one)" if missing else None
