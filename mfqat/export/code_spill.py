"""The codes of a refine's tensors on disk between their uses (issue 44).

A refine keeps every learned tensor's codes fixed and needs them only when that tensor's module runs (and
again when its layer is recomputed in backward, and for its gradient). Held in memory they are the largest
part of a refine's footprint: half a byte a weight at 4 bits, 1.45 GB for a 3B model. A :class:`CodeSpill`
writes them once to one file in a folder on disk (the export's staging folder) and reads a tensor's codes
back each time they are asked for; the operating system's page cache keeps the file in memory while memory
is free and drops it, instead of the process's memory growing, when it is not. Reading back gives the same
bytes, so the refine's results are unchanged, bit for bit.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Tuple

import numpy as np
import torch


class SpilledCodes:
    """One tensor's codes (uint8) in a :class:`CodeSpill`'s file: :meth:`get` reads them back."""

    def __init__(self, spill: "CodeSpill", offset: int, shape: Tuple[int, ...]):
        self.spill, self.offset, self.shape = spill, offset, shape

    def get(self) -> torch.Tensor:
        """The codes, read from the file into a new tensor."""
        buf = np.empty(int(np.prod(self.shape)), dtype=np.uint8)
        if buf.nbytes and os.preadv(self.spill.fd, [buf], self.offset) != buf.nbytes:
            raise OSError(f"{self.spill.path}: the refine's code file ends early (was it removed or truncated "
                          "while the refine ran?)")
        return torch.from_numpy(buf).reshape(self.shape)


class CodeSpill:
    """A file of uint8 code tensors in ``folder``, written once each (:meth:`put`) and read back as asked; removed
    by :meth:`close` (also on leaving a ``with`` block)."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / f".refine-codes-{os.getpid()}.bin"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.end = 0

    def put(self, codes: torch.Tensor) -> SpilledCodes:
        """Write ``codes`` (uint8) at the end of the file; the handle that reads them back."""
        if codes.dtype != torch.uint8:
            raise TypeError(f"CodeSpill holds uint8 codes, got {codes.dtype}")
        data = codes.contiguous().numpy()
        offset, written = self.end, 0
        view = memoryview(data).cast("B")
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], offset + written)
        self.end += len(view)
        return SpilledCodes(self, offset, tuple(codes.shape))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "CodeSpill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
