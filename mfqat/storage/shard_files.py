"""The HF safetensors layout shared by anchors (torch) and MLX exports: one ``model.safetensors``,
or ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json`` above a size."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List

from mfqat.storage.io import write_json

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024 ** 3


def plan_shards(sizes: Dict[str, int], max_bytes: int) -> List[List[str]]:
    """Tensor names grouped into shards of at most ``max_bytes`` (in ``sizes``' order; a tensor
    larger than ``max_bytes`` gets a shard of its own)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, nbytes in sizes.items():
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_names(n: int) -> List[str]:
    """The file names of ``n`` shards (one: model.safetensors)."""
    return [WEIGHTS_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def write_index(folder: Path, files: List[str], shards: List[List[str]], total_bytes: int) -> None:
    """model.safetensors.index.json for sharded weights (nothing for a single file)."""
    if len(files) > 1:
        weight_map = {name: f for f, names in zip(files, shards) for name in names}
        write_json(folder / INDEX_FILE, {"metadata": {"total_size": total_bytes}, "weight_map": weight_map})
