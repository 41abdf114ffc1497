"""mfqat: multi-format quantization-aware training in OCP Microscaling formats, with MLX export.

The public names are imported on first use (PEP 562), so ``mfqat --version`` / ``--help`` and
``import mfqat`` do not load torch.

The root is the top of the package's layers (docs/architecture.md): nothing in mfqat imports it.
``__version__`` and the compiled extension (``mfqat._C``) live in the leaf ``mfqat._build``, and
scripts/dev/gen_layers.py reads ``_PUBLIC`` below as the root's imports.
"""
from importlib import import_module
from typing import Any, List

from mfqat._build import __version__

_PUBLIC = {
    ".formats": ["ALIASES", "FORMATS", "ElementFormat", "get_format", "known_formats"],
    ".quant": ["MXTensor", "dequantize", "fake_quantize", "fake_quantize_through", "quantize"],
    ".quant.slice": ["slice_and_scale"],
    ".quant.scale_search": ["quantize_search"],
    ".quant.scale_rules": ["DEFAULT_SCALE_RULE"],
    ".qat": ["QATConfig", "joint_backward", "prepare", "set_format", "unprepare", "clip_rates", "sync_importance"],
    ".anchor.checkpoint": ["read_anchor", "save_anchor"],
    ".anchor.load": ["load_anchor"],
    ".export.mlx_export": ["to_mlx"],
    ".integrations.hf_quantizer": ["register_hf_quantizer"],
    ".mxqlora.model": ["load_with_adapter", "mx_qlora_model", "save_mx_adapter", "set_base_format"],
    ".mxqlora.mlx_adapter": ["peft_to_mlx"],
}
_WHERE = {name: module for module, names in _PUBLIC.items() for name in names}

__all__ = [
    "__version__", "ElementFormat", "FORMATS", "ALIASES", "get_format", "known_formats",
    "MXTensor", "quantize", "dequantize", "fake_quantize", "fake_quantize_through", "slice_and_scale",
    "QATConfig", "prepare", "set_format", "unprepare", "joint_backward", "save_anchor", "load_anchor", "read_anchor",
    "to_mlx",
    "mx_qlora_model", "set_base_format", "save_mx_adapter", "load_with_adapter", "peft_to_mlx",
    "register_hf_quantizer", "clip_rates", "quantize_search", "DEFAULT_SCALE_RULE", "sync_importance",
]


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first access."""
    if name not in _WHERE:
        raise AttributeError(f"module 'mfqat' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
