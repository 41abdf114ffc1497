"""bitsandbytes baselines next to the MX formats: `mfqat eval MODEL --bnb nf4,int8`.

The full-precision model is reloaded through transformers' ``BitsAndBytesConfig`` (the caller
passes it: NF4 with double quantization and bf16 compute, or LLM.int8 with its outlier threshold,
as ``mfqat train --base`` loads a QLoRA base) and its perplexity measured on the same blocks.
bitsandbytes quantizes every Linear but ``lm_head`` - the decoder-block Linears the MX rows
quantize. Rows are named ``bnb_nf4`` / ``bnb_int8``; bits/weight counts the stored statistics:
NF4 + double quantization 4.127 (4-bit codes, 8-bit absmax per 64, fp32 per 256 absmax), LLM.int8
8 + 32/in_features (one fp32 absmax per row; its fp16 outlier columns are computed at run time,
not stored).
"""
from __future__ import annotations

import tempfile
from typing import Any, Dict, List

import torch
from torch import nn

from mfqat.formats import get_format
from mfqat.eval.perplexity import perplexity
from mfqat.models import is_output_head

BNB_BASES = ("nf4", "int8")


def row_name(base: str) -> str:
    """The table's name of a bitsandbytes base (``bnb_nf4``, ``bnb_int8``)."""
    return f"bnb_{base}"


def load_quantized(model: nn.Module, quantization_config: Any) -> nn.Module:
    """``model`` (a full-precision HF model) reloaded through bitsandbytes, on CUDA when present, else CPU."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="mfqat-bnb-eval-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        return AutoModelForCausalLM.from_pretrained(tmp, quantization_config=quantization_config,
                                                    device_map=device).eval()


def bits_per_weight(model: nn.Module, base: str) -> float:
    """Stored bits per quantized weight of the bitsandbytes base (see the module docstring)."""
    if base == "nf4":
        return get_format("nf4_dq").bits_per_weight(64)
    if base == "int8":
        sizes = [(m.in_features, m.out_features) for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and not is_output_head(n)]
        if not sizes:
            raise ValueError("bnb_int8: the model has no Linear layer to quantize")
        return sum(i * o * (8 + 32 / i) for i, o in sizes) / sum(i * o for i, o in sizes)
    raise ValueError(f"unknown bitsandbytes base {base!r}: choose from {', '.join(BNB_BASES)}")


def bnb_rows(model: nn.Module, configs: Dict[str, Any], blocks: torch.Tensor, batch_size: int = 4) -> List[dict]:
    """One perplexity row per bitsandbytes base: {base ("nf4"/"int8"): BitsAndBytesConfig}."""
    rows = []
    for base, cfg in configs.items():
        bpw = bits_per_weight(model, base)
        q = load_quantized(model, cfg)
        rows.append({"format": row_name(base), "bits/weight": bpw,
                     "perplexity": perplexity(q, blocks, batch_size, desc=f"ppl {row_name(base)}")})
        del q
    return rows
