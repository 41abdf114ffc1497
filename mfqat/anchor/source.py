"""The safetensors weights of a Hugging Face folder, read tensor by tensor under the model's own names.

Released checkpoints do not always store a tensor under the name, or in the shape, that the model built
from their config holds it by: an MoE release stores each expert's projections as separate tensors
(``mlp.experts.7.gate_proj.weight``) that transformers stacks into one fused parameter on load
(``mlp.experts.gate_up_proj``, ``[E, 2 x I, H]``), and some families rename keys. transformers describes
these rewrites in its conversion mapping (``transformers.conversion_mapping``): renamings, and converters
whose operations (stack the experts, concatenate gate and up) build one parameter from many stored tensors.

:class:`SourceCheckpoint` applies that mapping to the names alone (nothing read) when given the model, and
builds a fused parameter when it is read: its stored tensors read one by one, in the order transformers
stacks them (numeric expert order), and put through the converter's own operations, so the value is the one
``from_pretrained`` would give. Memory: one parameter (and the stacking's copy), never the model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from mfqat.storage.io import PathLike
from mfqat.storage.shard_files import INDEX_FILE, WEIGHTS_FILE
from mfqat.storage.tensor_files import TensorFile, TensorFileError, TensorInfo


class _Fused:
    """A parameter built from several stored tensors by one transformers converter."""

    def __init__(self, converter):
        self.converter = converter
        self.sources: Dict[str, List[str]] = {p: [] for p in converter.source_patterns}

    def build(self, read, name: str) -> torch.Tensor:
        """The parameter: each source pattern's tensors (read by ``read``) through the converter's operations."""
        from transformers.core_model_loading import dot_natural_key

        collected = {p: [read(k) for k in sorted(keys, key=dot_natural_key)] for p, keys in self.sources.items()}
        conv = self.converter
        for op in conv.operations:
            collected = op.convert(collected, source_patterns=conv.source_patterns,
                                   target_patterns=conv.target_patterns, full_layer_name=name, model=None,
                                   config=None, missing_keys=None)
        (value,) = collected.values()
        return value


class SourceCheckpoint:
    """The safetensors weights of an HF folder (one file, or shards named by an index), read tensor by tensor.

    ``where`` maps each stored name to its file; after :meth:`map_to` (a model on the meta device), ``names``
    lists the model's parameter names the checkpoint provides, and :meth:`read`, :meth:`dtype` and
    :meth:`location` take those names (a renamed tensor is read under its model name, a fused one built)."""

    def __init__(self, folder: PathLike):
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e}); re-download the checkpoint") from None
        elif (self.folder / WEIGHTS_FILE).is_file():
            names = [WEIGHTS_FILE]
        else:
            names = []
        self.files = []
        try:
            for n in names:
                self.files.append(TensorFile.open(self.folder / n))
        except (TensorFileError, OSError) as e:
            self.close()
            raise ValueError(str(e)) from None
        self.where: Dict[str, Tuple[TensorFile, TensorInfo]] = {k: (f, i) for f in self.files
                                                                 for k, i in f.infos.items()}
        self.renamed: Dict[str, str] = {k: k for k in self.where}  # model name -> stored name
        self.fused: Dict[str, _Fused] = {}

    @property
    def names(self) -> List[str]:
        """The model names this checkpoint provides (stored ones, renamed, and fused parameters)."""
        return list(self.renamed) + list(self.fused)

    def map_to(self, model) -> None:
        """Name the stored tensors as ``model`` (a transformers model, on the meta device) holds them, by
        transformers' conversion mapping for the model's class and type (nothing is read)."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(model)
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        meta_sd = model.state_dict()
        self.renamed, self.fused = {}, {}
        for stored in self.where:
            name, pattern = rename_source_key(stored, renamings, converters, model.base_model_prefix, meta_sd)
            if pattern is None:
                self.renamed[name] = stored
                continue
            converter = next(c for c in converters if pattern in c.source_patterns)
            self.fused.setdefault(name, _Fused(converter)).sources[pattern].append(stored)

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (a model name) in its stored dtype."""
        if name in self.fused:
            return self.fused[name].build(self._read_stored, name)
        return self._read_stored(self.renamed[name])

    def _read_stored(self, stored: str) -> torch.Tensor:
        return self.where[stored][0].read(stored)

    def location(self, name: str) -> Optional[Tuple[TensorFile, TensorInfo]]:
        """(file, header entry) of a tensor stored as it is used (None for a fused one)."""
        stored = self.renamed.get(name)
        return None if stored is None else self.where[stored]

    def dtype(self, name: str) -> torch.dtype:
        """The stored dtype of ``name`` (a fused parameter's: its first stored tensor's)."""
        if name in self.fused:
            first = next(k for keys in self.fused[name].sources.values() for k in keys)
            return self.where[first][1].dtype
        return self.where[self.renamed[name]][1].dtype

    def shape(self, name: str) -> Tuple[int, ...]:
        """The shape ``name`` has once read (a fused one's from its operations on meta tensors, nothing read)."""
        if name not in self.fused:
            return tuple(self.where[self.renamed[name]][1].shape)
        meta = lambda k: torch.empty(self.where[k][1].shape, dtype=self.where[k][1].dtype, device="meta")  # noqa: E731
        return tuple(self.fused[name].build(meta, name).shape)

    def close(self) -> None:
        """Release the files."""
        for f in self.files:
            f.close()

    def __enter__(self) -> "SourceCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
