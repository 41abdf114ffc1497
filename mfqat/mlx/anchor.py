"""Write an MLX model back as an mfqat anchor that the PyTorch side loads.

The MLX weights become a Hugging Face PyTorch model of the same architecture (config from the
source directory, quantization entries dropped) and go through :func:`mfqat.save_anchor`, so the
anchor is quantized by the reference and written atomically with checksums like any other.
A model exported from an anchor, loaded and dequantized in MLX, and saved back in the anchor's
format keeps every code (tests/test_mlx.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import torch
from mlx.utils import tree_flatten

from mfqat.anchor.checkpoint import save_anchor as torch_save_anchor
from mfqat.models import family_for, tied_away
from mfqat.mlx.models import hf_tokenizer
from mfqat.mlx.qat import qat_layers

QUANT_KEYS = ("quantization", "quantization_config")


def to_torch_model(model: nn.Module, source_dir: Union[str, Path]):
    """An HF PyTorch model with the MLX model's weights (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((Path(source_dir) / "config.json").read_text())
    for k in QUANT_KEYS:
        cfg.pop(k, None)
    family = family_for(cfg.get("model_type"))
    if family.mlx_anchor_refusal:  # before building the PyTorch model (an mlx-lm model type may mean another one there)
        raise ValueError(f"{cfg.get('model_type')}: an MLX model of this family cannot be written back as an anchor yet "
                         f"({family.mlx_anchor_refusal}); train and anchor it in PyTorch")
    config = AutoConfig.for_model(**cfg)
    tmodel = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = {k: torch.from_numpy(np.array(v.astype(mx.float32))) for k, v in tree_flatten(model.parameters())}
    weights = family.hf_state_dict(weights)  # names and switch_mlp pieces back to the transformers layout
    lora = [k for k in weights if "lora_" in k]
    if lora:
        raise ValueError(f"the model holds LoRA adapters ({lora[0]}, ...); fuse them first: "
                         "`mlx_lm.fuse --model BASE --adapter-path ADAPTERS --dequantize --save-path FUSED`, then "
                         "MF-QAT-train or anchor the fused model")
    missing, unexpected = tmodel.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not tied_away(k, config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"MLX weights do not match {config.model_type}: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        tmodel.tie_weights()
    return tmodel


def save_anchor(model: nn.Module, path: Union[str, Path], fmt: Optional[str] = None,
                source_dir: Union[str, Path, None] = None, tokenizer=None, block_size: int = 32,
                step: Optional[int] = None, schedule: Optional[dict] = None, overwrite: bool = False) -> Path:
    """Save an MLX model (prepared or plain) as an anchor in ``fmt`` (default: the format a prepared
    model trains through, else mxint8).

    ``source_dir`` is the directory the model was loaded from (its config.json names the
    architecture). The MF-QAT layers' master weights are quantized; a plain model gets the
    default targets (every decoder-block linear weight), as :func:`mfqat.save_anchor` (which also
    says what ``overwrite`` may replace).
    """
    if source_dir is None:
        raise ValueError("save_anchor needs source_dir: the directory the MLX model was loaded from")
    tmodel = to_torch_model(model, source_dir)
    family = family_for(tmodel.config.model_type)
    targets = list(dict.fromkeys(family.hf_name(f"{name}.weight") for name, _ in qat_layers(model))) or None
    tok = tokenizer
    if tok is None and (Path(source_dir) / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(source_dir))
    rules = next((dict(m.scale_rules) for _, m in qat_layers(model) if m.scale_rules), None)
    fmt = fmt or next((m.anchor_format for _, m in qat_layers(model) if m.anchor_format), "mxint8")
    return torch_save_anchor(tmodel, path, fmt, hf_tokenizer(tok) if tok is not None else None, block_size=block_size,
                             targets=targets, step=step, schedule=schedule, overwrite=overwrite, scale_rules=rules)
