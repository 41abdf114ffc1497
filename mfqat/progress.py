"""Console output that behaves in CI logs: progress bars and dependency import noise.

``progress(...)`` is ``tqdm(...)`` (same arguments) with three rules:

- ``MFQAT_PROGRESS=0`` turns every bar off; ``MFQAT_PROGRESS=1`` keeps tqdm's own behaviour
  even when the output is not a terminal.
- Otherwise, when the bar's output (``file``, default stderr) is not a terminal - a CI log,
  ``2> file`` - a bar redraws at most every :data:`LOG_INTERVAL` seconds, and ``set_postfix`` /
  ``set_description`` wait for the next redraw instead of forcing one. A run then writes a
  handful of lines instead of one frame per step (hundreds of KB over a long run).
- In a terminal nothing changes.

``quiet_dependency_logs()`` drops two known, harmless messages that appear when transformers
imports torchao (it does so whenever torchao is installed, e.g. by ``mfqat[test]``): torchao's
"Failed to load .../torchao/_C*.so" for its CUDA kernels, and torch's pytree deprecation
warning for the enums torchao registers. The command-line entry points call it; importing
mfqat as a library does not.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Iterable, Optional

from tqdm.auto import tqdm

LOG_INTERVAL = 30.0  # seconds between redraws when the output is not a terminal


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class _LogTqdm(tqdm):
    """tqdm for non-terminal output: postfix / description changes do not force a redraw."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_postfix_str(self, s="", refresh=True):
        super().set_postfix_str(s, refresh=False)

    def set_description(self, desc=None, refresh=True):
        super().set_description(desc, refresh=False)


def progress(iterable: Optional[Iterable] = None, **kwargs) -> tqdm:
    """A progress bar (tqdm arguments); see the module docs for the log-friendly rules."""
    mode = os.environ.get("MFQAT_PROGRESS", "").strip().lower()
    if mode in ("0", "false", "no", "off"):
        kwargs["disable"] = True
    if mode in ("1", "true", "yes", "on") or _isatty(kwargs.get("file") or sys.stderr):
        return tqdm(iterable, **kwargs)
    kwargs["mininterval"] = max(float(kwargs.get("mininterval", 0.1)), LOG_INTERVAL)
    kwargs["maxinterval"] = max(float(kwargs.get("maxinterval", 10.0)), 2 * LOG_INTERVAL)
    kwargs.setdefault("dynamic_ncols", False)
    return _LogTqdm(iterable, **kwargs)


def announce(message: str) -> None:
    """One line for the user on stderr before a long step (what it will do, what it costs), written so that a
    progress bar on screen is not broken; nothing when ``MFQAT_PROGRESS=0``."""
    if os.environ.get("MFQAT_PROGRESS", "").strip().lower() in ("0", "false", "no", "off"):
        return
    tqdm.write(message, file=sys.stderr)


class _DropMessages(logging.Filter):
    """Drop the log records whose message contains every one of ``needles``."""

    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record: let logging report it as usual
            return True
        return not all(n in msg for n in self.needles)


_QUIET = {
    # torchao's CUDA kernels (mxfp8, cutlass) cannot load without CUDA; mfqat never uses them
    "torchao": _DropMessages("Failed to load", "torchao", ".so"),
    # torch deprecates pytree registration of Enum subclasses, which torchao still does at import
    "torch.utils._pytree": _DropMessages("is an Enum subclass", "register_constant()"),
}


def quiet_dependency_logs() -> None:
    """Install the filters above (idempotent; other messages of these loggers still appear)."""
    for name, filt in _QUIET.items():
        logger = logging.getLogger(name)
        if filt not in logger.filters:
            logger.addFilter(filt)
