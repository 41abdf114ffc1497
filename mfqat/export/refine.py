"""``export-mlx --refine``: learned group scales and biases for the affine tensors of an export, learned
block scales for its nvfp4 tensors, learned block exponents for its MX tensors.

The lever of mlx-lm's DWQ (distilled weight quantization), run in PyTorch on the export's own
plan: every affine tensor keeps its codes ``q`` and learns its bfloat16 scale ``s`` and bias ``b``
per group, every nvfp4 tensor keeps its E2M1 codes and learns its E4M3 scale per block of 16, so
that the exported model's next-token distribution matches the anchor's own (the teacher: the anchor
in its format, MXINT8/MXFP8, what MF-QAT trained) on calibration text. The result is still MLX's
plain affine / nvfp4 / MX layout (same size, stock ``mlx_lm.load``), and the export check still compares
it bit for bit with PyTorch's dequantization. An MX tensor lowered from the anchor (MXINT / MXFP, E8M0
exponents) learns which exponent each block takes among its derived one and the two neighbours, its codes
encoded again from the anchor's values at the chosen exponent.
"""
from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from mfqat.anchor.checkpoint import Anchor
from mfqat.anchor.learned_scales import pick
from mfqat.export import lean_matrices
from mfqat.export.code_spill import CodeSpill, SpilledCodes
from mfqat.export.lazy_model import LazyModel, anchor_source
from mfqat.export.lean_matrices import LeanMatrices
from mfqat.export.mlx_sizes import anchor_parameters
from mfqat.export.recipes import LearnedExponents, LearnedScales, Plan
from mfqat.export.verify import reference_tensor
from mfqat.formats import get_format
from mfqat.progress import announce, progress
from mfqat.quant.derive import DERIVED_GROUP_SIZE
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.nvfp4 import LUT as E2M1_VALUES
from mfqat.quant.nvfp4 import NVFP4_RANGE, e4m3_decode, e4m3_encode
from mfqat.quant.reference import E8M0_BIAS, E8M0_NAN, dtype_max_exponent, exp2i
from mfqat.quant.scale_search import dequantize_with_exponents

E4M3_MIN, E4M3_MAX = 2.0 ** -9, 448.0  # the smallest positive (subnormal) and the largest E4M3 value


@dataclass
class RefineConfig:
    """Distil the affine scales and biases and the nvfp4 block scales of an export against its anchor (codes fixed).

    For every affine tensor of the plan, with codes ``q`` and the derived scale ``s0`` and bias
    ``b0`` of each group, two parameters per group ``a``, ``c`` (both 0 at the start) give::

        s = bf16(s0 * (1 + a))      b = bf16(b0 + s0 * c)      W = q * s + b

    (bfloat16 rounding straight-through), so one learning rate suits every tensor whatever its
    magnitude. For every nvfp4 tensor, with E2M1 codes ``P``, the derived E4M3 scale ``s0`` of each
    block of 16 and the tensor's optional global scale ``g`` (kept), one parameter per block ``a``::

        s = e4m3(clamp(s0 * (1 + a), 2^-9, 448))      W = e2m1(P) * (s * fl32(g / 2688))

    (E4M3 rounding straight-through; a block whose ``s0`` is 0 or NaN keeps it: no learned scale
    rounds to zero or overflows). For every MX tensor lowered from the anchor (a lower format of its family),
    with the anchor's values ``x`` and the derived exponent ``e0`` of each block of 32, one parameter per block ``u``::

        e = e0 + clamp(round(u), -1, 1)      W = 2^e * mx_round(x / 2^e)     (codes encoded again at e)

    whose gradient is LSQ's estimate through the rounding, ``dW/du = ln2 * (W - x)`` for an element in range and
    ``ln2 * W`` for one that saturates (a non-finite block keeps its exponent); ``u`` learns at ``exponent_lr``,
    so that a block moves to a neighbouring exponent after about ``0.5 / exponent_lr`` steps of one sign.
    ``a``, ``c`` and ``u`` minimise, with Adam, on ``n_blocks`` blocks of ``seq_len``
    calibration tokens (``batch`` blocks a step)::

        T^2 * KL( softmax(z_anchor / T) || softmax(z_export / T) )     per token, averaged

    ``n_valid`` further blocks measure the same KL before and after; the learned values are kept
    only when they lower it (else the export keeps the derived ones and says so).

    ``steps`` None: chosen by the model's parameter count (:func:`default_steps`, :data:`STEPS_BY_SIZE`).
    ``optional`` (``export-mlx``'s default, ``refine="auto"``): learns affine and nvfp4 tensors only
    (:data:`DEFAULT_FAMILIES`); a plan with none to learn - an MX recipe, or widths whose learned scales the anchor
    already stores (``mfqat refine``) - is exported without refining instead of refused.
    ``spill_dir``: a folder on disk where the tensors' codes wait between uses (mfqat.export.code_spill; the
    exporter and ``mfqat refine`` pass a staging folder beside their output); None keeps them in memory.
    """

    steps: Optional[int] = None
    lr: float = 1e-3
    exponent_lr: float = 5e-2
    batch: int = 4
    seq_len: int = 128
    n_blocks: int = 32
    n_valid: int = 4
    temperature: float = 1.0
    seed: int = 0
    optional: bool = False
    spill_dir: Optional[Path] = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len", "n_blocks", "n_valid"):
            if getattr(self, name) is None and name == "steps":
                continue
            if int(getattr(self, name)) < 1:
                raise ValueError(f"refine: {name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.exponent_lr > 0 or not self.temperature > 0:
            raise ValueError(f"refine: lr, exponent_lr and temperature must be positive, got {self.lr}, "
                             f"{self.exponent_lr}, {self.temperature}")


# Default refine steps by model size (parameters up to, steps): a step's compute grows with the model, so a
# bigger model takes fewer steps. 64 steps of SmolLM2-135M take ~6 minutes on 2 CPU cores and lower its
# held-out perplexity by a quarter at 4.5 bits (BENCHMARKS.md); 8 steps (DWQ's token count at 4 x 128 tokens)
# still keep most of that gain.
STEPS_BY_SIZE = ((300_000_000, 64), (1_000_000_000, 32), (4_000_000_000, 16), (float("inf"), 8))
# Multiply-adds of one refine step per parameter and token: teacher forward, student forward, the decoder
# layers' forward again in backward (recomputed) and the backward's two products.
_PASSES_PER_STEP = 5
_EFFICIENCY = 0.5  # the refine's share of a plain float32 matmul's speed (measured: SmolLM2-135M, 2 CPU cores)


def default_steps(n_params: int) -> int:
    """Refine steps for a model of ``n_params`` parameters (:data:`STEPS_BY_SIZE`)."""
    return next(steps for limit, steps in STEPS_BY_SIZE if n_params <= limit)


def _matmul_flops() -> float:
    """This machine's float32 matmul speed (FLOP/s), timed on a 512 x 1024 x 1024 product (~0.1 s)."""
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    a @ b  # warm-up
    t0, reps = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.1:
        a @ b
        reps += 1
    return 2 * 512 * 1024 * 1024 * reps / (time.perf_counter() - t0)


def estimated_seconds(n_params: int, cfg: "RefineConfig", steps: int, flops: Optional[float] = None) -> float:
    """A rough cost of refining a model of ``n_params`` parameters ``steps`` steps here: its multiply-adds (training
    steps plus the validation KL before and after) at :data:`_EFFICIENCY` of this machine's matmul speed."""
    tokens = steps * cfg.batch * cfg.seq_len * _PASSES_PER_STEP + 4 * cfg.n_valid * cfg.seq_len
    return 2.0 * n_params * tokens / ((flops or _matmul_flops()) * _EFFICIENCY)


def _ste_bf16(x: torch.Tensor) -> torch.Tensor:
    """bfloat16 rounding in the forward pass, identity in the backward pass."""
    return x + (x.to(torch.bfloat16).float() - x).detach()


def _e4m3_round(x: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """The E4M3 values (float32) nearest ``x`` within [2^-9, 448] where the block's derived scale ``s0`` is
    positive; ``s0`` itself where it is 0 or NaN (an all-zero or non-finite block keeps its scale)."""
    live = s0 > 0
    x = torch.where(live, x, torch.ones_like(x)).nan_to_num(E4M3_MAX).clamp(E4M3_MIN, E4M3_MAX)  # NaN: a diverged a
    return torch.where(live, e4m3_decode(e4m3_encode(x)), s0)


def _ste_e4m3(x: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
    """:func:`_e4m3_round` in the forward pass, identity in the backward pass."""
    return x + (_e4m3_round(x.detach(), s0) - x).detach()


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes of at most 4 bits (uint8, even last axis), two a byte: element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unnibble(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_nibbles` (uint8 codes, last axis twice as long)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


_CHUNK_ELEMENTS = 16 * 1024 ** 2  # the backward's product of a gradient and its codes, 64 MB of float32 at a time


class _AffineWeight(torch.autograd.Function):
    """``W = q * s + b`` (codes ``q`` grouped along the last axis) whose backward keeps the uint8 codes it is given
    rather than the float32 copy autograd would save for ``q * s``; the same values and gradients, bit for bit
    (a product then a sum in float32, the gradients reduced over each group's axis as autograd reduces them)."""

    @staticmethod
    def forward(ctx, codes: torch.Tensor, s: torch.Tensor, b: torch.Tensor, shape: tuple, bs: int) -> torch.Tensor:
        w = codes.float().reshape(*shape[:-1], shape[-1] // bs, bs)
        w.mul_(s.unsqueeze(-1)).add_(b.unsqueeze(-1))
        ctx.save_for_backward(codes)
        ctx.bs = bs
        return w.reshape(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (codes,) = ctx.saved_tensors
        bs = ctx.bs
        g = grad.reshape(-1, codes.shape[-1] // bs, bs)
        grad_s = _grad_scales(g, codes, lambda q: q)
        lead = codes.shape[:-1] + (codes.shape[-1] // bs,)
        return None, grad_s.reshape(lead), g.sum(-1).reshape(lead), None, None


def _grad_scales(g: torch.Tensor, codes: torch.Tensor, values: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``(g * values(codes)).sum(-1)`` for ``g`` (rows, groups, bs), a few rows at a time: no float32 copy of the
    matrix (``values``: the codes' element values, from a chunk of the uint8 codes)."""
    q = codes.reshape(g.shape)
    grad_s = torch.empty(g.shape[:-1], dtype=g.dtype)
    step = max(1, _CHUNK_ELEMENTS // max(codes.shape[-1], 1))  # rows at a time
    for lo in range(0, g.shape[0], step):
        grad_s[lo:lo + step] = (g[lo:lo + step] * values(q[lo:lo + step])).sum(-1)
    return grad_s


class _NVFP4Weight(torch.autograd.Function):
    """``W = e2m1(P) * s`` (E2M1 codes ``P`` in blocks along the last axis, ``s`` the block scales already times the
    global scale's decode factor) whose backward keeps the uint8 codes rather than the float32 values autograd would
    save; the same values and gradients, bit for bit (one float32 product, the gradient reduced over each block)."""

    @staticmethod
    def forward(ctx, codes: torch.Tensor, s: torch.Tensor, shape: tuple, bs: int) -> torch.Tensor:
        w = _e2m1(codes).reshape(*shape[:-1], shape[-1] // bs, bs)
        w.mul_(s.unsqueeze(-1))
        ctx.save_for_backward(codes)
        ctx.bs = bs
        return w.reshape(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (codes,) = ctx.saved_tensors
        bs = ctx.bs
        g = grad.reshape(-1, codes.shape[-1] // bs, bs)
        lead = codes.shape[:-1] + (codes.shape[-1] // bs,)
        return None, _grad_scales(g, codes, _e2m1).reshape(lead), None, None


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8) -> their float32 values (mfqat.quant.nvfp4.LUT: bit 3 the sign, -0 kept)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.int()]


def _kept(codes: torch.Tensor, spill: Optional[CodeSpill]):
    """Packed codes as a learner keeps them: in memory, or written to ``spill`` (read back by the learner's ``codes``)."""
    return codes if spill is None else spill.put(codes)


class _CodesMixin:
    """``codes``: a learner's packed uint8 codes, read back from its CodeSpill when they wait on disk."""

    @property
    def codes(self) -> torch.Tensor:
        return self._codes.get() if isinstance(self._codes, SpilledCodes) else self._codes


class _Groups(_CodesMixin, nn.Module):
    """The learned (a, c) of one affine tensor and the weights they give. The codes are kept as the tensor's
    uint8 codes (two a byte for widths up to 4 bits); :meth:`weight` builds the float32 weights when a forward
    asks for them."""

    def __init__(self, q: MXTensor, spill: Optional[CodeSpill] = None):
        super().__init__()
        self.nibbles = q.fmt.bits <= 4
        self._codes = _kept(_nibbles(q.codes) if self.nibbles else q.codes, spill)
        self.shape, self.layout = tuple(q.shape), (q.fmt, q.block_size, q.dtype)
        self.scale_rule = q.scale_rule
        self.s0, self.b0 = q.scales, q.biases  # as derived (bfloat16): upcast exactly where they are used
        self.a = nn.Parameter(torch.zeros_like(self.s0, dtype=torch.float32))
        self.c = nn.Parameter(torch.zeros_like(self.s0, dtype=torch.float32))

    def scales_biases(self, straight_through: bool = True):
        s0, b0 = self.s0.float(), self.b0.float()
        s, b = s0 * (1 + self.a), b0 + s0 * self.c
        if straight_through:
            return _ste_bf16(s), _ste_bf16(b)
        return s.detach().to(torch.bfloat16).float(), b.detach().to(torch.bfloat16).float()

    def unpacked(self) -> torch.Tensor:
        """The uint8 codes, shaped as the tensor."""
        return _unnibble(self.codes) if self.nibbles else self.codes

    def rows(self, index: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The uint8 codes of the matrix's rows ``index`` (all rows when None): mfqat.export.lean_matrices."""
        codes = self.codes if index is None else self.codes[index]
        return _unnibble(codes) if self.nibbles else codes

    def weight(self) -> torch.Tensor:
        """``W = q * s + b`` in float32, the codes grouped along the last axis."""
        s, b = self.scales_biases()
        return _AffineWeight.apply(self.unpacked(), s, b, self.shape, self.layout[1])

    def learned_scales(self) -> LearnedScales:
        """The learned bfloat16 scales and biases (float32 tensors holding bfloat16 values)."""
        return LearnedScales(*self.scales_biases(straight_through=False))

    def learned(self) -> MXTensor:
        """The tensor with its learned bfloat16 scales and biases (same codes)."""
        return self.learned_scales().on(MXTensor(self.unpacked(), self.s0, *self.layout, self.b0, self.scale_rule))


class _Blocks(_CodesMixin, nn.Module):
    """The learned ``a`` of one nvfp4 tensor (one per block of 16) and the weights it gives. The E2M1 codes are
    kept two a byte; :meth:`weight` builds the float32 weights when a forward asks for them; the global scale
    (if any) is kept."""

    def __init__(self, q: MXTensor, spill: Optional[CodeSpill] = None):
        super().__init__()
        self._codes = _kept(_nibbles(q.codes), spill)
        self.shape, self.block_size, self.dtype, self.fmt = tuple(q.shape), q.block_size, q.dtype, q.fmt
        self.scale_rule, self.global_scale = q.scale_rule, q.global_scale
        self.bytes0 = q.scales  # the derived E4M3 bytes
        self.a = nn.Parameter(torch.zeros(q.scales.shape, dtype=torch.float32))

    def scales(self, straight_through: bool = True) -> torch.Tensor:
        """The learned E4M3 block scales (float32 values)."""
        s0 = e4m3_decode(self.bytes0)
        s = s0 * (1 + self.a)
        return _ste_e4m3(s, s0) if straight_through else _e4m3_round(s.detach(), s0)

    def unpacked(self) -> torch.Tensor:
        return _unnibble(self.codes)

    def weight(self) -> torch.Tensor:
        """``W = e2m1(P) * (s * fl32(g / 2688))`` in float32, as MXTensor.dequantize computes it."""
        s = self.scales()
        if self.global_scale is not None:
            s = s * (self.global_scale.float() / torch.tensor(NVFP4_RANGE))
        return _NVFP4Weight.apply(self.unpacked(), s, self.shape, self.block_size)

    def learned_scales(self) -> LearnedScales:
        """The learned E4M3 scale bytes; a block whose derived scale is 0 or NaN keeps its byte."""
        s0 = e4m3_decode(self.bytes0)
        live = s0 > 0
        learned = e4m3_encode(torch.where(live, self.scales(straight_through=False), torch.zeros_like(s0)))
        return LearnedScales(torch.where(live, learned, self.bytes0))

    def learned(self) -> MXTensor:
        """The tensor with its learned E4M3 scale bytes (same codes, same global scale)."""
        return self.learned_scales().on(MXTensor(self.unpacked(), self.bytes0, self.fmt, self.block_size, self.dtype,
                                                 None, self.scale_rule, global_scale=self.global_scale))


class _MXWeight(torch.autograd.Function):
    """``W``: the anchor's values ``x`` encoded in an MX format at the block exponents ``e`` and decoded
    (mfqat.quant.scale_search.dequantize_with_exponents, bit for bit the written tensor's dequantization). Backward:
    the gradient of each block's exponent parameter by LSQ's estimate, ``ln2 * sum(g * (W - x))`` over the block's
    elements in range plus ``ln2 * sum(g * W)`` over those that saturate; none for a non-finite block."""

    @staticmethod
    def forward(ctx, u: torch.Tensor, x: torch.Tensor, e: torch.Tensor, nonfinite: torch.Tensor, fmt, bs: int):
        ctx.save_for_backward(x, e, nonfinite)
        ctx.fmt, ctx.bs = fmt, bs
        return dequantize_with_exponents(x, fmt, bs, (e, nonfinite))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, e, nonfinite = ctx.saved_tensors
        fmt, bs = ctx.fmt, ctx.bs
        rows_x, rows_g = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        rows_e, rows_nf = e.reshape(-1, e.shape[-1]), nonfinite.reshape(-1, e.shape[-1])
        g = torch.empty(rows_e.shape, dtype=torch.float32)
        step = max(1, _CHUNK_ELEMENTS // max(x.shape[-1], 1))  # rows at a time: no float32 copies of the matrix
        for lo in range(0, rows_x.shape[0], step):
            g[lo:lo + step] = _exponent_grad(rows_x[lo:lo + step], rows_g[lo:lo + step], rows_e[lo:lo + step],
                                             rows_nf[lo:lo + step], fmt, bs)
        return torch.where(nonfinite, torch.zeros_like(e, dtype=torch.float32), g.reshape(e.shape)), None, None, \
            None, None, None


def _exponent_grad(x: torch.Tensor, grad: torch.Tensor, e: torch.Tensor, nonfinite: torch.Tensor, fmt,
                   bs: int) -> torch.Tensor:
    """:class:`_MXWeight`'s gradient of each block's exponent parameter for a few rows (rows x K -> rows x K/bs)."""
    w = dequantize_with_exponents(x, fmt, bs, (e, nonfinite)).reshape(*e.shape, bs)
    xb = x.reshape(*e.shape, bs)
    in_range = xb.abs() <= (exp2i(e) * fmt.max_normal).unsqueeze(-1)
    w.sub_(torch.where(in_range, xb, torch.zeros_like(xb)))  # dW/du / ln2
    return (grad.reshape(*e.shape, bs) * w).sum(-1).mul_(math.log(2.0))


class _Exponents(_CodesMixin, nn.Module):
    """The learned ``u`` of one MX tensor lowered from the anchor (one per block) and the weights it gives. The
    anchor's codes are kept (a byte a weight) and decoded to its exact values when a forward asks for the weights;
    each block's exponent is its derived one moved by ``clamp(round(u), -1, 1)``."""

    def __init__(self, a: MXTensor, q: MXTensor, spill: Optional[CodeSpill] = None):
        super().__init__()
        self.signed = a.codes.dtype == torch.int8
        self._codes = _kept(a.codes.view(torch.uint8) if self.signed else a.codes, spill)
        self.anchor_scales, self.anchor_layout = a.scales, (a.fmt, a.block_size, a.dtype)
        self.fmt, self.shape = q.fmt, tuple(q.shape)
        self.bytes0 = q.scales  # the derived E8M0 bytes
        self.high = min(127, dtype_max_exponent(a.dtype) - q.fmt.emax)  # the search's cap: a finite block stays finite
        self.u = nn.Parameter(torch.zeros(q.scales.shape, dtype=torch.float32))

    def exponents(self) -> torch.Tensor:
        """The chosen exponent of each block (int32; a non-finite block keeps its derived 128, E8M0's NaN)."""
        e0 = self.bytes0.to(torch.int32) - E8M0_BIAS
        offset = self.u.detach().nan_to_num(0.0).round().clamp(-1, 1).to(torch.int32)  # NaN: a diverged u stays
        moved = (e0 + offset).clamp(-127, self.high)
        return torch.where(self.bytes0 == E8M0_NAN, e0, moved)

    def values(self) -> torch.Tensor:
        """The anchor's values of this tensor in float32 (exact)."""
        codes = self.codes.view(torch.int8) if self.signed else self.codes
        return MXTensor(codes, self.anchor_scales, *self.anchor_layout).dequantize(torch.float32)

    def weight(self) -> torch.Tensor:
        """The anchor's values encoded at :meth:`exponents` and decoded (float32)."""
        return _MXWeight.apply(self.u, self.values(), self.exponents(), self.bytes0 == E8M0_NAN, self.fmt,
                               self.anchor_layout[1])

    def learned_scales(self) -> LearnedExponents:
        """The chosen E8M0 bytes (255, a non-finite block's, kept: :meth:`exponents` keeps its 128)."""
        return LearnedExponents((self.exponents() + E8M0_BIAS).to(torch.uint8))


def _learner(anchor: Anchor, plan: Plan, name: str, spill: Optional[CodeSpill] = None) -> nn.Module:
    """The module that learns tensor ``name``'s scales: :class:`_Blocks` for nvfp4, :class:`_Exponents` for an MX
    format, :class:`_Groups` for affine (their codes on disk in ``spill`` between uses, when given)."""
    q = plan.tensor(anchor, name)
    if q.fmt.family == "nvfp4":
        return _Blocks(q, spill)
    if q.fmt.family in MX_FAMILIES:
        return _Exponents(anchor.quantized[name], q, spill)
    return _Groups(q, spill)


def _student_source(anchor: Anchor, plan: Plan, groups: Dict[str, nn.Module],
                    teacher: Callable[[str], torch.Tensor],
                    markers: Optional[Dict[str, torch.Tensor]] = None) -> Callable[[str], torch.Tensor]:
    """name -> the export's tensor: the learned weights of an affine tensor (its marker when it is a lean matrix:
    mfqat.export.lean_matrices), else the export check's reference value (mfqat.export.verify.reference_tensor),
    else the anchor's (a tensor the plan does not touch)."""
    markers = markers or {}

    def source(name: str) -> torch.Tensor:
        if name in markers:
            return markers[name]
        if name in groups:
            return groups[name].weight()
        v = reference_tensor(anchor, plan, name)
        return teacher(name) if v is None else v
    return source


Logits = Callable[[torch.Tensor], torch.Tensor]  # token ids (batch x seq) -> logits


_KL_CHUNK_ELEMENTS = 8 * 1024 ** 2  # the KL's softmaxes over at most this many logits at a time (32 MB of float32)


def _kl_rows(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    """KL(softmax(teacher / t) || softmax(student / t)) of each row (rows x vocabulary -> rows)."""
    log_s = F.log_softmax(student.float() / t, dim=-1)
    log_t = F.log_softmax(teacher.float() / t, dim=-1)
    return (log_t.exp() * (log_t - log_s)).sum(-1)


def _kl(student: torch.Tensor, teacher: torch.Tensor, t: float) -> torch.Tensor:
    """``t^2`` x the mean over tokens of :func:`_kl_rows`, a few rows of logits at a time: with autograd, each
    chunk's softmaxes are recomputed in backward (non-reentrant checkpointing) rather than kept, so the KL holds
    the two logit tensors and one chunk's intermediates, not six whole-batch copies (the same values and
    gradients, bit for bit: every operation is row by row)."""
    vocab = student.shape[-1]
    rows = max(1, _KL_CHUNK_ELEMENTS // vocab)
    chunks = zip(student.reshape(-1, vocab).split(rows), teacher.reshape(-1, vocab).split(rows))
    per_row = [checkpoint(_kl_rows, s, z, t, use_reentrant=False) if s.requires_grad else _kl_rows(s, z, t)
               for s, z in chunks]
    return torch.cat(per_row).reshape(student.shape[:-1]).mean() * t * t


MX_FAMILIES = ("mxint", "mxfp")
LEARNED_FAMILIES = ("affine", "nvfp4", *MX_FAMILIES)  # the formats whose scales refine learns
# The default (optional) refine learns affine and nvfp4 tensors: at the default rates, 64 steps on SmolLM2-135M
# lowered held-out perplexity on both BENCHMARKS texts for both (BENCHMARKS.md "Refine where the scales are not
# affine"). MX exponents are learned only with --refine: the default recipe (uniform:mxint4) is MX, and learning
# it by default would turn every plain export from seconds into minutes.
DEFAULT_FAMILIES = ("affine", "nvfp4")
ONLY_WHEN_ASKED = ("MX block exponents are learned only with --refine (the default refine learns affine and nvfp4 "
                   "tensors)")
NOTHING_TO_LEARN = ("the plan has no affine, nvfp4 or lowered MX tensor (refine learns affine scales and biases, nvfp4 "
                    "block scales and the exponents of MX tensors lowered from the anchor)")


def _learnable(anchor: Anchor, plan: Plan, name: str) -> bool:
    """Whether refine can learn tensor ``name``'s scales: an affine or nvfp4 tensor, or an MX tensor the plan lowers
    from the anchor's own codes to another format (the anchor's own format is exported as stored)."""
    fmt = get_format(plan.formats[name])
    if fmt.family in MX_FAMILIES:
        return name in anchor.quantized and get_format(anchor.format) != fmt
    return fmt.family in LEARNED_FAMILIES


def _learned_names(anchor: Anchor, plan: Plan, cfg: RefineConfig) -> Tuple[List[str], str]:
    """(the plan's tensors refine learns: :func:`_learnable`, only :data:`DEFAULT_FAMILIES` with ``cfg.optional``;
    why there are none). Without ``cfg.optional``, a plan with none is a ValueError; with it, so is (an empty list
    and the reason) a plan that uses an affine width the anchor stores learned scales for (``mfqat refine``): the
    user's stored scales are exported as they are."""
    names = [n for n in plan.formats if _learnable(anchor, plan, n)]
    if not names and not cfg.optional:
        lower = "uniform:mxint4" if get_format(anchor.format).family == "mxint" else "uniform:mxfp4_e2m1"
        raise ValueError(f"{anchor.path}: --refine learns affine scales and biases, nvfp4 block scales and the "
                         f"exponents of MX tensors lowered from the anchor, and the recipe's plan has none (the "
                         f"anchor's own format, {anchor.format}, is exported as stored): use uniform:affineK, "
                         f"auto:BPW:affine, seed:affine, uniform:nvfp4 or a lower MX format (e.g. {lower})")
    if not names:
        return [], NOTHING_TO_LEARN
    if cfg.optional:  # the default refine leaves MX exponents (ONLY_WHEN_ASKED)
        names = [n for n in names if get_format(plan.formats[n]).family in DEFAULT_FAMILIES]
        if not names:
            return [], ONLY_WHEN_ASKED
    stored = sorted({f for n, f in plan.formats.items() if n in names and get_format(f).family == "affine"
                     and pick(anchor.learned_scales, f, plan.group_of(f))})
    if cfg.optional and stored:
        return [], (f"the anchor stores learned scales for {', '.join(stored)} (mfqat refine); they are used as "
                    "stored (--refine learns every affine tensor again, from them)")
    return names, ""


def _lean_markers(model: LazyModel, groups: Dict[str, nn.Module]) -> Dict[str, torch.Tensor]:
    """{name: marker} of the learned affine matrices of the input embedding and the output head that the student
    runs without building them whole (mfqat.export.lean_matrices): an untied one always (the same values and
    gradients bit for bit), a tied one when its float32 matrix is at least lean_matrices.LEAN_MATRIX_BYTES (its
    two uses' gradients then add up in another order: equal to rounding; a small model keeps its exact path)."""
    names = [[name for _, attr, name in model.slots.get(module, []) if attr == "weight"] if module is not None else []
             for module in (model.model.get_input_embeddings(), model.model.get_output_embeddings())]
    tied = set(names[0]) & set(names[1])
    out = {}
    for name in set(names[0]) | set(names[1]):
        learner = groups.get(name)
        if not isinstance(learner, _Groups) or len(learner.shape) != 2:
            continue
        if name not in tied or 4 * learner.shape[0] * learner.shape[1] >= lean_matrices.LEAN_MATRIX_BYTES:
            out[name] = lean_matrices.marker(learner.shape)
    return out


def _check_calibration(calib: torch.Tensor, cfg: RefineConfig) -> None:
    if calib.shape[0] < cfg.n_blocks + cfg.n_valid:
        raise ValueError(f"refine: the calibration text gives {calib.shape[0]} blocks of {calib.shape[1]} tokens, "
                         f"{cfg.n_blocks + cfg.n_valid} needed (n_blocks + n_valid): pass a longer --calib-text, "
                         "or --no-refine")


def _valid_kl(student: Logits, teacher: Logits, valid: torch.Tensor, t: float) -> float:
    """The mean KL of the student to the teacher over the validation blocks, one block at a time."""
    with torch.no_grad():
        return float(sum(_kl(student(ids[None]), teacher(ids[None]), t) for ids in valid) / len(valid))


def _train(groups: Dict[str, nn.Module], student: Logits, teacher: Logits, train: torch.Tensor,
           cfg: RefineConfig, steps: int) -> List[float]:
    """``steps`` Adam steps on every group's (a, c) (an nvfp4 tensor's a, an MX tensor's u), each on ``cfg.batch`` blocks drawn
    (seeded) from ``train``; returns the training KL of each step. The optimizer state goes with the return.

    Each parameter takes its Adam step as soon as the backward has its gradient, which is then dropped
    (``register_post_accumulate_grad_hook``), so the gradients of the whole model are never held at once: the
    same updates as one Adam over every parameter (single-tensor Adam updates each parameter on its own)."""
    params = [p for g in groups.values() for p in g.parameters()]
    exponents = {id(g.u) for g in groups.values() if isinstance(g, _Exponents)}
    opts = {p: torch.optim.Adam([p], lr=cfg.exponent_lr if id(p) in exponents else cfg.lr, foreach=False)
            for p in params}

    def step(p: torch.Tensor) -> None:
        opts[p].step()
        p.grad = None
    hooks = [p.register_post_accumulate_grad_hook(step) for p in params]
    gen = torch.Generator().manual_seed(cfg.seed)
    losses = []
    bar = progress(range(steps), desc="refine scales/biases", unit="step")
    try:
        for _ in bar:
            ids = train[torch.randint(0, len(train), (cfg.batch,), generator=gen)]
            with torch.no_grad():
                target = teacher(ids)
            loss = _kl(student(ids), target, cfg.temperature)
            loss.backward()  # every parameter steps as its gradient comes
            losses.append(loss.item())
            bar.set_postfix(kl=f"{losses[-1]:.4f}")
    finally:
        for h in hooks:
            h.remove()
    return losses


def plan_refine(anchor: Anchor, plan: Plan, cfg: RefineConfig) -> dict:
    """What :func:`refine` will do, before it runs: the tensors it learns (``names``; empty with ``skipped``, the
    reason, when an optional refine has nothing to learn), the steps (``cfg.steps`` or by model size), where
    they come from, and the estimated seconds on this machine."""
    names, why = _learned_names(anchor, plan, cfg)
    if not names:
        return {"names": [], "skipped": why}
    n_params = anchor_parameters(anchor)
    steps = cfg.steps if cfg.steps is not None else default_steps(n_params)
    return {"names": names, "steps": steps, "parameters": n_params,
            "steps_from": "given" if cfg.steps is not None else "model size (mfqat.export.refine.STEPS_BY_SIZE)",
            "estimated_seconds": estimated_seconds(n_params, cfg, steps)}


def refine(anchor: Anchor, plan: Plan, calib: torch.Tensor, cfg: Optional[RefineConfig] = None,
           planned: Optional[dict] = None) -> dict:
    """Learn the scales and biases of ``plan``'s affine tensors, the block scales of its nvfp4 tensors and the block
    exponents of its lowered MX tensors on ``calib`` token blocks (``n_blocks + n_valid`` x ``seq_len``); sets ``plan.learned_scales`` when the validation KL drops.
    Returns the report entry (tensors, steps, KL before / after, estimated and measured seconds; only
    ``skipped`` when an optional refine has nothing to learn). ``planned``: :func:`plan_refine`'s answer.

    Memory: the affine codes (a byte a weight, half that up to 4 bits; an MX tensor's: the anchor's, a byte a
    weight; on disk in ``cfg.spill_dir`` between uses when given) and each group's (a, c) (block's u) with their
    Adam state; the teacher (the anchor in its format) and the student (the export) are one model on the meta device
    whose modules get their float32 weights as they run (mfqat.export.lazy_model), read from the anchor (lazily
    read or not) or built from the codes, decoder layers recomputed in backward."""
    cfg = cfg or RefineConfig()
    t0 = time.perf_counter()
    planned = planned or plan_refine(anchor, plan, cfg)
    if not planned["names"]:
        return {"skipped": planned["skipped"]}
    _check_calibration(calib, cfg)
    names, steps = planned["names"], planned["steps"]
    spill = CodeSpill(cfg.spill_dir) if cfg.spill_dir is not None else None
    try:
        return _refine(anchor, plan, calib, cfg, planned, names, steps, spill, t0)
    finally:
        if spill is not None:
            spill.close()


def _refine(anchor: Anchor, plan: Plan, calib: torch.Tensor, cfg: RefineConfig, planned: dict, names: List[str],
            steps: int, spill: Optional[CodeSpill], t0: float) -> dict:
    """:func:`refine`'s work, its codes kept in ``spill`` when given."""
    train, valid = calib[: cfg.n_blocks], calib[cfg.n_blocks: cfg.n_blocks + cfg.n_valid]
    groups = {n: _learner(anchor, plan, n, spill) for n in names}  # one tensor derived at a time
    model = LazyModel(anchor)
    anchor_weights = anchor_source(anchor)
    markers = _lean_markers(model, groups)
    export_weights = _student_source(anchor, plan, groups, anchor_weights, markers)
    lean = {id(m): groups[n] for n, m in markers.items()}

    def teacher(ids: torch.Tensor) -> torch.Tensor:
        return model.logits(anchor_weights, ids)

    def student(ids: torch.Tensor) -> torch.Tensor:
        with LeanMatrices(lean):
            return model.logits(export_weights, ids)

    before = _valid_kl(student, teacher, valid, cfg.temperature)
    losses = _train(groups, student, teacher, train, cfg, steps)
    after = _valid_kl(student, teacher, valid, cfg.temperature)
    kept = after < before
    if kept:  # the learned scales only: the codes are derived again as each tensor is written (LearnedScales),
        # except codes the plan holds whole (mfqat.export.gptq's), kept with their learned scales
        for n in list(groups):
            learned, held = groups.pop(n).learned_scales(), plan.learned_scales.get(n)
            plan.learned_scales[n] = learned.on(held) if isinstance(held, MXTensor) else learned
    return {"tensors": len(names), "steps": steps, "steps_from": planned["steps_from"], "lr": cfg.lr,
            "exponent_lr": cfg.exponent_lr,
            "batch": cfg.batch, "seq_len": cfg.seq_len, "calibration_blocks": cfg.n_blocks,
            "validation_blocks": cfg.n_valid, "temperature": cfg.temperature,
            "validation_kl_before": before, "validation_kl_after": after, "kept": kept,
            "train_kl_first_last": [losses[0], losses[-1]], "estimated_seconds": planned["estimated_seconds"],
            "seconds": time.perf_counter() - t0}


def describe_plan(planned: dict, cfg: RefineConfig) -> str:
    """One line for the user before a refine starts: what it learns, how long it should take, how to skip it."""
    if not planned["names"]:
        return f"refine: skipped: {planned['skipped']}"
    minutes = planned["estimated_seconds"] / 60
    return (f"refine: {len(planned['names'])} affine / nvfp4 / MX tensors, {planned['steps']} steps of {cfg.batch} x {cfg.seq_len} "
            f"tokens (steps by {'--refine-steps' if planned['steps_from'] == 'given' else 'model size'}, "
            f"{planned['parameters'] / 1e9:.2f}B parameters): about {minutes:.0f} min here"
            + (" (--no-refine skips it)" if cfg.optional else ""))


def apply_refine(anchor: Anchor, plan: Plan, tokenizer_dir: Path, calib_text: Optional[str],
                 cfg: Optional[RefineConfig] = None) -> dict:
    """Tokenize the calibration text (default: the pydoc training split) and :func:`refine`; the plan and its
    estimated cost are announced first (mfqat.progress.announce)."""
    from transformers import AutoTokenizer

    from mfqat.data.sources import calibration_blocks, describe_calibration

    cfg = cfg or RefineConfig()
    planned = plan_refine(anchor, plan, cfg)
    announce(describe_plan(planned, cfg))
    if not planned["names"]:
        return {"skipped": planned["skipped"]}
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    calib = calibration_blocks(tok, calib_text, n_blocks=cfg.n_blocks + cfg.n_valid, seq_len=cfg.seq_len)
    return {**refine(anchor, plan, calib, cfg, planned), "calibration": describe_calibration(calib_text)}


@contextmanager
def _scratch(path: Path, cfg: RefineConfig) -> Iterator[RefineConfig]:
    """``cfg`` with a ``spill_dir``: its own, or a temporary folder beside the anchor at ``path`` (removed after)."""
    if cfg.spill_dir is not None:
        yield cfg
        return
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.refine-", dir=path.absolute().parent) as folder:
        yield dataclasses.replace(cfg, spill_dir=Path(folder))


def refine_anchor(path: Path, formats: List[str], group_size: int = DERIVED_GROUP_SIZE,
                  calib_text: Optional[str] = None, cfg: Optional[RefineConfig] = None,
                  overwrite: bool = False) -> List[dict]:
    """``mfqat refine``: learn every width in ``formats`` (affine2..affine8) against the anchor at ``path``
    and store the learned scales and biases in it (mfqat.anchor.learned_scales), each width on its own: the uniform
    model of that width over the anchor's quantized tensors. A width whose validation KL does not drop is
    not stored (the report says so). Returns one report row per width."""
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.anchor.learned_scales_store import add_learned_scales
    from mfqat.export.recipes import build_plan
    from mfqat.formats import canonical_name, get_format

    cfg = cfg or RefineConfig()
    path = Path(path)
    widths = [canonical_name(f) for f in formats]
    bad = [f for f in widths if get_format(f).family != "affine" or get_format(f).group]
    if bad:
        raise ValueError(f"refine: {bad[0]} is not an affine width; the anchor stores learned scales for "
                         "affine2..affine8 (MLX's affine layout) in groups of group_size (affine3@g128: affine3 "
                         "with group_size=128)")
    anchor = read_anchor(path, lazy=True)
    if int(anchor.meta.get("format_version", 1)) < 2:
        raise ValueError(f"{path}: a format-version-1 anchor has no manifest to list learned scales in; load and "
                         "save it again with this mfqat (load_anchor, then save_anchor), then refine")
    taken = [f for f in widths if f in anchor.learned_scales and not overwrite]
    if taken:
        raise FileExistsError(f"{path}: already holds learned {taken[0]} scales; pass --overwrite to learn them again")
    rows = []
    for fmt in widths:
        anchor = read_anchor(path, lazy=True)  # tensors read when a module runs (mfqat.export.lazy_model)
        anchor.learned_scales.pop(fmt, None)  # learn from the derived values, not from an earlier run
        plan = build_plan(anchor, f"uniform:{fmt}", derived_group=group_size)
        for name in [n for n in plan.formats if n not in anchor.quantized]:  # only what the anchor can hold
            del plan.formats[name]
            plan.origin.pop(name, None)
        with _scratch(path, cfg) as spilled:  # the codes wait on disk beside the anchor, never in it
            report = apply_refine(anchor, plan, path, calib_text, spilled)
        if report["kept"]:
            info = {k: report[k] for k in ("steps", "lr", "batch", "seq_len", "calibration_blocks", "validation_blocks",
                                            "temperature", "validation_kl_before", "validation_kl_after", "calibration")}
            add_learned_scales(path, fmt, group_size, plan.learned_scales, info, overwrite=True,
                               learned_from=anchor.meta["files"])
        rows.append({"format": fmt, "group_size": group_size, **report, "stored": bool(report["kept"])})
    return rows
