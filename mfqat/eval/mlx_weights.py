"""Evaluate an MLX model folder on its exact weights, in PyTorch.

MLX's CPU backend runs bfloat16 quantized matmuls very slowly (about 80 s per 256-token forward of
SmolLM2-135M on 2 cores; a Mac's GPU does not), so perplexity of an MLX export - ours or
``mlx_lm.convert``'s - is computed on the weights MLX holds: ``mx.dequantize`` of the stored codes,
scales and biases (bfloat16 arithmetic, as on a Mac), loaded into the PyTorch model. The exporter's
own verification shows MLX and PyTorch agree on the same weights.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict

import torch

from mfqat.eval.perplexity import perplexity
from mfqat.models import is_output_head


def stored_bits(folder: Path, n_params: int) -> float:
    """8 x bytes of the folder's safetensors files / ``n_params`` (what a user downloads)."""
    return 8 * sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / n_params


def mlx_weights_as_torch(folder: Path) -> Dict[str, torch.Tensor]:
    """Every weight of an MLX model folder exactly as ``mx.dequantize`` gives it from the stored
    codes, scales and biases, as float32 torch tensors under the HF names."""
    import mlx.core as mx
    import numpy as np

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text()).get("quantization", {})
    arrays = {}
    for f in sorted(folder.glob("*.safetensors")):
        arrays.update(mx.load(str(f)))
    out = {}
    for name, w in arrays.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is not None and f"{module}.scales" in arrays:
            q = cfg.get(module) if isinstance(cfg.get(module), dict) else cfg
            w = mx.dequantize(w, arrays[f"{module}.scales"], arrays.get(f"{module}.biases"), q["group_size"],
                              q["bits"], q.get("mode", "affine"))
        out[name] = torch.from_numpy(np.array(w.astype(mx.float32)))
    return out


def mlx_folder_perplexity(folder: Path, model, texts: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """{text: perplexity} of ``model`` (an HF model of the same architecture) with the folder's exact
    MLX weights loaded; the model's own weights are restored afterwards."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        missing, unexpected = model.load_state_dict(mlx_weights_as_torch(folder), strict=False)
        if unexpected or not all(is_output_head(k) for k in missing):
            raise ValueError(f"{folder}: weights do not fit the model (missing {missing[:3]}, unexpected "
                             f"{unexpected[:3]}); evaluate it with the model it was exported from")
        model.tie_weights()
        return {t: perplexity(model, blocks, desc=f"ppl {Path(folder).name} {t}") for t, blocks in texts.items()}
    finally:
        model.load_state_dict(saved)


def mlx_lm_convert(master: Path, dest: Path, **options) -> Path:
    """``mlx_lm.convert`` of an HF folder to bfloat16 + quantization (what a Mac user runs);
    ``options`` are convert's (q_bits, q_group_size, q_mode, quant_predicate). Reuses a finished dest."""
    from mlx_lm import convert

    dest = Path(dest)
    if not (dest / "config.json").is_file():
        shutil.rmtree(dest, ignore_errors=True)
        convert(str(master), str(dest), quantize=True, dtype="bfloat16", **options)
    return dest
