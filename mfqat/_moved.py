"""Old import paths of modules and packages that moved (kept one release, with a warning).

A module left at the old path calls :func:`moved`; the old name then *is* the new module (the same
object, so patches and private names reach it). For a package, the old names of its submodules
(``mfqat.qlora.model``) import the new ones (``mfqat.mxqlora.model``) the same way, each warning
once, so no module is ever loaded twice under two names. Names renamed inside a module keep their old
name the same way: :func:`old_names` (a module's functions and constants), :func:`renamed` (an attribute).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any, Callable, Dict


def moved(old: str, new: ModuleType) -> None:
    """Make the module named ``old`` the module ``new`` (same object: patches and private names reach
    it) and warn once that the old path goes away in the next release; for a package ``new``, its
    submodules answer to their old names too."""
    warnings.warn(f"{old} moved to {new.__name__}; import it from there (the old path is removed in the "
                  "next release)", DeprecationWarning, stacklevel=3)
    sys.modules[old] = new
    if hasattr(new, "__path__") and old not in _PACKAGES:
        _PACKAGES[old] = new.__name__
        sys.meta_path.insert(0, _OldSubmodules())


_PACKAGES: Dict[str, str] = {}  # old package name -> new package name


class _OldSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``OLD.sub`` as ``NEW.sub`` for every moved package (without it, Python would load the
    new package's file a second time under the old name: two copies of every class)."""

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname.startswith(old + ".") for old in _PACKAGES):
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return None  # a placeholder module; exec_module puts the real one in its place

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        package = max((p for p in _PACKAGES if old.startswith(p + ".")), key=len)
        moved(old, importlib.import_module(_PACKAGES[package] + old[len(package):]))


def old_names(module: str, names: Dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the names renamed inside module ``module`` (``{old: new}``): an old name
    gives the new one's value and warns, naming it (one release)."""
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(f"{module}.{name} is now {module}.{names[name]} (the old name is removed in the next release)",
                      DeprecationWarning, stacklevel=2)
        return getattr(sys.modules[module], names[name])
    return __getattr__


def renamed(cls: str, old: str, new: str) -> property:
    """A property ``old`` that reads and sets attribute ``new`` of a ``cls`` and warns, naming it (one release)."""
    def warn() -> None:
        warnings.warn(f"{cls}.{old} is now {cls}.{new} (the old name is removed in the next release)",
                      DeprecationWarning, stacklevel=3)

    def get(self):
        warn()
        return getattr(self, new)

    def set_(self, value) -> None:
        warn()
        setattr(self, new, value)
    return property(get, set_, doc=f"Deprecated name of ``{new}``.")
