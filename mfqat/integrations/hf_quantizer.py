"""``AutoModelForCausalLM.from_pretrained(ANCHOR)`` for mfqat anchors (transformers' HfQuantizer API).

An anchor's config.json carries ``quantization_config: {"quant_method": "mfqat", ...}``
(mfqat.anchor.config). Once this module is imported (``mfqat.register_hf_quantizer()``, or any
import of :mod:`mfqat.integrations.hf`), transformers hands such checkpoints to
:class:`MFQATHfQuantizer`, which reads the anchor with :func:`mfqat.read_anchor` (hashes, shapes)
and loads its weights dequantized in the anchor's own format: the model is a plain one, equal to
``mfqat.load_anchor(path)``. Lower formats: ``mfqat.load_anchor(path, fmt)``.

Without it, transformers does not know ``quant_method: "mfqat"``: it logs a warning and would build
the model with randomly initialised layers (the anchor stores codes + scales under other names).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from mfqat.anchor.config import QUANT_METHOD


class MFQATQuantizationConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of an mfqat anchor (format, block size, scale rule)."""

    def __init__(self, format: str = "mxint8", block_size: int = 32, scale_rule: str = "floor",
                 mfqat_version: Optional[str] = None, **kwargs):
        self.quant_method = QUANT_METHOD
        self.format, self.block_size, self.scale_rule, self.mfqat_version = format, block_size, scale_rule, mfqat_version


class MFQATHfQuantizer(HfQuantizer):
    """Loads an anchor's weights, dequantized in its own format, into the model transformers built."""

    requires_calibration = True  # only pre-quantized checkpoints (anchors) are loaded

    def __init__(self, quantization_config: QuantizationConfigMixin, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.folder: Optional[Path] = None

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files:
            raise ValueError("mfqat anchors load from a local folder (no checkpoint files were found)")
        self.folder = Path(checkpoint_files[0]).parent
        # the anchor stores codes + scales (+ importance) under other names: transformers' report of them would be noise
        # (the weights are checked in _process_model_after_weight_loading instead)
        self._ignored = (model._keys_to_ignore_on_load_unexpected, model._keys_to_ignore_on_load_missing)
        model._keys_to_ignore_on_load_unexpected = {r"\.codes$", r"\.scales$", r"\.importance$"}
        model._keys_to_ignore_on_load_missing = {r".*"}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        from mfqat.anchor.checkpoint import read_anchor

        model._keys_to_ignore_on_load_unexpected, model._keys_to_ignore_on_load_missing = self._ignored
        anchor = read_anchor(self.folder)
        dtype = next(model.parameters()).dtype
        missing, unexpected = model.load_state_dict(anchor.state_dict(None, dtype), strict=False)
        real_missing = [k for k in missing if k not in anchor.meta.get("tied", {})]
        if real_missing or unexpected:
            raise ValueError(f"{self.folder}: anchor weights do not match the model: missing {real_missing[:4]}, "
                             f"unexpected {unexpected[:4]}")
        model.tie_weights()
        model.mfqat_format = anchor.format
        self.remove_quantization_config(model)  # a plain model now: save_pretrained writes plain weights
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return True


def register_hf_quantizer() -> None:
    """Register the config and quantizer with transformers (idempotent; done on import of this module)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(MFQATQuantizationConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(MFQATHfQuantizer)


register_hf_quantizer()
