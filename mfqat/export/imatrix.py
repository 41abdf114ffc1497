"""Read a llama.cpp importance-matrix GGUF (``llama-imatrix -o imatrix.gguf``, as Unsloth publishes them)
as AWQ's per-channel importance.

llama.cpp's GGUF imatrix layout (tools/imatrix, ``general.type = "imatrix"``): for every matrix
``<name>`` (a GGUF tensor name such as ``blk.3.ffn_down.weight``) two float32 tensors,
``<name>.in_sum2`` (ne = [in_features, n_mat]: the sum over tokens of the squared input activation)
and ``<name>.counts`` (ne = [1, n_mat]: how many tokens were summed). ``in_sum2 / counts`` is the mean
squared input activation per input channel, which is what :func:`mfqat.anchor.importance.importance_matrix`
measures. Expert stacks (n_mat > 1) are pooled (sums over sums / counts over counts); AWQ only
rescales dense layers. GGUF names are mapped to the model's module names with gguf-py's
:func:`gguf.get_tensor_name_map` for the model's architecture. The legacy ``.dat`` format is refused.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable

import numpy as np
import torch
from torch import nn

SUMS, COUNTS = ".in_sum2", ".counts"


def read_imatrix(path) -> Dict[str, torch.Tensor]:
    """GGUF tensor name -> mean squared input activation (float32, (in_features,)) of an imatrix GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such imatrix file (pass a llama.cpp imatrix .gguf)")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # gguf-py raises ValueError/struct/numpy errors on truncated or foreign files
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); legacy llama.cpp "
                         "imatrix.dat files are not supported: convert with llama-imatrix --in-file X.dat "
                         "-o imatrix.gguf") from exc
    kind = reader.fields.get(gguf.Keys.General.TYPE)
    if kind is None or kind.contents() != gguf.GGUFType.IMATRIX:
        found = kind.contents() if kind is not None else "none"
        raise ValueError(f"{path}: a GGUF of general.type {found!r}, not an importance matrix (\"imatrix\")")
    tensors = {t.name: t for t in reader.tensors}
    out: Dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.endswith(SUMS):
            continue
        base = name[: -len(SUMS)]
        c = tensors.get(base + COUNTS)
        if c is None:
            raise ValueError(f"{path}: tensor {name} has no {base + COUNTS}; the imatrix is incomplete")
        sums = np.asarray(t.data, dtype=np.float32).reshape(-1, int(t.shape[0]))
        counts = np.asarray(c.data, dtype=np.float32).reshape(-1)
        if sums.shape[0] != counts.shape[0] or not (counts > 0).all():
            raise ValueError(f"{path}: tensor {base}: {sums.shape[0]} in_sum2 rows but counts {counts.tolist()}")
        if sums.shape[0] == 1:  # dense: exactly in_sum2 / counts in float32, as llama.cpp computes it
            out[base] = torch.from_numpy(sums[0] / counts[0])
        else:
            out[base] = torch.from_numpy(sums.sum(0) / counts.sum())
    if not out:
        raise ValueError(f"{path}: no '*{SUMS}' tensors; not a llama.cpp imatrix")
    return out


def _arch(model: nn.Module):
    import gguf

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for arch, name in gguf.MODEL_ARCH_NAMES.items():
        if name == model_type:
            return arch
    raise ValueError(f"imatrix: gguf-py has no tensor-name map for model_type {model_type!r}")


def imatrix_for_model(model: nn.Module, path, modules: Iterable[str]) -> Dict[str, torch.Tensor]:
    """Importance of each named nn.Linear in ``modules`` (HF module names), read from the imatrix at ``path``.

    Raises ValueError naming the file and the missing GGUF tensor (and the module it stands for), or a
    width that does not match the module's ``in_features``."""
    import gguf

    table = read_imatrix(path)
    n_layers = getattr(model.config, "num_hidden_layers", None) or 0
    names = gguf.get_tensor_name_map(_arch(model), n_layers)
    out: Dict[str, torch.Tensor] = {}
    for module in modules:
        gg = names.get_name(module)
        if gg is None:
            raise ValueError(f"imatrix: no GGUF name for module {module} (gguf-py's {_arch(model).name} map)")
        key = gg + ".weight"
        if key not in table:
            raise ValueError(f"{path}: no tensor {key}{SUMS} (needed for {module}); was the imatrix computed "
                             "for this model?")
        width = model.get_submodule(module).in_features
        if table[key].numel() != width:
            raise ValueError(f"{path}: tensor {key}{SUMS} has {table[key].numel()} channels, {module} has {width} "
                             "input features; the imatrix is for a different model")
        if not torch.isfinite(table[key]).all() or (table[key] < 0).any():
            raise ValueError(f"{path}: tensor {key}{SUMS} (for {module}) holds negative, NaN or Inf values; a mean "
                             "squared activation cannot: the imatrix is corrupt, compute it again")
        out[module] = table[key]
    return out
