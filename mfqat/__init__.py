"""mfqat: multi-format quantization-aware training in OCP Microscaling formats, with MLX export."""
__version__ = "0.1.0"

from .formats import ALIASES, FORMATS, ElementFormat, get_format, known_formats  # noqa: E402
from .quant import MXTensor, dequantize, fake_quantize, quantize  # noqa: E402
from .slice import slice_and_scale  # noqa: E402
from .qat import QATConfig, joint_backward, prepare, set_format, unprepare  # noqa: E402
from .anchor import load_anchor, read_anchor, save_anchor  # noqa: E402
from .mxqlora import load_with_adapter, mx_qlora_model, save_mx_adapter, set_base_format  # noqa: E402

__all__ = [
    "__version__", "ElementFormat", "FORMATS", "ALIASES", "get_format", "known_formats",
    "MXTensor", "quantize", "dequantize", "fake_quantize", "slice_and_scale",
    "QATConfig", "prepare", "set_format", "unprepare", "joint_backward", "save_anchor", "load_anchor", "read_anchor",
    "mx_qlora_model", "set_base_format", "save_mx_adapter", "load_with_adapter",
]
