"""mfqat: multi-format quantization-aware training in OCP Microscaling formats, with MLX export."""
from .formats import ALIASES, FORMATS, ElementFormat, get_format, known_formats
from .quant import MXTensor, dequantize, fake_quantize, quantize

__version__ = "0.1.0"

__all__ = [
    "__version__", "ElementFormat", "FORMATS", "ALIASES", "get_format", "known_formats",
    "MXTensor", "quantize", "dequantize", "fake_quantize",
]
