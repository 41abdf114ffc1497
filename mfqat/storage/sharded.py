"""Sharded (FSDP2) models: the gathered full state dict an anchor is written from.

FSDP2 (``torch.distributed.fsdp.fully_shard``, or accelerate's FSDP plugin) turns every parameter
into a DTensor holding this rank's shard; ``model.state_dict()`` then returns those shards, which
have no local storage to quantize or to tell tied weights apart. :func:`full_state_dict` gathers
them (a collective: call it on every rank) into full CPU tensors on rank 0, which
``save_anchor(model, ..., state_dict=sd)`` then writes. ``mfqat.anchor.sharded_save.save_anchor_sharded``
saves the anchor without it: each rank gathers, quantizes and writes only the tensors it owns.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn


def is_sharded(model: nn.Module) -> bool:
    """True when some parameter of ``model`` is a DTensor shard (FSDP2 / tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The full, unsharded state dict of a sharded model, on CPU, on rank 0 (other ranks get {}).

    A collective: every rank must call it (e.g. before ``if accelerator.is_main_process:
    save_anchor(model, ..., state_dict=sd)``), or the gather waits forever. An unsharded model
    returns its own state dict.
    """
    if not is_sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def parameter_aliases(model: nn.Module) -> Dict[str, str]:
    """{alias: first name} for parameters registered under several names (tied embeddings)."""
    first: Dict[int, str] = {}
    aliases: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def unique_state_dict(model: nn.Module, state_dict: Optional[Dict[str, torch.Tensor]] = None
                      ) -> tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """State dict without tied duplicates, plus {alias: kept name}. A gathered ``state_dict`` (of a
    sharded model) holds copies, so its ties are read from the model's parameters instead."""
    if state_dict is not None:
        tied = {k: v for k, v in parameter_aliases(model).items() if v in state_dict}
        return {k: v.detach() for k, v in state_dict.items() if k not in tied}, tied
    if is_sharded(model):
        raise ValueError("mfqat.save_anchor: the model is sharded (FSDP2 DTensor parameters); gather it on "
                         "every rank with sd = mfqat.storage.sharded.full_state_dict(model), then call "
                         "save_anchor(model, ..., state_dict=sd) on rank 0, or call "
                         "mfqat.anchor.sharded_save.save_anchor_sharded(model, ...) on every rank")
    seen: Dict[int, str] = {}
    out: Dict[str, torch.Tensor] = {}
    tied: Dict[str, str] = {}
    for k, v in model.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        ptr = hash(key)
        if ptr in seen:
            tied[k] = seen[ptr]
            continue
        seen[ptr] = k
        out[k] = v.detach()
    return out, tied
