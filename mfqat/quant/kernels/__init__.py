"""Backend dispatch for MX fake quantization and quantization.

Paths, all bit-exact with :mod:`mfqat.quant.reference` (tests/test_kernels.py):

* ``triton`` - fused Triton kernels (CUDA tensors; on CPU only under ``TRITON_INTERPRET=1``,
  which the tests use and ``auto`` never picks);
* ``cpp`` - the C++ CPU op from ``csrc/`` (``torch.ops.mfqat.*``), when the extension was built
  (it also has the MX scale search, :func:`search_dispatch`, as has Triton: ``triton_search``);
* ``cuda`` - the CUDA C++ op from ``csrc/cuda/`` (the same ``torch.ops.mfqat`` fake-quant and
  train-through-anchor ops, CUDA tensors), when the extension was built against a CUDA torch; the
  other MX operations (quantize to codes, slice, scale search) fall back to the reference under it;
* ``reference`` - pure PyTorch, every device, every format.

``auto`` (the default) picks per device: CUDA -> triton (the CUDA op where Triton is missing), CPU ->
cpp, else reference. The environment variable ``MFQAT_BACKEND=reference|triton|cpp|cuda`` forces one (an error says so when the
forced backend cannot run on the tensor's device). Affine quantization to codes (MLX's rule: the
exporter's derived formats) has a C++ op too (:func:`affine_quantize_dispatch`: CPU tensors without
NaN or Inf, under ``auto`` or ``cpp``), as has MX dequantization (:func:`mx_dequantize_dispatch`); affine fake quantization, NF4 and nvfp4 always use the
reference (nvfp4's: mfqat.quant.nvfp4; there is no nvfp4 kernel, ``MFQAT_BACKEND`` does not change that).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from mfqat.formats import ElementFormat
from mfqat.quant.nvfp4 import nvfp4_fake_quantize_blocks
from mfqat.quant.reference import (affine_quantize_blocks, fake_quantize_reference, mx_dequantize_blocks,
                                   quantize_reference, to_blocks)
from mfqat.quant.kernels import cpp, triton_mx, triton_search, triton_slice

BACKENDS = ("reference", "cpp", "triton", "cuda")


def requested_backend() -> str:
    """The backend forced by ``MFQAT_BACKEND``, or "auto"."""
    name = os.environ.get("MFQAT_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS + ("auto",):
        raise ValueError(f"MFQAT_BACKEND='{name}' is unknown; choose one of {BACKENDS} or auto")
    return name


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run MX formats on ``device`` (the interpreted Triton path included)."""
    device = torch.device(device)
    found = []
    if device.type == "cpu" and cpp.AVAILABLE:
        found.append("cpp")
    if triton_mx.usable_on(device):
        found.append("triton")
    if device.type == "cuda" and cpp.CUDA_AVAILABLE:
        found.append("cuda")
    return found + ["reference"]


def auto_backend(device: torch.device | str) -> str:
    """The fastest backend for ``device``: triton on CUDA (the CUDA op without Triton), cpp on CPU, else
    reference. Not measured against each other on a GPU yet: scripts/gpu_check.sh times both."""
    device = torch.device(device)
    if device.type == "cuda" and triton_mx.usable_on(device):
        return "triton"
    if device.type == "cuda" and cpp.CUDA_AVAILABLE:
        return "cuda"
    if device.type == "cpu" and cpp.AVAILABLE:
        return "cpp"
    return "reference"


def select_backend(x: torch.Tensor, fmt: ElementFormat) -> str:
    """The backend that will handle ``x`` in ``fmt`` (honours ``MFQAT_BACKEND``)."""
    if not fmt.is_mx:
        return "reference"
    name = requested_backend()
    if name == "auto":
        return auto_backend(x.device)
    if name not in available_backends(x.device):
        raise RuntimeError(f"MFQAT_BACKEND={name} cannot run on {x.device}: {_why_unavailable(name, x.device)}")
    return name


def _why_unavailable(name: str, device: torch.device) -> str:
    """Why the forced backend ``name`` cannot take tensors on ``device`` (device first, then the build)."""
    if name == "cpp" and device.type != "cpu":
        return (f"the C++ backend takes CPU tensors only; {device.type} tensors are not supported by it "
                "(unset MFQAT_BACKEND or set it to reference)")
    if name == "cpp":
        return f"the C++ extension is not built ({cpp.LOAD_ERROR}); reinstall with a C++ compiler"
    if name == "cuda" and device.type != "cuda":
        return (f"the CUDA op takes CUDA tensors only; {device.type} tensors are not supported by it "
                "(unset MFQAT_BACKEND or set it to reference)")
    if name == "cuda":
        return ("the CUDA op is not built (it needs torch with CUDA and nvcc when the extension is built: "
                "pip install --no-build-isolation . on such a machine)")
    if name == "triton" and triton_mx.AVAILABLE:
        return (f"the Triton backend takes CUDA tensors (CPU ones only under TRITON_INTERPRET=1); "
                f"{device.type} tensors are not supported by it (unset MFQAT_BACKEND or set it to reference)")
    return "the triton package is not installed"


def fake_quantize_dispatch(x: torch.Tensor, fmt: ElementFormat, block_size: int, scale_rule: str = "floor",
                           need_mask: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Quantize-dequantize with the selected backend -> (output in x's dtype, saturated mask or None)."""
    if fmt.family == "nvfp4":
        out, mask = nvfp4_fake_quantize_blocks(to_blocks(x, block_size))
        return out.reshape(x.shape).to(x.dtype), (mask.reshape(x.shape) if need_mask else None)
    backend = select_backend(x, fmt)
    if backend in ("cpp", "cuda"):  # one torch op, CPU and CUDA kernels
        return cpp.fake_quantize_cpp(x, fmt, block_size, scale_rule, need_mask)
    if backend == "triton":
        return triton_mx.fake_quantize_triton(x, fmt, block_size, scale_rule, need_mask)
    out, mask = fake_quantize_reference(x, fmt, block_size, scale_rule)
    return out, (mask if need_mask else None)


def fake_quantize_through_dispatch(x: torch.Tensor, anchor: ElementFormat, fmt: ElementFormat, block_size: int,
                                   anchor_rule: str = "floor", scale_rule: str = "floor", need_mask: bool = False
                                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Train-through-anchor: qdq in ``fmt`` of (qdq in ``anchor`` of x, in x's dtype) -> (output, union
    of both stages' saturation masks or None). One fused pass on the cpp / triton backends; two
    passes otherwise (the reference, a format that is not MX, or a C++ build without the op)."""
    backend = select_backend(x, fmt) if anchor.is_mx else "reference"
    if backend == "cuda" or (backend == "cpp" and cpp.THROUGH_AVAILABLE):
        return cpp.fake_quantize_through_cpp(x, anchor, fmt, block_size, anchor_rule, scale_rule, need_mask)
    if backend == "triton":
        return triton_mx.fake_quantize_through_triton(x, anchor, fmt, block_size, anchor_rule, scale_rule, need_mask)
    mid, m1 = fake_quantize_dispatch(x, anchor, block_size, anchor_rule, need_mask)
    out, m2 = fake_quantize_dispatch(mid, fmt, block_size, scale_rule, need_mask)
    return out, (m1 | m2 if need_mask else None)


def mx_quantize_dispatch(x: torch.Tensor, fmt: ElementFormat, block_size: int, scale_rule: str = "floor"
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """MX codes (x's shape; int8 MXINT, uint8 MXFP bit patterns) and E8M0 bytes (..., K // block_size)."""
    backend = select_backend(x, fmt)
    if backend == "cpp":
        return cpp.quantize_cpp(x, fmt, block_size, scale_rule)
    if backend == "triton":
        return triton_mx.quantize_triton(x, fmt, block_size, scale_rule)
    return quantize_reference(x, fmt, block_size, scale_rule)  # also under the CUDA op (no codes kernel)


def affine_quantize_dispatch(x: torch.Tensor, fmt: ElementFormat, block_size: int
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLX's affine quantization of ``x`` in blocks along its last axis -> (uint8 codes of x's shape, scales
    and biases (..., K // block_size) as float32 holding x's dtype's values), as
    :func:`mfqat.quant.reference.affine_quantize_blocks`. The C++ op on CPU tensors whose values are all
    finite (under ``MFQAT_BACKEND`` auto or cpp, when the build has it); the reference otherwise."""
    if requested_backend() in ("auto", "cpp") and x.device.type == "cpu" and cpp.AFFINE_AVAILABLE:
        codes, scales, biases, finite = cpp.quantize_affine_cpp(x, fmt, block_size)
        if finite:
            return codes, scales.to(x.dtype).float(), biases.to(x.dtype).float()
    codes, scales, biases = affine_quantize_blocks(to_blocks(x, block_size), fmt, x.dtype)
    return codes.reshape(x.shape), scales, biases


def mx_dequantize_dispatch(codes: torch.Tensor, scales: torch.Tensor, fmt: ElementFormat, block_size: int
                           ) -> torch.Tensor:
    """MX codes (any leading shape, last axis in blocks) and their E8M0 bytes -> float32 values of the codes'
    shape, as :func:`mfqat.quant.reference.mx_dequantize_blocks`: the C++ op on CPU (``MFQAT_BACKEND`` auto
    or cpp, when the build has it), the reference otherwise."""
    if (requested_backend() in ("auto", "cpp") and codes.device.type == "cpu" and cpp.DEQUANT_AVAILABLE
            and codes.numel() == scales.numel() * block_size):
        return cpp.dequantize_mx_cpp(codes, scales, fmt, block_size)
    blocks = codes.reshape(*codes.shape[:-1], codes.shape[-1] // block_size, block_size)
    return mx_dequantize_blocks(blocks, scales, fmt).reshape(codes.shape)


def slice_dispatch(codes: torch.Tensor, scales: torch.Tensor, src: ElementFormat, dst: ElementFormat,
                   block_size: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Slice-and-Scale codes with a fast backend; None when only the reference applies (the caller's path)."""
    name = requested_backend()
    device = codes.device
    if name in ("reference", "cuda"):  # the CUDA op has no slice kernel: the caller's reference path
        return None
    if name == "auto":
        name = auto_backend(device)
        if name == "cpp" and dst.family == "mxint":
            return None  # measured (scripts/bench/bench_slice.py): torch's integer shift is faster here
    if name == "cpp" and cpp.AVAILABLE and device.type == "cpu":
        return cpp.slice_cpp(codes, scales, src, dst, block_size)
    if name == "triton" and triton_mx.usable_on(device):
        return triton_slice.slice_triton(codes, scales, src, dst, block_size)
    if requested_backend() != "auto":
        raise RuntimeError(f"MFQAT_BACKEND={name} cannot slice tensors on {device}")
    return None


def search_dispatch(x: torch.Tensor, fmt: ElementFormat, block_size: int, weights: Optional[torch.Tensor],
                    offsets: Tuple[int, ...]) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The MX scale search (exponent per block, non-finite mask) with the C++ op (CPU) or the Triton
    kernel (CUDA), MXINT and MXFP; None when only the reference applies (``MFQAT_BACKEND=reference``,
    a block size or candidate set the kernel lacks, an older build)."""
    backend = _search_backend(x, fmt, block_size, offsets)
    if backend == "cpp":
        return cpp.search_cpp(x, fmt, block_size, weights, offsets)
    if backend == "triton":
        return triton_search.search_triton(x, fmt, block_size, weights)
    return None


def decode_exponents_dispatch(x: torch.Tensor, fmt: ElementFormat, block_size: int,
                              exponents: Tuple[torch.Tensor, torch.Tensor]) -> Optional[torch.Tensor]:
    """MX quantize-dequantize with given exponents by a kernel, or None (as :func:`search_dispatch`)."""
    backend = _search_backend(x, fmt, block_size, (-1, 1))
    if backend == "cpp":
        return cpp.decode_exponents_cpp(x, fmt, block_size, *exponents)
    if backend == "triton":
        return triton_search.decode_exponents_triton(x, fmt, block_size, *exponents)
    return None


def decode_exponents_through_dispatch(x: torch.Tensor, anchor: ElementFormat, anchor_rule: str, fmt: ElementFormat,
                                      block_size: int, exponents: Tuple[torch.Tensor, torch.Tensor]
                                      ) -> Optional[torch.Tensor]:
    """:func:`decode_exponents_dispatch` of ``x`` quantize-dequantized in ``anchor`` first, fused in one
    pass by the C++ op; None where no fused kernel applies (the caller composes the two steps)."""
    if _fused_through_applies(x, anchor, fmt, block_size, (-1, 1)):
        return cpp.decode_exponents_through_cpp(x, anchor, anchor_rule, fmt, block_size, *exponents)
    return None


def search_through_dispatch(x: torch.Tensor, anchor: ElementFormat, anchor_rule: str, fmt: ElementFormat,
                            block_size: int, weights: Optional[torch.Tensor], offsets: Tuple[int, ...]
                            ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """:func:`search_dispatch` of ``x`` quantize-dequantized in ``anchor`` plus the decoded values, fused in
    one pass by the C++ op; None where no fused kernel applies."""
    if _fused_through_applies(x, anchor, fmt, block_size, offsets):
        return cpp.search_through_cpp(x, anchor, anchor_rule, fmt, block_size, weights, offsets)
    return None


def _fused_through_applies(x: torch.Tensor, anchor: ElementFormat, fmt: ElementFormat, block_size: int,
                           offsets: Tuple[int, ...]) -> bool:
    """Whether the C++ train-through-anchor search ops serve this call (CPU, MX anchor and target)."""
    return anchor.is_mx and cpp.SEARCH_THROUGH_AVAILABLE and _search_backend(x, fmt, block_size, offsets) == "cpp"


def _search_backend(x: torch.Tensor, fmt: ElementFormat, block_size: int, offsets: Tuple[int, ...]) -> Optional[str]:
    """cpp for CPU tensors, triton for CUDA ones (or CPU ones under the interpreter when forced), else None."""
    name = requested_backend()
    if not fmt.is_mx or name == "reference" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if name in ("auto", "cpp") and x.device.type == "cpu" and cpp.SEARCH_AVAILABLE:
        return "cpp"
    on_device = x.device.type == "cuda" or name == "triton"
    if name in ("auto", "triton") and on_device and triton_mx.usable_on(x.device) \
            and triton_search.applies(block_size, offsets):
        return "triton"
    return None
