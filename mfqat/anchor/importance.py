"""Input-channel importance of every nn.Linear: the mean squared input activation on calibration text.

llama.cpp calls it the importance matrix ("imatrix"). ``export-mlx --awq`` scales channels by it
(mfqat.export.awq), and the output-aware scale search weighs each block's error by it
(mfqat.quant.scale_search, mfqat.anchor.search).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from mfqat.progress import progress


def activation_sums(model: nn.Module, blocks: torch.Tensor,
                    batch_size: int = 4) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
    """Per nn.Linear: the sum over tokens of the squared input activation (float32) and the token count
    (llama.cpp's ``in_sum2`` and ``counts``)."""
    sums: Dict[str, torch.Tensor] = {}
    counts: Dict[str, int] = {}
    hooks = []

    def hook(name):
        def fn(_mod, inputs, _out):
            x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.pow(2).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return fn

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            for i in progress(range(0, blocks.shape[0], batch_size), desc="imatrix", leave=False):
                model(input_ids=blocks[i:i + batch_size])
    finally:
        for h in hooks:
            h.remove()
    return sums, counts


def importance_matrix(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4) -> Dict[str, torch.Tensor]:
    """Mean squared input activation per channel for every nn.Linear (name -> (in_features,))."""
    sums, counts = activation_sums(model, blocks, batch_size)
    return {k: sums[k] / counts[k] for k in sums}
