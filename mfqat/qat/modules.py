"""MF-QAT modules: drop-in nn.Linear / nn.Embedding that fake-quantize their weights.

The full-precision master weights stay the module's own ``weight`` / ``bias`` parameters, so
state_dict keys are unchanged and DDP, FSDP, PEFT LoRA wrapping, gradient checkpointing,
autocast and torch.compile see an ordinary Linear.
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from mfqat.quant.derive import DERIVED_GROUP_SIZE, fake_derive, is_derived
from mfqat.quant.api import fake_quantize, fake_quantize_through
from mfqat.quant.scale_rules import SEARCH_RULE, rule_of
from mfqat.quant.scale_search import (dequantize_through_with_exponents, dequantize_with_exponents, search_exponents,
                                  search_through_anchor, straight_through)
from mfqat.qat.input_squares import column_square_sums
from mfqat.qat.learned_scales import ATTR as LEARNED_ATTR, key_of, learned_affine


_OPTIMIZER_STEPS = [0]  # optimizer steps taken in this process (any torch.optim optimizer)


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _OPTIMIZER_STEPS[0] += 1


# A fused optimizer (AdamW(fused=True), the HF Trainer's default) updates weights without bumping
# their version counter, so "has this weight changed" keys on the step count as well.
register_optimizer_step_post_hook(_count_optimizer_step)


def weight_key(w: torch.Tensor) -> tuple:
    """Changes whenever ``w`` may have changed: an in-place edit (its version) or any optimizer step."""
    return (w.data_ptr(), w._version, _OPTIMIZER_STEPS[0])


def several_processes() -> bool:
    """Whether torch.distributed runs with more than one process (the importance is then synced)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


class MFQATMixin:
    """Shared state: the active weight format (None = full precision) and quantizer options."""

    fmt: Optional[str]
    block_size: int
    scale_rule: str
    mask_saturated: bool
    anchor_format: Optional[str]
    affine_group_size: int = DERIVED_GROUP_SIZE  # group of the derived affine formats (mfqat.quant.derive)
    scale_rules: Optional[Dict[str, str]] = None  # {format: rule}, set by prepare (mfqat.quant.scale_rules)
    importance_sum: Optional[torch.Tensor] = None  # float64 (in_features,): folded sum of squared inputs
    importance_tokens: int = 0  # how many input rows importance_sum holds
    pending_sum: Optional[torch.Tensor] = None  # recorded by this process since the last fold
    pending_tokens: int = 0
    _pending_since: int = 0  # the optimizer step count at the first pending record
    _searched_key: Optional[tuple] = None  # weight_key of the weight at the last search
    _search_cache: Optional[dict] = None  # {format: (key, exponents)} of the last search, reused by backward
    _param_name: str = "weight"  # the quantized parameter's name on its owner (learned scales are keyed by it)

    def _init_qat(self, block_size: int, scale_rule: str, mask_saturated: bool,
                  anchor_format: Optional[str] = None) -> None:
        self.fmt = None
        self.block_size = block_size
        self.scale_rule = scale_rule
        self.mask_saturated = mask_saturated
        self.anchor_format = anchor_format

    def target_names(self, prefix: str) -> List[str]:
        """The state_dict names of the weights this module quantizes, for a module called ``prefix``."""
        return [f"{prefix}.weight"]

    def quantized_weight(self, fmt: Optional[str] = "active") -> torch.Tensor:
        """The weight as the forward pass sees it (fake-quantized in the active format, or in
        ``fmt`` when one is given).

        With an ``anchor_format`` (train-through-anchor) format f sees exactly what deployment
        gets by Slice-and-Scale of the anchor: ``qdq_f(qdq_anchor(W))`` (the second rounding uses
        each format's rule from ``scale_rules``, as Slice-and-Scale on load); the gradient passes
        straight through both.
        """
        w = self.weight  # type: ignore[attr-defined]
        fmt = self.fmt if fmt == "active" else fmt
        if fmt is None:
            return w
        rules = self.scale_rules
        if rule_of(rules, fmt) == SEARCH_RULE and fmt != self.anchor_format:
            return self._searched(w, fmt, rule_of(rules, self.anchor_format, self.scale_rule))
        if self.anchor_format is None:
            return self._qdq(w, fmt, rule_of(rules, fmt, self.scale_rule))
        anchor_rule = rule_of(rules, self.anchor_format, self.scale_rule)
        if fmt == self.anchor_format:
            return fake_quantize(w, fmt, self.block_size, anchor_rule, self.mask_saturated)
        if not is_derived(fmt):  # one fused pass where a kernel has it (mfqat.quant.kernels), same bits
            return fake_quantize_through(w, self.anchor_format, fmt, self.block_size, anchor_rule,
                                         rule_of(rules, fmt), self.mask_saturated)
        w = fake_quantize(w, self.anchor_format, self.block_size, anchor_rule, self.mask_saturated)
        learned = self.learned_scales_of(fmt)
        if learned is not None:  # learn_scales (mfqat.qat.learned_scales)
            return learned_affine(w, fmt, self.affine_group_size, learned)
        return self._qdq(w, fmt, rule_of(rules, fmt))

    def with_every_learned_scale(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` + 0 * (every learned scale of this module): each (a, c) takes part in every training forward
        with a zero gradient when its width is not active, so DDP (which reduces each parameter once per step,
        in the last backward) finds them all used in every pass and reduces what they accumulated."""
        scales = self._modules.get(LEARNED_ATTR)
        if scales is None or not torch.is_grad_enabled() or not isinstance(out, torch.Tensor):
            return out
        terms = [p.sum() for p in scales.values() if p.requires_grad]  # none when frozen (e.g. under PEFT)
        return out + 0.0 * torch.stack(terms).sum().to(out.dtype) if terms else out

    def learned_scales_of(self, fmt: Optional[str]) -> Optional[torch.Tensor]:
        """The trained ``(a, c)`` of this weight in the affine width ``fmt`` (QATConfig.learn_scales), or None."""
        owner = self.__dict__.get("_scales_owner")  # a tied output head reads its embedding's scales
        owner = self.__dict__.get("_owner", self) if owner is None else owner
        scales = owner._modules.get(LEARNED_ATTR) if isinstance(owner, nn.Module) else None
        if scales is None or fmt is None:
            return None
        key = key_of(self._param_name, fmt)
        return scales[key] if key in scales else None

    @property
    def tracks_importance(self) -> bool:
        """Whether a format's rule is ``search``: the forward in the anchor format then records the
        input importance that the search weighs its error with."""
        return bool(self.scale_rules) and SEARCH_RULE in self.scale_rules.values()

    def importance(self) -> Optional[torch.Tensor]:
        """Mean squared input per input column over the anchor-format training forwards (float32, what
        ``save_anchor`` stores), or None before any. In one process the pending records are folded in
        first; under torch.distributed it is what :func:`mfqat.qat.importance_state.sync_importance`
        last folded (the same on every rank)."""
        if not several_processes():
            self.fold_importance()
        return self._folded_importance()

    def _folded_importance(self) -> Optional[torch.Tensor]:
        """The mean over the folded records only: what the search weighs its error with."""
        if not self.importance_tokens:
            return None
        return (self.importance_sum / self.importance_tokens).to(torch.float32)

    def _record_importance(self, x: torch.Tensor) -> None:
        """Add a training forward's inputs (anchor format only) to the pending importance records."""
        with torch.no_grad():
            sq = column_square_sums(x)
            if not bool(torch.isfinite(sq).all()):  # e.g. an fp16 overflow: it would poison the statistic
                warnings.warn("MF-QAT: a training forward's input has non-finite values; it is left out of "
                              "the search rule's importance statistic")
                return
            if self.pending_sum is None:
                self._pending_since = _OPTIMIZER_STEPS[0]
            self.pending_sum = sq.clone() if self.pending_sum is None else self.pending_sum.to(sq.device) + sq
            self.pending_tokens += x.numel() // x.shape[-1]

    def fold_importance(self, total: Optional[Tuple[torch.Tensor, int]] = None) -> None:
        """Move the pending records into the statistic the search uses. ``total``: the pending
        (sum, tokens) of every process (sync_importance's all-reduce) instead of this one's."""
        s, n = total if total is not None else (self.pending_sum, self.pending_tokens)
        if n:
            self.importance_sum = s if self.importance_sum is None else self.importance_sum.to(s.device) + s
            self.importance_tokens += int(n)
        self.pending_sum, self.pending_tokens = None, 0

    def _searched(self, w: torch.Tensor, fmt: str, anchor_rule: str) -> torch.Tensor:
        """The ``search`` rule: each block's exponent chosen by importance-weighted error against
        the anchor's values (mfqat.quant.scale_search), as Slice-and-Scale lowers the saved anchor.
        The importance is frozen between weight updates: in one process the pending records are folded
        in at the first search after the weight changed (or in eval mode), under torch.distributed by
        sync_importance. So the exponents are kept until the weight or the folded importance changes:
        backward's recompute and the other micro-batches of a step do not search again."""
        anchor = self.anchor_format
        wkey = weight_key(w)
        if self.pending_tokens and not several_processes() and (not self.training or self._searched_key != wkey):
            self.fold_importance()
        elif self.pending_tokens and self._pending_since < _OPTIMIZER_STEPS[0] and several_processes():
            warnings.warn("MF-QAT: inputs recorded before the last optimizer step were never synced, so the search "
                          "rule still uses the importance of earlier steps; call mfqat.sync_importance(model) "
                          "before each optimizer.step() under torch.distributed (mfqat train and MFQATCallback do)")
        self._searched_key = wkey
        key = (wkey, w.dtype, w.device, tuple(w.shape), self.importance_tokens)
        if self._search_cache is None:
            self._search_cache = {}
        cached = self._search_cache.get(fmt)  # one entry per format: an int32 and a bool per block
        with torch.no_grad():
            if cached is not None and cached[0] == key:  # the anchor's rounding and the decode in one pass
                y = dequantize_with_exponents(w, fmt, self.block_size, cached[1]) if anchor is None else \
                    dequantize_through_with_exponents(w, anchor, anchor_rule, fmt, self.block_size, cached[1])
                return straight_through(w, y)
            if anchor is None:
                exps = search_exponents(w, fmt, self.block_size, self._folded_importance())
                y = dequantize_with_exponents(w, fmt, self.block_size, exps)
            else:  # the anchor's rounding, the search and the decode in one pass
                exps, y = search_through_anchor(w, anchor, anchor_rule, fmt, self.block_size, self._folded_importance())
            self._search_cache[fmt] = (key, exps)
        return straight_through(w, y)

    def _qdq(self, w: torch.Tensor, fmt: str, scale_rule: str) -> torch.Tensor:
        """One quantize-dequantize: MX in blocks of ``block_size``; a derived affine format as MLX
        stores it (bfloat16 scale and bias per ``affine_group_size``, mfqat.quant.derive); nvfp4 in blocks of 16."""
        if is_derived(fmt):
            return fake_derive(w, fmt, self.affine_group_size)
        return fake_quantize(w, fmt, self.block_size, scale_rule, self.mask_saturated)


class _RecomputedQuantLinear(torch.autograd.Function):
    """``linear(x, qdq(W), b)`` that saves x and the master W, not qdq(W): the quantized weight is
    recomputed in backward (in the format the forward used, also when the active format changed
    since), so a step keeps no second copy of each weight (plain training's memory).
    With ``module.keep_quantized_weights`` the forward's qdq(W) (cast to the dtype of the output, which
    the gradient has) is saved instead and backward uses it: the same bits, one fake-quant fewer per
    pass, one weight copy held until this Linear's backward. Straight-through: dL/dW = dL/d(qdq(W))."""

    @staticmethod
    def forward(ctx, x, weight, bias, module):  # type: ignore[override]
        with torch.no_grad():
            wq = module.quantized_weight()
            if x.dtype != wq.dtype and not torch.is_autocast_enabled():
                wq = wq.to(x.dtype)
            out = F.linear(x, wq, bias)
        ctx.keep = bool(module.keep_quantized_weights)
        ctx.save_for_backward(x, weight, *([wq.to(out.dtype)] if ctx.keep else []))
        ctx.module, ctx.fmt, ctx.has_bias = module, module.fmt, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight, *kept = ctx.saved_tensors
        with torch.no_grad():  # the kept qdq(W), or recomputed in the format of the forward
            wq = (kept[0] if ctx.keep else ctx.module.quantized_weight(ctx.fmt)).to(grad.dtype)
            grad_x = (grad @ wq).to(x.dtype) if ctx.needs_input_grad[0] else None
            g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]).to(grad.dtype)
            grad_w = (g2.t() @ x2).to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


class MFQATLinear(nn.Linear, MFQATMixin):
    """nn.Linear whose forward uses the MX fake-quantized weight of the active format.

    ``keep_quantized_weights`` (set by prepare from QATConfig): backward uses the forward's quantized
    weight instead of recomputing it (same gradients; one weight copy per Linear until its backward).
    """

    keep_quantized_weights: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, block_size: int = 32,
                 scale_rule: str = "floor", mask_saturated: bool = False,
                 activation_format: Optional[str] = None, anchor_format: Optional[str] = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._init_qat(block_size, scale_rule, mask_saturated, anchor_format)
        self.activation_format = activation_format

    @classmethod
    def from_linear(cls, lin: nn.Linear, block_size: int = 32, scale_rule: str = "floor",
                    mask_saturated: bool = False, activation_format: Optional[str] = None,
                    anchor_format: Optional[str] = None) -> "MFQATLinear":
        """Wrap an existing Linear, sharing its parameters (no copy)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = lin.in_features, lin.out_features
        new.weight = lin.weight
        new.bias = lin.bias
        new._init_qat(block_size, scale_rule, mask_saturated, anchor_format)
        new.activation_format = activation_format
        return new

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear sharing this module's parameters."""
        lin = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self.weight, self.bias
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_format is not None and self.fmt is not None:
            x = fake_quantize(x, self.activation_format, self.block_size, self.scale_rule)
        if (self.training and self.fmt is not None and self.fmt == self.anchor_format and self.tracks_importance
                and torch._C._current_graph_task_id() == -1):  # not a checkpointed forward rerun in backward
            self._record_importance(x)
        observer = self._modules.get("act_observer")  # static activation observer (mfqat.qat.observers)
        if observer is not None and self.fmt is not None:
            x = observer(x)
        if self.fmt is not None and not self.mask_saturated and torch.is_grad_enabled() and self.weight.requires_grad \
                and self.learned_scales_of(self.fmt) is None:  # learned scales need their own gradient: autograd
            return self.with_every_learned_scale(_RecomputedQuantLinear.apply(x, self.weight, self.bias, self))
        w = self.quantized_weight()
        if x.dtype != w.dtype and not torch.is_autocast_enabled():
            w = w.to(x.dtype)
        return self.with_every_learned_scale(F.linear(x, w, self.bias))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fmt={self.fmt}, block_size={self.block_size}"


class MFQATEmbedding(nn.Embedding, MFQATMixin):
    """nn.Embedding whose lookup uses the fake-quantized table (blocks along the hidden axis)."""

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, block_size: int = 32, scale_rule: str = "floor",
                       mask_saturated: bool = False, anchor_format: Optional[str] = None) -> "MFQATEmbedding":
        """Wrap an existing Embedding, sharing its weight."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for k in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                  "scale_grad_by_freq", "sparse"):
            setattr(new, k, getattr(emb, k))
        new.weight = emb.weight
        new._init_qat(block_size, scale_rule, mask_saturated, anchor_format)
        return new

    def to_embedding(self) -> nn.Embedding:
        """A plain nn.Embedding sharing this module's weight."""
        emb = nn.Embedding.__new__(nn.Embedding)
        nn.Module.__init__(emb)
        for k in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                  "scale_grad_by_freq", "sparse"):
            setattr(emb, k, getattr(self, k))
        emb.weight = self.weight
        return emb

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.quantized_weight(), self.padding_idx, self.max_norm, self.norm_type,
                          self.scale_grad_by_freq, self.sparse)
        return self.with_every_learned_scale(out)
