"""What `mfqat --version` says about the compute backends, found without importing torch, Triton or MLX
(``--version`` stays instant): the C++ CPU kernels (``mfqat._C``, built by setup.py), the CUDA op built
into the same library (or not), Triton, MLX."""
from __future__ import annotations

import os
from importlib import metadata, util
from typing import List, Optional

from mfqat._build import EXTENSION


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _spec_origin(name: str) -> Optional[str]:
    try:
        spec = util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None else (spec.origin or "")


# A string only the CUDA op's binding (csrc/cuda/mx_cuda_ops.cpp) puts into mfqat._C: found by reading
# the library's bytes, so --version needs no torch import to say whether the op was built.
CUDA_OP_MARK = b"mfqat CUDA op: expected a CUDA tensor"


def cuda_op_built(so: Optional[str]) -> bool:
    """Whether the extension library at ``so`` holds the CUDA op (setup.py builds it with a CUDA torch)."""
    if not so:
        return False
    try:
        with open(so, "rb") as f:
            return CUDA_OP_MARK in f.read()
    except OSError:
        return False


def backend_lines() -> List[str]:
    """One line per backend: present or not, and what runs instead."""
    so = _spec_origin(EXTENSION)
    cpp = (f"C++ CPU kernels: built ({so}); used on CPU tensors (MFQAT_BACKEND=reference turns them off)" if so else
           "C++ CPU kernels: NOT built (mfqat/_C*.so missing): CPU runs the pure-PyTorch reference, slower; "
           "rebuild with CPU torch installed: pip install --no-build-isolation . (or python setup.py build_ext "
           "--inplace in a checkout)")
    cuda = ("CUDA op: built into mfqat._C; MFQAT_BACKEND=cuda runs it on CUDA tensors" if cuda_op_built(so) else
            "CUDA op: not built (setup.py builds it when torch has CUDA and nvcc is found); CUDA tensors use Triton")
    tv = _version("triton") if _spec_origin("triton") is not None else None
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    triton = ("Triton: not installed (CUDA tensors use the C++ / reference path)" if tv is None else
              f"Triton {tv}: used on CUDA tensors" + ("; TRITON_INTERPRET=1: interpreting its kernels on CPU"
                                                      if interpret else ""))
    mv = _version("mlx") if _spec_origin("mlx") is not None else None
    lm = _version("mlx-lm")
    mlx = (f"MLX {mv}" + (f" + mlx-lm {lm}" if lm else " (mlx-lm missing: export-mlx cannot verify)")
           + ": export-mlx verifies exports; mlx-train / generate / serve run" if mv else
           "MLX: not installed (export-mlx --no-verify only; pip install 'mfqat[mlx]')")
    return [cpp, cuda, triton, mlx]


def version_text(version: str) -> str:
    """``mfqat VERSION`` and the backend lines."""
    return "\n".join([f"mfqat {version}"] + [f"  {line}" for line in backend_lines()])
