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


def _arch(model_type):
    import gguf

    from mfqat.models import family_for

    name = family_for(model_type).gguf_arch or model_type  # gguf-py's name (qwen35 for Qwen3.5's qwen3_5)
    for arch, arch_name in gguf.MODEL_ARCH_NAMES.items():
        if arch_name == name:
            return arch
    raise ValueError(f"imatrix: gguf-py has no tensor-name map for model_type {model_type!r}")


def imatrix_for_model(model: nn.Module, path, modules: Iterable[str]) -> Dict[str, torch.Tensor]:
    """Importance of each named nn.Linear in ``modules`` (HF module names), read from the imatrix at ``path``.

    Raises ValueError naming the file and the missing GGUF tensor (and the module it stands for), or a
    width that does not match the module's ``in_features``."""
    config = model.config
    n_layers = getattr(config.get_text_config(), "num_hidden_layers", None) or 0
    widths = {m: model.get_submodule(m).in_features for m in modules}
    return imatrix_for_modules(path, config.model_type, n_layers, widths)


def imatrix_for_modules(path, model_type: str, n_layers: int, widths: Dict[str, int]) -> Dict[str, torch.Tensor]:
    """Importance of each module of ``widths`` ({HF module name: in_features}) of a ``model_type`` model with
    ``n_layers`` decoder layers, read from the imatrix at ``path`` (no model needed: an anchor's shapes do).
    Names go through the family's ``gguf_module`` (a vision-language release's ``model.language_model.``)."""
    import gguf

    from mfqat.models import family_for

    table = read_imatrix(path)
    arch = _arch(model_type)
    names = gguf.get_tensor_name_map(arch, n_layers)
    family = family_for(model_type)
    out: Dict[str, torch.Tensor] = {}
    for module, width in widths.items():
        gg = names.get_name(family.gguf_module(module))
        if gg is None:
            raise ValueError(f"imatrix: no GGUF name for module {module} (gguf-py's {arch.name} map)")
        key = gg + ".weight"
        if key not in table:
            raise ValueError(f"{path}: no tensor {key}{SUMS} (needed for {module}); was the imatrix computed "
                             "for this model?")
        if table[key].numel() != width:
            raise ValueError(f"{path}: tensor {key}{SUMS} has {table[key].numel()} channels, {module} has {width} "
                             "input features; the imatrix is for a different model")
        if not torch.isfinite(table[key]).all() or (table[key] < 0).any():
            raise ValueError(f"{path}: tensor {key}{SUMS} (for {module}) holds negative, NaN or Inf values; a mean "
                             "squared activation cannot: the imatrix is corrupt, compute it again")
        out[module] = table[key]
    return out
