"""The joint MF-QAT step: several formats' losses in one optimizer step, one backward each.

    loss = sum_f w_f * L_f / sum_f w_f,   L_f = (1 - a) * CE_f + a * KL(p_top || p_f)  (f below top)

where f runs over the step's formats (highest first, see ``MFQATController.step_formats``),
``w_f`` are ``QATConfig.loss_weights`` and ``a`` is ``QATConfig.distill_weight``; the teacher
``p_top`` is the same step's highest-format branch, detached (no extra forward). Each format's
share is backpropagated on its own, so autograd holds one pass at a time (peak memory of a
single-format step) and the accumulated gradient equals that of the weighted sum.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mfqat.qat.prepare import set_format


def token_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student) between next-token distributions."""
    vocab = student_logits.shape[-1]
    return F.kl_div(F.log_softmax(student_logits.float().reshape(-1, vocab), -1),
                    F.log_softmax(teacher_logits.float().reshape(-1, vocab), -1),
                    log_target=True, reduction="batchmean")


def normalized_weights(formats: List[str], weight_of: Callable[[str], float]) -> Dict[str, float]:
    """{format: w_f / sum w} for the step's formats (an error when they all weigh 0)."""
    raw = {f: float(weight_of(f)) for f in formats}
    total = sum(raw.values())
    if total <= 0:
        raise ValueError(f"the joint loss weights of {formats} sum to 0; give one of them a positive weight")
    return {f: w / total for f, w in raw.items()}


def joint_backward(model: nn.Module, base: nn.Module, inputs: Dict[str, torch.Tensor], formats: List[str],
                   weight_of: Callable[[str], float], backward: Callable[[torch.Tensor], None],
                   distill_weight: float = 0.0, scale: float = 1.0,
                   no_sync: Optional[Callable[[], ContextManager]] = None) -> Dict[str, float]:
    """Run forward + backward once per format of ``formats`` (highest first) and return each
    format's loss L_f (un-weighted, for logging).

    Args:
        model: what is called (may be a DDP / accelerate wrapper); ``base``: the prepared model
            whose MF-QAT modules get each format.
        inputs: model keyword arguments, including ``labels``.
        weight_of: the per-format loss weight (``QATConfig.weight_of``).
        backward: e.g. ``accelerator.backward`` or ``lambda l: l.backward()``.
        scale: extra factor on every backpropagated loss (1 / gradient-accumulation steps).
        no_sync: a context manager factory that skips gradient all-reduce (DDP ``no_sync``);
            used for every backward but the last, so gradients are reduced once per step.
    """
    weights = normalized_weights(formats, weight_of)
    losses: Dict[str, float] = {}
    teacher: Optional[torch.Tensor] = None
    for i, fmt in enumerate(formats):
        set_format(base, fmt)
        last = i == len(formats) - 1
        ctx = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with ctx:
            out = model(**inputs)
            loss = out.loss
            if distill_weight and teacher is not None:
                loss = (1 - distill_weight) * loss + distill_weight * token_kl(out.logits, teacher)
            if distill_weight and teacher is None and not last:
                teacher = out.logits.detach()
            backward(loss * (weights[fmt] * scale))
        losses[fmt] = loss.item()
        del out, loss
    return losses


def weighted_loss(losses: Dict[str, float], weight_of: Callable[[str], float]) -> float:
    """The joint objective's value from per-format losses."""
    weights = normalized_weights(list(losses), weight_of)
    return sum(weights[f] * v for f, v in losses.items())
