"""`mfqat mlx-train` runtime: memory limits, peak memory, activation checkpointing, resumable checkpoints.

Real MLX APIs only: ``mx.set_memory_limit`` / ``mx.set_cache_limit`` / ``mx.get_peak_memory`` and
``mx.checkpoint`` (recompute a block's activations in the backward pass).

A checkpoint folder (``OUT/checkpoint-STEP``) holds ``model.safetensors`` (every parameter),
``optimizer.safetensors`` (the optimizer state, step counter included) and ``mlx_step.json`` (the
step and a sha256 manifest of both, mfqat.storage.train_checkpoint); a resume verifies it first, and a
run resumed from it skips the batches already seen, so it gives the uninterrupted run's losses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from mfqat.storage.io import atomic_directory
from mfqat.storage.train_checkpoint import seal_checkpoint, verify_checkpoint

GIB = 1024 ** 3


def set_limits(memory_gib: Optional[float], cache_gib: Optional[float]) -> Dict[str, float]:
    """Apply ``--memory-limit`` / ``--cache-limit`` (GiB); return those set, for the summary."""
    for name, v in (("--memory-limit", memory_gib), ("--cache-limit", cache_gib)):
        if v is not None and v < 0:
            raise ValueError(f"mlx-train {name} {v}: give a size in GiB >= 0")
    out = {}
    if memory_gib is not None:
        mx.set_memory_limit(int(memory_gib * GIB))
        out["memory_limit_gib"] = memory_gib
    if cache_gib is not None:
        mx.set_cache_limit(int(cache_gib * GIB))
        out["cache_limit_gib"] = cache_gib
    return out


def peak_memory_mib() -> float:
    """MLX's peak allocated memory since the process started (or the last reset), in MiB."""
    return mx.get_peak_memory() / 2 ** 20


def _checkpointed_call(self, *args, **kwargs):
    """A block's forward under ``mx.checkpoint``: its activations are recomputed in backward."""
    base_call = type(self).__mro__[1].__call__

    def inner(params, *a, **kw):
        self.update(params)
        return base_call(self, *a, **kw)
    return mx.checkpoint(inner)(self.trainable_parameters(), *args, **kwargs)


def checkpoint_layers(model: nn.Module) -> int:
    """Recompute each decoder block's activations in backward (``--grad-checkpoint``); returns the
    number of blocks. Only these instances change (a per-instance subclass), not their class."""
    layers = getattr(model, "layers", None)
    if not layers:
        raise ValueError("--grad-checkpoint: the model has no .layers list of decoder blocks to checkpoint")
    for layer in layers:
        cls = type(layer)
        if not cls.__name__.startswith("Checkpointed"):
            layer.__class__ = type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": _checkpointed_call})
    return len(layers)


def save_checkpoint(folder: Path, model: nn.Module, opt: optim.Optimizer, step: int) -> Path:
    """Model parameters + optimizer state + step, written atomically."""
    with atomic_directory(folder, overwrite=True, kind="mlx-checkpoint") as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
        seal_checkpoint(tmp, step, "mlx_step.json")
    return folder


def load_checkpoint(folder: Path, model: nn.Module, opt: optim.Optimizer) -> int:
    """Restore what :func:`save_checkpoint` wrote into ``model`` and ``opt``; return the step."""
    folder = Path(folder)
    need = [folder / n for n in ("model.safetensors", "optimizer.safetensors", "mlx_step.json")]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"--resume {folder}: not an mlx-train checkpoint (missing {', '.join(missing)}); "
                                "give an OUT/checkpoint-STEP folder written with --save-every")
    step = verify_checkpoint(folder, "mlx_step.json")
    try:
        model.load_weights(str(need[0]), strict=True)
    except ValueError as e:
        raise ValueError(f"--resume {folder}: the checkpoint does not fit this model ({str(e).splitlines()[0]})") from None
    opt.state = tree_unflatten(list(mx.load(str(need[1])).items()))
    mx.eval(model.parameters(), opt.state)
    return step


def summary_memory(limits: Dict[str, float]) -> Tuple[str, Dict[str, float]]:
    """(a line for the run's last print, the summary.json entries) of peak memory and limits."""
    peak = peak_memory_mib()
    return f"peak memory={peak:.0f} MiB", {"peak_memory_mib": peak, **{k: float(v) for k, v in limits.items()}}
