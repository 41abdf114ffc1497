"""The CUDA op's block math (csrc/cuda/mx_block.cuh) built for the host with a C++ compiler and loaded
with ctypes (csrc/cuda/mx_host.cpp): the tests check it bit for bit against the reference without a GPU."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Tuple

import torch

from mfqat.formats import ElementFormat

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MODES = {"serial": 0, "warp": 1}


def compiler() -> Optional[str]:
    """A C++ compiler on PATH (g++ or c++), or None."""
    return shutil.which("g++") or shutil.which("c++")


def build(out_dir: Path) -> ctypes.CDLL:
    """Compile mx_host.cpp to a shared library in out_dir and load it (the IEEE flags of the extension)."""
    lib = out_dir / "libmx_host.so"
    cmd = [compiler(), "-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-pthread",
           "-Wall", "-Werror", str(CUDA_DIR / "mx_host.cpp"), "-o", str(lib)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        raise RuntimeError(f"host build of csrc/cuda/mx_host.cpp failed:\n{run.stderr[-3000:]}")
    so = ctypes.CDLL(str(lib))
    return so


def format_arrays(fmt: ElementFormat, rule: str) -> Tuple[ctypes.Array, ctypes.Array]:
    """The MXFormat fields as (int32[5], float32[5]), as the torch binding builds them from the op's scalars."""
    shift = fmt.int_shift if fmt.family == "mxint" else 0
    ints = (ctypes.c_int32 * 5)(int(fmt.family == "mxint"), fmt.emax, fmt.emin, fmt.mbits, int(rule == "ceil"))
    floats = (ctypes.c_float * 5)(2.0 ** shift, 2.0 ** -shift, fmt.code_min, fmt.code_max, float(fmt.max_normal))
    return ints, floats


def _buffers(x: torch.Tensor, bs: int):
    x = x.contiguous()
    assert x.shape[-1] % bs == 0
    out = torch.empty_like(x)
    mask = torch.zeros(x.shape, dtype=torch.bool)
    return x, out, mask, x.numel() // bs


def fake_quant(so: ctypes.CDLL, x: torch.Tensor, fmt: ElementFormat, bs: int, rule: str = "floor",
               mode: str = "serial") -> Tuple[torch.Tensor, torch.Tensor]:
    """(output in x's dtype, saturation mask) of the host-built CUDA block math."""
    x, out, mask, n = _buffers(x, bs)
    so.mfqat_host_fake_quant(ctypes.c_int32(DTYPE_CODES[x.dtype]), ctypes.c_int32(MODES[mode]),
                             ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                             ctypes.c_void_p(mask.data_ptr()), ctypes.c_int64(n), ctypes.c_int32(bs),
                             *format_arrays(fmt, rule))
    return out, mask


def through(so: ctypes.CDLL, x: torch.Tensor, anchor: ElementFormat, fmt: ElementFormat, bs: int,
            anchor_rule: str = "floor", rule: str = "floor", mode: str = "serial") -> Tuple[torch.Tensor, torch.Tensor]:
    """Train-through-anchor of the host-built CUDA block math -> (output, union of both stages' masks)."""
    x, out, mask, n = _buffers(x, bs)
    so.mfqat_host_through(ctypes.c_int32(DTYPE_CODES[x.dtype]), ctypes.c_int32(MODES[mode]),
                          ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                          ctypes.c_void_p(mask.data_ptr()), ctypes.c_int64(n), ctypes.c_int32(bs),
                          *format_arrays(anchor, anchor_rule), *format_arrays(fmt, rule))
    return out, mask


def convert(so: ctypes.CDLL, x: torch.Tensor, to: str) -> torch.Tensor:
    """The host build's dtype conversions over a whole tensor: to "float16" / "bfloat16" (from float32)
    or "float32" (from float16), as bit patterns in the target dtype."""
    x = x.contiguous()
    fn, dtype = {"float16": (so.mfqat_host_float_to_half_n, torch.float16),
                 "bfloat16": (so.mfqat_host_float_to_bf16_n, torch.bfloat16),
                 "float32": (so.mfqat_host_half_to_float_n, torch.float32)}[to]
    out = torch.empty(x.shape, dtype=dtype)
    fn(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(x.numel()))
    return out
