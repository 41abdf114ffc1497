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
import re
import subprocess
import sys
from typing import Optional


class BudgetError(ValueError):
    """A step refused before it starts: it would not fit the memory budget (the message names the step, the sizes
    and what to do)."""


LIBRARY_BYTES = 512 * 2 ** 20  # torch, transformers and the interpreter: less than any mfqat command measured


def available_memory() -> int:
    """Bytes the system can give a new allocation now without swapping: Linux's ``MemAvailable`` (free memory
    plus the page cache it can drop), an estimate on macOS (``vm_stat``'s free, inactive and speculative pages:
    :func:`darwin_available`), else the free physical pages; 0 when none is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10, check=True).stdout
            return darwin_available(out)
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


DARWIN_RECLAIMABLE = ("free", "inactive", "speculative")  # purgeable pages are counted in active/inactive too


def darwin_available(vm_stat: str) -> int:
    """An estimate of the bytes macOS can hand out without swapping, from ``vm_stat``'s output: its page size
    (first line) times its free, inactive and speculative page counts (inactive pages include anonymous ones that
    come back only by compression or swap: an upper bound). ValueError when the output has no page size or none
    of those counts."""
    size = re.search(r"page size of (\d+) bytes", vm_stat)
    pages = {m.group(1): int(m.group(2)) for m in re.finditer(r"^Pages ([a-z ]+?):\s+(\d+)\.?\s*$", vm_stat, re.M)}
    counted = [pages[k] for k in DARWIN_RECLAIMABLE if k in pages]
    if size is None or not counted:
        raise ValueError("vm_stat: no page size or no free/inactive page counts in its output")
    return int(size.group(1)) * sum(counted)


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
