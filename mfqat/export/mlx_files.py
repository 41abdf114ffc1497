"""The files of an MLX export: safetensors written and read with MLX, sharded in the HF layout
(``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``) above ``max_shard_bytes``."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Dict, List

from ..anchor import MAX_SHARD_BYTES
from ..io import write_json

if TYPE_CHECKING:
    import mlx.core as mx


def save_sharded(arrays: Dict[str, "mx.array"], folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> List[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json (the HF
    layout, which mlx_lm.load reads) when the weights exceed ``max_shard_bytes``."""
    import mlx.core as mx

    shards: List[Dict[str, "mx.array"]] = [{}]
    size = 0
    for name in sorted(arrays):
        nbytes = arrays[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arrays[name]
        size += nbytes
    if len(shards) == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return ["model.safetensors"]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(files, shards):
        mx.save_safetensors(str(folder / fname), shard, metadata={"format": "mlx"})
        weight_map.update({k: fname for k in shard})
    write_json(folder / "model.safetensors.index.json",
               {"metadata": {"total_size": sum(a.nbytes for a in arrays.values())}, "weight_map": weight_map})
    return files


def load_weights(folder: Path) -> Dict[str, "mx.array"]:
    """Every tensor of an export (one file or shards)."""
    import mlx.core as mx

    weights: Dict[str, "mx.array"] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights
