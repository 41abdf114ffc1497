"""How much memory a step may use, and a refusal before a step that cannot fit starts (issue 44).

The streaming paths (a tensor, a module or a layer at a time) fit any model. What still loads a whole model -
a checkpoint whose tensors do not map one to one onto the model (``export-mlx`` from it), an anchor of a family
whose weights transformers converts on save (``convert``), ``eval`` of a plain HF model - first compares the
least it will need (its weights in the dtype it loads them, as many copies as it holds, and the libraries) with
the budget: ``--max-memory`` where given, else the memory available when it starts. Past it the step is refused
at once, naming the step, both sizes and what to do, instead of failing (or swapping) an hour later.
"""
from __future__ import annotations

import os
from typing import Optional


class BudgetError(ValueError):
    """A step refused before it starts: it would not fit the memory budget (the message names the step, the sizes
    and what to do)."""


LIBRARY_BYTES = 512 * 2 ** 20  # torch, transformers and the interpreter: less than any mfqat command measured


def available_memory() -> int:
    """Bytes the system can give a new allocation now without swapping: Linux's ``MemAvailable`` (free memory
    plus the page cache it can drop), else the free physical pages; 0 when neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def gib(n: float) -> str:
    """``n`` bytes as GiB with one decimal (``"3.1 GiB"``)."""
    return f"{n / 2 ** 30:.1f} GiB"


def check_fits(step: str, weight_bytes: int, budget: Optional[int] = None, remedy: str = "") -> None:
    """Refuse (:class:`BudgetError`, which the ``mfqat`` command prints as one line) a step that holds ``weight_bytes`` of
    weights when they and :data:`LIBRARY_BYTES` exceed ``budget`` (bytes; None: :func:`available_memory`; 0 or
    unknown: no check). ``step`` names what would load, ``remedy`` says what to do instead."""
    limit = available_memory() if budget is None else budget
    need = weight_bytes + LIBRARY_BYTES
    if not limit or need <= limit:
        return
    where = "--max-memory" if budget is not None else "the memory available now"
    raise BudgetError(f"{step} needs at least {gib(need)}, over {where} ({gib(limit)}); nothing was written"
                      + (f": {remedy}" if remedy else ""))
