"""What this build of mfqat is: its version and its compiled C++ extension.

A leaf of the package (layer 0, docs/architecture.md): it imports nothing of mfqat but the
extension, so every layer may ask it; the root (``mfqat/__init__.py``, the top) re-exports
``__version__`` from here and ``mfqat._C`` stays the extension's import name.
"""
from types import ModuleType

__version__ = "0.1.0"

# The C++ (and, when torch had CUDA and nvcc was found, CUDA) ops built by setup.py from csrc/; absent
# when no compiler was found at install time.
EXTENSION = "mfqat._C"


def load_extension() -> ModuleType:
    """Import the compiled extension, which registers ``torch.ops.mfqat.*``; ImportError when it was not built."""
    from mfqat import _C

    return _C
