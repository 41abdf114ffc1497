"""The ``search`` scale rule's recorded input importance as one checkpointable object.

Each MF-QAT Linear sums the squared inputs of its anchor-format training forwards
(:meth:`mfqat.qat.modules.MFQATMixin.importance`); these sums are plain attributes, not part of the
``state_dict`` (whose keys stay those of the plain model). :class:`ImportanceStatistic` gathers them
so that a training checkpoint carries them - one file per process (:func:`state_file`), since
under DDP each rank records its own inputs - and a resumed run continues the statistic where it
stopped: bit for bit the uninterrupted run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

from torch import nn

from .prepare import qat_modules


class ImportanceStatistic:
    """``state_dict`` / ``load_state_dict`` over every MF-QAT Linear's importance sums of ``model``."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> Dict[str, dict]:
        """{module name: {"sum": float64 (in_features,) on CPU, "tokens": int}} for every module
        that has recorded inputs."""
        return {name: {"sum": m.importance_sum.detach().cpu(), "tokens": int(m.importance_tokens)}
                for name, m in qat_modules(self.model)
                if getattr(m, "importance_tokens", 0) and m.importance_sum is not None}

    def load_state_dict(self, state: Dict[str, dict]) -> None:
        """Restore the sums (on each module's weight device); modules absent from ``state`` start empty."""
        for name, m in qat_modules(self.model):
            if not hasattr(m, "importance_tokens"):
                continue
            entry = state.get(name)
            m.importance_sum = None if entry is None else entry["sum"].to(m.weight.device)
            m.importance_tokens = 0 if entry is None else int(entry["tokens"])
            m._search_cache = None


def uses_search(model: nn.Module) -> bool:
    """Whether any MF-QAT module of ``model`` lowers a format with the ``search`` rule."""
    return any(getattr(m, "tracks_importance", False) for _, m in qat_modules(model))


def state_file(folder: Union[str, Path], rank: int) -> Path:
    """Where a training checkpoint keeps rank ``rank``'s importance sums."""
    return Path(folder) / f"mfqat_importance_rank{rank}.pt"
