"""The ``config.json`` of an anchor: the model's HF config, marked as an mfqat anchor.

``quantization_config`` carries ``quant_method: "mfqat"`` with the anchor format, block size and
scale rule, so tools that read config.json (transformers, the Hub, mfqat's own loaders) see that
the weights are MX codes + scales, not plain tensors. ``use_cache`` is reset to true (training
with gradient checkpointing turns it off; inference wants it on).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

QUANT_METHOD = "mfqat"


def quantization_config(fmt: str, block_size: int, scale_rule: str,
                        scale_rules: Optional[Dict[str, str]] = None) -> dict:
    """The ``quantization_config`` entry of an anchor's config.json (``scale_rules``: the rule each
    lower format is sliced with, mfqat.quant.scale_rules)."""
    from mfqat._build import __version__

    out = {"quant_method": QUANT_METHOD, "format": fmt, "block_size": block_size, "scale_rule": scale_rule,
           "mfqat_version": __version__}
    if scale_rules:
        out["scale_rules"] = dict(scale_rules)
    return out


def write_anchor_config(config, folder: Path, fmt: str, block_size: int, scale_rule: str,
                        scale_rules: Optional[Dict[str, str]] = None) -> None:
    """Save the model's HF ``config`` into ``folder``, marked as an mfqat anchor (see module docstring)."""
    config.save_pretrained(folder)
    path = Path(folder) / "config.json"
    data = json.loads(path.read_text())
    data.pop("quantization_config", None)
    if "use_cache" in data or "text_config" not in data:
        data["use_cache"] = True
    data["quantization_config"] = quantization_config(fmt, block_size, scale_rule, scale_rules)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def is_mfqat_config(config: Optional[dict]) -> bool:
    """True when a parsed config.json is an mfqat anchor's."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def model_config(config: dict) -> dict:
    """The model's own config (an anchor's config.json without mfqat's quantization_config)."""
    if not is_mfqat_config(config):
        return config
    return {k: v for k, v in config.items() if k != "quantization_config"}
