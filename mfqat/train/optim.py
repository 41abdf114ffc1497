"""Optimizers of `mfqat train`: torch AdamW, or bitsandbytes' 8-bit / paged 8-bit AdamW.

An optimizer that cannot be built is an error naming the cause and the alternative, never a
silent fallback to AdamW (which would change memory and numerics without saying so).
"""
from __future__ import annotations

from typing import Iterable

import torch

OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")


def make_optimizer(name: str, params: Iterable, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW (``adamw``), bitsandbytes AdamW8bit (``adamw8bit``) or PagedAdamW8bit (``paged_adamw8bit``)
    over ``params``: parameters, or parameter groups (dicts, e.g. :func:`mfqat.qat.learned_scales.param_groups`).

    Raises ValueError for an unknown name and RuntimeError when bitsandbytes is missing or its
    optimizer cannot be built on this machine.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"--optim {name!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise RuntimeError(f"--optim {name} needs bitsandbytes ({e}); pip install bitsandbytes, "
                           f"or use --optim adamw") from None
    cls = bnb.optim.AdamW8bit if name == "adamw8bit" else bnb.optim.PagedAdamW8bit
    try:
        return cls(params, lr=lr, weight_decay=weight_decay)
    except Exception as e:  # bnb builds without a kernel for this device raise various types
        raise RuntimeError(f"--optim {name}: bitsandbytes.optim.{cls.__name__} cannot be built here "
                           f"({type(e).__name__}: {e}); use --optim adamw") from None
