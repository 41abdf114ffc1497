"""The files of an MLX export: safetensors written and read with MLX, sharded in the HF layout
(``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``) above ``max_shard_bytes``."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

from mfqat.storage.shard_files import MAX_SHARD_BYTES, plan_shards, shard_file_names, write_index

if TYPE_CHECKING:
    import mlx.core as mx


def save_sharded(arrays: Dict[str, "mx.array"], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> List[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json (the HF
    layout, which mlx_lm.load reads) when the weights exceed ``max_shard_bytes``."""
    import mlx.core as mx

    sizes = {name: arrays[name].nbytes for name in sorted(arrays)}
    shards = plan_shards(sizes, max_shard_bytes)
    files = shard_file_names(len(shards))
    for fname, names in zip(files, shards):
        mx.save_safetensors(str(folder / fname), {k: arrays[k] for k in names}, metadata={"format": "mlx"})
    write_index(folder, files, shards, sum(sizes.values()))
    return files


def load_weights(folder: Path) -> Dict[str, "mx.array"]:
    """Every tensor of an export (one file or shards)."""
    import mlx.core as mx

    weights: Dict[str, "mx.array"] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights
