"""The embedding and output head of a refine's student without their whole float32 matrices (issue 44).

A refine's student builds every affine weight ``W = q * s + b`` in float32 as a module runs. For the embedding
and the output head that is a vocabulary-sized matrix (49152 x 3072 = 0.6 GB at 3B), and autograd's
backward adds a second one, its dense gradient, before reducing it to the group scales and biases. Here:

- the embedding builds only the rows of the token ids it looks up, and its backward accumulates the
  gradient of those rows only (as ``embedding``'s dense backward does, with ``index_add``), reduced to their
  groups' scales and biases;
- the head builds its matrix for the product and frees it; its backward builds it again for the input's
  gradient, frees it, and forms the matrix's gradient a few thousand rows at a time, each reduced to its
  groups' scales and biases at once.

Both give autograd's values and gradients bit for bit (tests/test_refine_memory.py) for an untied
embedding and head, which refine therefore always runs this way; the head's matrix gradient is bit for bit
where the BLAS reduces a block of rows in the order it reduces the whole product (on one AMD EPYC, 5-row
blocks differed by float32 rounding, ~1e-6 relative: tests/test_lean_matrices.py). A tied one (one matrix for both) adds the
head's and the embedding's contributions to the scales' gradients after reducing each, not before: equal up
to float32 rounding, so refine runs it this way only from :data:`LEAN_MATRIX_BYTES` of float32 (a small
model such as SmolLM2-135M, 113 MB, keeps its exact numbers).

The model's modules are left as they are: the student's source gives such a matrix as a *marker*, a
meta-device tensor of its shape, and :class:`LeanMatrices` (a ``TorchFunctionMode``) routes the ``embedding``
and ``linear`` calls that receive a marker to the functions here; any other use of a marker fails loudly
(meta tensors hold no values).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

LEAN_MATRIX_BYTES = 256 * 1024 ** 2  # a tied embedding and head goes lean from this float32 size (untied: always)
_ROWS_ELEMENTS = 16 * 1024 ** 2  # the head's gradient formed this many elements (64 MB of float32) at a time
_METADATA = ("__get__", "size", "dim", "numel")  # what other calls may ask of a marker (its shape, dtype, device)
_EMBEDDING_OPTIONS = ("padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")  # F.embedding's, in order


def _build(codes: torch.Tensor, s: torch.Tensor, b: torch.Tensor, bs: int) -> torch.Tensor:
    """``q * s + b`` in float32 for uint8 codes (rows x K) and their groups' scales and biases (rows x K / bs),
    computed as mfqat.export.refine._AffineWeight computes it (a product, then a sum)."""
    w = codes.float().reshape(codes.shape[0], -1, bs)
    w.mul_(s.unsqueeze(-1)).add_(b.unsqueeze(-1))
    return w.reshape(codes.shape)


def _group_grads(g: torch.Tensor, codes: torch.Tensor, bs: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the groups' scales and biases from the gradient ``g`` of their rows (rows x K)."""
    g = g.reshape(g.shape[0], -1, bs)
    return (g * codes.reshape(g.shape)).sum(-1), g.sum(-1)


class _Rows(torch.autograd.Function):
    """``embedding(ids, W)`` of an affine ``W`` (``unpack(rows) -> uint8 codes``) building only the looked-up rows."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, s: torch.Tensor, b: torch.Tensor, unpack, bs: int,
                padding_idx: Optional[int] = None) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = _build(unpack(flat), s[flat], b[flat], bs)
        ctx.save_for_backward(ids)
        ctx.unpack, ctx.bs, ctx.shape, ctx.padding_idx = unpack, bs, s.shape, padding_idx
        return out.reshape(*ids.shape, out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat, grad = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # embedding's backward gives the padding row no gradient
            grad = grad.masked_fill((flat == ctx.padding_idx).unsqueeze(-1), 0.0)
        used, where = torch.unique(flat, return_inverse=True)
        rows = torch.zeros(len(used), grad.shape[-1], dtype=grad.dtype)
        rows.index_add_(0, where, grad)  # embedding's dense backward, used rows only
        gs, gb = _group_grads(rows, ctx.unpack(used), ctx.bs)
        grad_s = torch.zeros(ctx.shape, dtype=grad.dtype).index_copy_(0, used, gs)
        grad_b = torch.zeros(ctx.shape, dtype=grad.dtype).index_copy_(0, used, gb)
        return None, grad_s, grad_b, None, None, None


class _Head(torch.autograd.Function):
    """``linear(x, W)`` of an affine ``W`` (vocabulary x hidden) whose backward never holds W's whole gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, s: torch.Tensor, b: torch.Tensor, unpack, bs: int) -> torch.Tensor:
        ctx.save_for_backward(x, s, b)
        ctx.unpack, ctx.bs = unpack, bs
        return F.linear(x, _build(unpack(None), s, b, bs))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, s, b = ctx.saved_tensors
        unpack, bs = ctx.unpack, ctx.bs
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:  # mm's backward: grad @ W, W built again and dropped
            grad_x = g2.mm(_build(unpack(None), s, b, bs)).reshape(x.shape)
        grad_s, grad_b = torch.empty_like(s), torch.empty_like(b)
        step = max(1, _ROWS_ELEMENTS // max(x2.shape[-1], 1))
        for lo in range(0, s.shape[0], step):  # W's gradient rows lo..lo+step, as mm's backward forms them
            rows = torch.arange(lo, min(lo + step, s.shape[0]))
            gw = g2[:, lo:lo + step].t().mm(x2)
            grad_s[lo:lo + step], grad_b[lo:lo + step] = _group_grads(gw, unpack(rows), bs)
        return grad_x, grad_s, grad_b, None, None


class LeanMatrices(TorchFunctionMode):
    """Within this mode, ``embedding`` and ``linear`` given a marker (a key of ``learners``: id -> the affine
    learner of mfqat.export.refine, with ``scales_biases()`` and ``rows(ids or None)``) run on the learner's
    codes through :class:`_Rows` / :class:`_Head`; every other call runs as usual."""

    def __init__(self, learners: Dict[int, object]):
        super().__init__()
        self.learners = learners

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.embedding and len(args) > 1 and id(args[1]) in self.learners:
            options = dict(zip(_EMBEDDING_OPTIONS, args[2:]), **kwargs)
            if options.get("max_norm") is not None or options.get("scale_grad_by_freq") or options.get("sparse"):
                raise ValueError("refine: a lean embedding takes no max_norm, scale_grad_by_freq or sparse option")
            padding_idx = options.get("padding_idx")
            if padding_idx is not None and padding_idx < 0:
                padding_idx += args[1].shape[0]
            learner = self.learners[id(args[1])]
            s, b = learner.scales_biases()
            return _Rows.apply(args[0], s, b, learner.rows, learner.layout[1], padding_idx)
        if func is F.linear and len(args) > 1 and id(args[1]) in self.learners:
            if len(args) > 2 and args[2] is not None or kwargs.get("bias") is not None:
                raise ValueError("refine: a lean output head has no bias (an affine head with a bias is not supported)")
            learner = self.learners[id(args[1])]
            s, b = learner.scales_biases()
            return _Head.apply(args[0], s, b, learner.rows, learner.layout[1])
        if getattr(func, "__name__", "") not in _METADATA:
            used = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and id(a) in self.learners]
            if used:
                raise ValueError(f"refine: {getattr(func, '__name__', func)} uses a lean embedding / head matrix "
                                 f"{tuple(used[0].shape)}, which only embedding and linear may take; please report "
                                 "the model family (mfqat.export.lean_matrices)")
        return func(*args, **kwargs)


def marker(shape: Tuple[int, ...]) -> torch.Tensor:
    """A float32 meta-device tensor standing for a lean matrix of ``shape`` in the model."""
    return torch.empty(shape, dtype=torch.float32, device="meta")
