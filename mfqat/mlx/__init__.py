"""mfqat on MLX (Metal on Apple silicon; the CPU backend elsewhere, which CI uses).

* :mod:`mfqat.mlx.quant` - quantize / dequantize / fake-quant in MLX ops, bit-exact with PyTorch;
* :mod:`mfqat.mlx.qat` - ``MFQATLinear``, ``prepare`` over mlx-lm models, the shared schedules;
* :mod:`mfqat.mlx.train` - ``mfqat mlx-train`` (MF-QAT or LoRA), :mod:`mfqat.mlx.anchor` - back to an anchor;
* :mod:`mfqat.mlx.serve` - ``mfqat generate`` / ``mfqat serve`` over mlx-lm.

Importing this package without MLX installed raises an ImportError that says what to install.
"""
try:
    import mlx.core  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("mfqat.mlx needs MLX: pip install 'mfqat[mlx]' (installs mlx[cpu] on Linux, mlx on macOS) "
                      "and mlx-lm") from exc

from mfqat.mlx.anchor import save_anchor  # noqa: E402
from mfqat.mlx.qat import MFQATLinear, prepare, set_format, unprepare  # noqa: E402
from mfqat.mlx.quant import dequantize, fake_quantize, qdq, quantize  # noqa: E402

__all__ = ["MFQATLinear", "prepare", "set_format", "unprepare", "quantize", "dequantize", "fake_quantize", "qdq",
           "save_anchor"]
