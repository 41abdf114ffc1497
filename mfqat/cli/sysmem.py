"""Give freed memory back to the system at once (issue 44).

glibc's allocator serves a block under its *mmap threshold* from its heap, and a freed heap block stays in
the process (to be reused) unless it happens to lie at the heap's top. The threshold starts at 128 KiB and
rises, up to 32 MiB, each time a larger mapped block is freed; so after the first few big tensors are
freed, every tensor up to 32 MiB (a 3B model's 3072 x 1024 projections, their codes, a row chunk) comes
from the heap, and what a long job frees module by module stays resident as scattered free space. Measured:
``export-mlx`` of a 1.2B model with a 2-step refine peaked at 3.52 GiB, 2.12 GiB with the threshold fixed
at 1 MiB (BENCHMARKS.md). The cost is a page fault on every new mapping: a plain 3B export (no refine) took
44 s with the threshold fixed against 35 s without, for 5% less peak (1.03 against 1.09 GiB), and ``convert``
at 1.2B 43 s against 35 s (0.99 against 1.06 GiB), ``eval`` at 1.2B 21-30 s against 17-18 s (2.83 against 2.92
GiB). So the ``mfqat`` command fixes it only where a learning step's tensors set the peak
(:data:`STREAMING_COMMANDS`: ``refine``, ``export-mlx`` unless ``--no-refine`` without ``--gptq``), not for ``convert``, ``eval``, a
``--no-refine`` export or training (a small training loop ran ~10% slower);
Python users can call :func:`return_freed_memory` or set ``MALLOC_MMAP_THRESHOLD_`` in the environment.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from mfqat.memory import available_memory  # noqa: F401 (its old home: mfqat.cli.commands imports it here)

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)
RETURN_FROM_BYTES = 1 << 20  # blocks of 1 MiB and up get their own mapping, returned when freed
STREAMING_COMMANDS = ("export-mlx", "refine")  # the commands that set it (export-mlx: when it refines or runs GPTQ)


def return_freed_memory(threshold: int = RETURN_FROM_BYTES) -> bool:
    """Have glibc map every block of ``threshold`` bytes and up on its own (``mallopt(M_MMAP_THRESHOLD)``, which
    also stops the threshold from rising), so that freeing it returns its memory at once. Returns whether the
    setting was made: not off Linux / glibc (macOS's allocator returns large blocks itself), and not when the
    user set ``MALLOC_MMAP_THRESHOLD_`` (theirs stands)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)  # glibc has it; musl does not
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, int(threshold)))
