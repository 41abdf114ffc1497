"""Old import paths of modules that moved to :mod:`mfqat.train` (kept one release, with a warning)."""
from __future__ import annotations

import sys
import warnings
from types import ModuleType


def moved(old: str, new: ModuleType) -> None:
    """Make the module named ``old`` the module ``new`` (same object: patches and private names reach
    it) and warn once that the old path goes away in the next release."""
    warnings.warn(f"{old} moved to {new.__name__}; import it from there (the old path is removed in the "
                  "next release)", DeprecationWarning, stacklevel=3)
    sys.modules[old] = new
