"""The ``search`` scale rule's recorded input importance: synced across processes, checkpointable.

Each MF-QAT Linear sums the squared inputs of its anchor-format training forwards into *pending*
records, which are *folded* into the statistic the search weighs its error with
(:meth:`mfqat.qat.modules.MFQATMixin.importance`) once per weight update, so the searched
exponents stay fixed for all micro-batches of an optimizer step. In one process the fold happens by
itself (at the first search after the weight changed). Under torch.distributed each rank sees other
inputs, so :func:`sync_importance` - called before each ``optimizer.step()`` by mfqat's training
loop and by ``MFQATCallback`` - all-reduces the pending records (one collective) and folds the sum:
every rank then searches with the same importance, and rank 0's anchor stores it.

These sums are plain attributes, not part of the ``state_dict`` (whose keys stay those of the plain
model). :class:`ImportanceStatistic` gathers them so that a training checkpoint carries them - one
file per process (:func:`state_file`) - and a resumed run continues the statistic where it stopped:
bit for bit the uninterrupted run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Union

import torch
from torch import nn

from mfqat.storage.io import write_torch
from mfqat.qat.modules import several_processes
from mfqat.qat.prepare import qat_modules


class ImportanceStatistic:
    """``state_dict`` / ``load_state_dict`` over every MF-QAT Linear's importance sums of ``model``."""

    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> Dict[str, dict]:
        """{module name: {"sum": float64 (in_features,) on CPU, "tokens": int, "pending_sum",
        "pending_tokens"}} for every module that has recorded inputs (None sums where none)."""
        cpu = lambda t: None if t is None else t.detach().cpu()  # noqa: E731
        return {name: {"sum": cpu(m.importance_sum), "tokens": int(m.importance_tokens),
                       "pending_sum": cpu(m.pending_sum), "pending_tokens": int(m.pending_tokens)}
                for name, m in qat_modules(self.model)
                if getattr(m, "importance_tokens", 0) or getattr(m, "pending_tokens", 0)}

    def load_state_dict(self, state: Dict[str, dict]) -> None:
        """Restore the sums (on each module's weight device); modules absent from ``state`` start empty."""
        for name, m in qat_modules(self.model):
            if not hasattr(m, "importance_tokens"):
                continue
            entry = state.get(name) or {}
            dev = lambda t: None if t is None else t.to(m.weight.device)  # noqa: E731
            m.importance_sum, m.importance_tokens = dev(entry.get("sum")), int(entry.get("tokens", 0))
            m.pending_sum, m.pending_tokens = dev(entry.get("pending_sum")), int(entry.get("pending_tokens", 0))
            m._search_cache, m._searched_key = None, None


def sync_importance(model: nn.Module) -> None:
    """Fold every MF-QAT module's pending importance records into the statistic its search uses,
    summed over all processes by one ``all_reduce`` under torch.distributed (call it on every rank
    before each ``optimizer.step()``; in one process it only folds). A no-op without the search rule."""
    mods = [m for _, m in qat_modules(model) if getattr(m, "tracks_importance", False)]
    if not mods:
        return
    if not several_processes():
        for m in mods:
            m.fold_importance()
        return
    nccl = torch.distributed.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    sums = [torch.zeros(input_width(m), dtype=torch.float64, device=dev) if m.pending_sum is None
            else m.pending_sum.to(dev) for m in mods]
    tokens = torch.tensor([float(m.pending_tokens) for m in mods], dtype=torch.float64, device=dev)
    flat = torch.cat(sums + [tokens])  # one collective for the whole model
    torch.distributed.all_reduce(flat)
    totals = flat[-len(mods):].tolist()
    for m, part, n in zip(mods, torch.split(flat[:-len(mods)], [s.numel() for s in sums]), totals):
        home = m.importance_sum.device if m.importance_sum is not None else part.device
        m.fold_importance((part.to(home, copy=True), int(n)))


def forget_searched_exponents(model: nn.Module) -> None:
    """Drop the exponents each MF-QAT module keeps for its searched formats, so the next forward
    searches again: needed only after weights were edited through ``.data`` (which neither bumps their
    version nor steps an optimizer), e.g. an EMA copy or an in-place adapter merge."""
    for _, m in qat_modules(model):
        if hasattr(m, "_search_cache"):
            m._search_cache = None


def input_width(module: nn.Module) -> int:
    """Input columns of an MF-QAT module (not its weight's local shape, which a sharded weight changes)."""
    width = getattr(module, "in_features", None) or getattr(module, "embedding_dim", None)
    return int(width if width is not None else module.weight.shape[-1])


def uses_search(model: nn.Module) -> bool:
    """Whether any MF-QAT module of ``model`` lowers a format with the ``search`` rule."""
    return any(getattr(m, "tracks_importance", False) for _, m in qat_modules(model))


def state_file(folder: Union[str, Path], rank: int) -> Path:
    """Where a training checkpoint keeps rank ``rank``'s importance sums."""
    return Path(folder) / f"mfqat_importance_rank{rank}.pt"


def save_state(model: nn.Module, folder: Union[str, Path], rank: int) -> Path:
    """Write ``model``'s importance sums for rank ``rank`` into a checkpoint folder (atomically)."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = state_file(folder, rank)
    write_torch(path, ImportanceStatistic(model).state_dict())
    return path


def load_state(model: nn.Module, folder: Union[str, Path], rank: int) -> bool:
    """Restore rank ``rank``'s importance sums from a checkpoint folder; False when it has none.

    A rank without a file of its own (the run is resumed with more processes) takes rank 0's folded
    sums, which every rank shares, without rank 0's pending records."""
    path = state_file(folder, rank)
    own = path.is_file()
    if not own:
        path = state_file(folder, 0)
        if not path.is_file():
            return False
    try:
        state = torch.load(path, weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"{path}: cannot read the importance sums of this checkpoint ({exc}); delete the file "
                           f"to restart the statistic, or resume from another checkpoint") from exc
    if not own:
        state = {name: {**entry, "pending_sum": None, "pending_tokens": 0} for name, entry in state.items()}
    ImportanceStatistic(model).load_state_dict(state)
    return True
