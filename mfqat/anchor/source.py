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

FP8 releases (DeepSeek-V3, the Qwen FP8 checkpoints: float8 e4m3 weights, each with a float32
``<weight>_scale_inv`` per block) are read dequantized: each such weight is multiplied by its block scales
when it is read (transformers' own ``Fp8Dequantize`` arithmetic, to float32, what ``from_pretrained(...,
dequantize=True)`` gives a float32 model), before any stacking; the scales (and static activation scales)
are not model tensors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from mfqat.storage.io import PathLike
from mfqat.storage.shard_files import INDEX_FILE, WEIGHTS_FILE
from mfqat.storage.tensor_files import TensorFile, TensorFileError, TensorInfo


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
ACTIVATION_SCALES = ("activation_scale", "input_scale")  # a static FP8 scheme's, used by no float model


def fp8_scales(where: Dict[str, Tuple[TensorFile, TensorInfo]]) -> Dict[str, str]:
    """{stored FP8 weight: its stored ``<weight>_scale_inv``} among a checkpoint's tensors (empty for a float one)."""
    return {k[: -len(SCALE_SUFFIX)]: k for k in where if k.endswith(SCALE_SUFFIX)
            and k[: -len(SCALE_SUFFIX)] in where and where[k[: -len(SCALE_SUFFIX)]][1].dtype in FP8_DTYPES}


def fp8_dequantized(codes: torch.Tensor, scale_inv: torch.Tensor, where: str) -> torch.Tensor:
    """An FP8 weight times its per-block scales, in float32: transformers' ``Fp8Dequantize`` (what a float32
    ``from_pretrained`` of the checkpoint holds). ValueError naming the tensor when the grids do not divide."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    try:
        return Fp8Dequantize(None)._dequantize_one(codes, scale_inv, output_dtype=torch.float32)
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"{where}: FP8 weight {tuple(codes.shape)} with scales {tuple(scale_inv.shape)}: {str(e).rstrip('.')}; the "
                         "checkpoint is corrupt or not a block-scaled FP8 release") from None


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
        self.scale_of = fp8_scales(self.where)  # an FP8 weight's stored name -> its block scales' stored name
        self.companions = set(self.scale_of.values()) | ({k for k in self.where if k.endswith(ACTIVATION_SCALES)}
                                                          if self.scale_of else set())
        self.renamed: Dict[str, str] = {k: k for k in self.where if k not in self.companions}  # model -> stored name
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
        for stored in (k for k in self.where if k not in self.companions):
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
        value = self.where[stored][0].read(stored)
        scale = self.scale_of.get(stored)
        if scale is None:
            return value
        return fp8_dequantized(value, self.where[scale][0].read(scale), f"{self.where[stored][0].where}: {stored}")

    def location(self, name: str) -> Optional[Tuple[TensorFile, TensorInfo]]:
        """(file, header entry) of a tensor stored as it is used (None for a fused one, or an FP8 one: those are
        built when read)."""
        stored = self.renamed.get(name)
        return None if stored is None or stored in self.scale_of else self.where[stored]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype ``name`` is read in: its stored dtype, float32 for an FP8 weight (dequantized), and a fused
        parameter's that of its first stored tensor."""
        stored = next(k for keys in self.fused[name].sources.values() for k in keys) if name in self.fused \
            else self.renamed[name]
        return torch.float32 if stored in self.scale_of else self.where[stored][1].dtype

    def shape(self, name: str) -> Tuple[int, ...]:
        """The shape ``name`` has once read (a fused one's from its operations on meta tensors, nothing read)."""
        if name not in self.fused:
            return tuple(self.where[self.renamed[name]][1].shape)
        meta = lambda k: torch.empty(self.where[k][1].shape, dtype=torch.float32 if k in self.scale_of  # noqa: E731
                                     else self.where[k][1].dtype, device="meta")
        return tuple(self.fused[name].build(meta, name).shape)

    def close(self) -> None:
        """Release the files."""
        for f in self.files:
            f.close()

    def __enter__(self) -> "SourceCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
