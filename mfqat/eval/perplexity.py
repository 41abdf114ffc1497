"""Deterministic perplexity on held-out text, and elastic evaluation over formats."""
from __future__ import annotations

import math
from typing import Dict, Iterable, Optional

import torch
from torch import nn

from mfqat.progress import progress as progress_bar


@torch.no_grad()
def mean_nll(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, desc: Optional[str] = None) -> float:
    """Mean next-token negative log-likelihood over (n, seq_len) blocks of token ids, in eval mode; every
    submodule is left in the train/eval mode it had (also when the forward raises)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        device = next(model.parameters()).device
        if device.type == "meta":  # weights put in as each module runs (mfqat.export.lazy_model): on the CPU
            device = torch.device("cpu")
        total, count = 0.0, 0
        batches = range(0, blocks.shape[0], batch_size)
        for i in progress_bar(batches, desc=desc, leave=False, disable=desc is None):
            ids = blocks[i:i + batch_size].to(device)
            logits = model(input_ids=ids).logits.float()
            nll = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                              ids[:, 1:].reshape(-1), reduction="sum")
            total += nll.item()
            count += ids[:, 1:].numel()
    finally:
        for m, training in modes:
            m.training = training
    return total / max(count, 1)


def perplexity(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, desc: Optional[str] = None) -> float:
    """exp(mean NLL) over the blocks (fixed token budget = blocks.numel())."""
    return math.exp(mean_nll(model, blocks, batch_size, desc))


def elastic_perplexity(model: nn.Module, formats: Iterable[Optional[str]], blocks: torch.Tensor,
                       batch_size: int = 4, progress: bool = True) -> Dict[str, float]:
    """Perplexity of a prepared model at each format (None = full precision)."""
    from mfqat.qat.prepare import set_format

    out: Dict[str, float] = {}
    for fmt in formats:
        set_format(model, fmt)
        out[fmt or "fp"] = perplexity(model, blocks, batch_size, desc=f"ppl {fmt or 'fp'}" if progress else None)
    return out


def perplexity_with_state(model: nn.Module, state: Dict[str, torch.Tensor], blocks: torch.Tensor,
                          batch_size: int = 4, desc: Optional[str] = None) -> float:
    """Perplexity after loading ``state`` (a partial state dict) into the model in place."""
    model.load_state_dict(state, strict=False)
    return perplexity(model, blocks, batch_size, desc)
