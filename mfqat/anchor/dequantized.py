"""One format of an anchor as a plain float32 Hugging Face checkpoint, one tensor at a time (``mfqat convert``).

``load_anchor(path, fmt).save_pretrained(out)`` holds the whole model in float32 (4 bytes a parameter, 12 GB
at 3B) beside the anchor's state dict. :func:`save_dequantized` writes the same checkpoint (the same tensor
names, the same float32 values bit for bit, the same config.json and generation_config.json) from a lazily
read anchor: the model's structure comes from its config on PyTorch's ``meta`` device (no memory), and each
quantized tensor is lowered (Slice-and-Scale, or derived) and dequantized as it is written
(mfqat.storage.tensor_files). Peak memory: one tensor in float32 and its lowering.

It applies when what ``save_pretrained`` writes is the model's own state dict less its tied aliases, every
tensor of it held by the anchor. :func:`why_not_streamed` says why not otherwise: transformers renames or
merges weights on save (the released per-expert MoE layouts), or the model has a tensor the anchor lacks (the
vision tower of a VL release whose anchor holds only the text model: ``from_config`` initialises it). The
caller then loads the model.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import List, Optional, Tuple, Union

import torch
from torch import nn

from mfqat.anchor.checkpoint import Anchor, model_class, warn_kept_full_precision
from mfqat.formats import canonical_name
from mfqat.progress import progress
from mfqat.quant.derive import DERIVED_GROUP_SIZE, check_reachable
from mfqat.storage.tensor_files import ShardWriter

__all__ = ["SAVE_PRETRAINED_SHARD_BYTES", "format_value", "save_dequantized", "why_not_streamed"]

SAVE_PRETRAINED_SHARD_BYTES = 50 * 10 ** 9  # save_pretrained's max_shard_size default ("50GB")


def _meta_model(anchor: Anchor) -> nn.Module:
    """The float32 model of the anchor's config on the meta device: what ``load_anchor`` builds, without memory."""
    auto, config = model_class(anchor)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return auto.from_config(config, dtype=torch.float32)


def _saved_names(model: nn.Module) -> Union[List[str], str]:
    """The state-dict names ``save_pretrained`` writes for ``model`` (its own, less tied aliases and the keys
    it ignores on save), or why they are not the model's own (a conversion on save)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    kept = remove_tied_weights_from_state_dict(state, model)
    try:
        saved = revert_weight_conversion(model, dict(kept))
    except Exception as e:  # a conversion that cannot run on meta tensors: it changes something
        return f"transformers converts its weights on save ({type(e).__name__})"
    if set(saved) != set(kept) or any(tuple(saved[k].shape) != tuple(kept[k].shape) for k in kept):
        return "transformers renames or merges its weights on save"
    return list(kept)


def _streamed(anchor: Anchor) -> Tuple[nn.Module, Union[List[str], str]]:
    """(the meta model, the names to write in order) or (the meta model, why they cannot be written one by one)."""
    model = _meta_model(anchor)
    names = _saved_names(model)
    if isinstance(names, str):
        return model, names
    held = set(anchor.quantized) | set(anchor.plain)
    missing = [k for k in names if k not in held]
    if missing:
        return model, f"the model has {len(missing)} tensor(s) the anchor does not hold ({missing[0]}, ...)"
    return model, names


def why_not_streamed(anchor: Anchor) -> Optional[str]:
    """None when :func:`save_dequantized` can write ``anchor`` tensor by tensor, else why not."""
    names = _streamed(anchor)[1]
    return names if isinstance(names, str) else None


def format_value(anchor: Anchor, name: str, fmt: Optional[str] = None, dtype: torch.dtype = torch.float32,
                 group_size: int = DERIVED_GROUP_SIZE) -> torch.Tensor:
    """Tensor ``name`` as a model of ``dtype`` loaded in ``fmt`` (None: the anchor's own) holds it: a quantized one
    lowered, dequantized to float32 and cast (as load_format copies it in), a plain one cast."""
    if name in anchor.quantized:
        return anchor.lowered(name, fmt, group_size).dequantize(torch.float32).to(dtype)
    value = anchor.plain[name]
    return value.to(dtype) if value.is_floating_point() else value


def save_dequantized(anchor: Anchor, out: Path, fmt: Optional[str] = None,
                     group_size: int = DERIVED_GROUP_SIZE) -> str:
    """Write ``fmt`` of ``anchor`` (None: its own format) into the folder ``out`` as ``save_pretrained`` of
    ``load_anchor(anchor.path, fmt)`` would, one tensor at a time; returns the format written. ValueError when
    the format is not reachable from the anchor, or when :func:`why_not_streamed` gives a reason."""
    if fmt is not None:
        check_reachable(anchor.format, canonical_name(fmt), name=str(anchor.path))
    model, names = _streamed(anchor)
    if isinstance(names, str):
        raise ValueError(f"{anchor.path}: cannot be converted tensor by tensor: {names}")
    warn_kept_full_precision(anchor, fmt, _stacklevel=2)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, SAVE_PRETRAINED_SHARD_BYTES)
    try:
        for name in progress(names, desc="convert", unit="tensor"):
            writer.add(name, format_value(anchor, name, fmt, torch.float32, group_size))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    model.config.architectures = [type(model).__name__]  # as save_pretrained records them (dtype: from_config's)
    model.config.save_pretrained(out)
    if model.can_generate():
        model.generation_config.save_pretrained(out)
    return fmt or anchor.format
