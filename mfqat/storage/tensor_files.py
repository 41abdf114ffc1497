"""safetensors files read and written one tensor at a time, so that no step holds a whole model.

:class:`TensorFile` reads a safetensors file through an open file descriptor: the header is parsed
and checked once (offsets inside the file, contiguous, sizes matching dtype x shape), each tensor is
read with ``os.pread`` when asked for (no memory map, so the resident memory is the tensors in use,
not the pages touched so far), and the file can be hashed in chunks from the same descriptor, so the
bytes hashed are the bytes read even when another process renames a new folder over the path.

:class:`ShardWriter` writes tensors as they come into the Hugging Face shard layout
(``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
above ``max_shard_bytes``): each tensor's bytes go to a spill file on disk at once, and a shard is
assembled (header, then the spilled data) when it is full. Memory: one tensor (or one row chunk of
it: :meth:`ShardWriter.add_chunks`) at a time. Within a shard, tensors are laid out by element size,
largest first, so every tensor starts at an offset aligned to its element size (as safetensors' own
writer does).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from mfqat.storage.shard_files import MAX_SHARD_BYTES, shard_file_names, write_index

# safetensors dtype names <-> torch dtypes (the ones mfqat reads or writes)
DTYPES: Dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
NAMES: Dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
NUMPY_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint32): "U32",
               np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8", np.dtype(np.int32): "I32",
               np.dtype(np.uint16): "U16", np.dtype(np.int64): "I64", np.dtype(np.float64): "F64"}
HASH_CHUNK = 16 * 1024 ** 2
MAX_HEADER = 100 * 1024 ** 2  # safetensors' own limit


class TensorFileError(ValueError):
    """A safetensors file that cannot be read as one (names the file and what is wrong)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in a file and what it is (from the header, no data read)."""
    dtype: torch.dtype
    shape: Tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class TensorFile:
    """A safetensors file read tensor by tensor through one file descriptor (owned: :meth:`close`)."""

    def __init__(self, fd: int, where: str):
        self.fd, self.where = fd, where
        self.size = os.fstat(fd).st_size
        self.infos, self.metadata = self._header()

    @classmethod
    def open(cls, path) -> "TensorFile":
        """Open ``path`` (a file outside an artifact snapshot: a source checkpoint shard)."""
        return cls(os.open(str(path), os.O_RDONLY), str(path))

    def close(self) -> None:
        """Release the descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # a lazily read anchor dropped without close()
        try:
            self.close()
        except OSError:
            pass

    def _fail(self, why: str):
        raise TensorFileError(f"{self.where}: cannot read safetensors ({why}); the file is truncated or corrupt: "
                              "save or download it again")

    def _header(self) -> Tuple[Dict[str, TensorInfo], dict]:
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            self._fail("shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, self.size - 8):
            self._fail(f"header length {n} beyond the file's {self.size} bytes")
        try:
            header = json.loads(os.pread(self.fd, n, 8))
        except (UnicodeDecodeError, ValueError) as e:
            self._fail(f"header is not JSON: {e}")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        base, infos, spans = 8 + n, {}, []
        for name, e in header.items():
            try:
                dtype, shape, (lo, hi) = DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                self._fail(f"tensor {name!r} has a malformed entry {e!r}")
            info = TensorInfo(dtype, shape, base + int(lo), int(hi) - int(lo))
            if min(shape, default=0) < 0 or info.nbytes != info.numel * dtype.itemsize or lo < 0 or \
                    base + hi > self.size:
                self._fail(f"tensor {name!r}: offsets {lo}..{hi} do not hold {e['dtype']} {list(shape)} inside "
                           f"the file's {self.size - base} data bytes")
            infos[name] = info
            spans.append((int(lo), int(hi)))
        infos = dict(sorted(infos.items(), key=lambda kv: kv[1].start))  # file order, as safetensors' load gives
        end = 0
        for lo, hi in sorted(spans):
            if lo != end:
                self._fail(f"tensor data is not contiguous (a gap or an overlap at byte {lo})")
            end = hi
        if base + end != self.size:
            self._fail(f"{self.size - base - end} bytes after the last tensor")
        return infos, meta

    def sha256(self) -> str:
        """sha256 of the whole file, read in chunks from this descriptor."""
        return sha256_fd(self.fd)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a fresh tensor; nothing stays mapped)."""
        info = self.infos[name]
        return self._read(name, info.start, info.nbytes, info.dtype, info.shape)

    def read_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` (first axis) of tensor ``name``, read alone."""
        info = self.infos[name]
        row = info.nbytes // max(info.shape[0], 1)
        hi = min(hi, info.shape[0])
        return self._read(name, info.start + lo * row, (hi - lo) * row, info.dtype, (hi - lo,) + info.shape[1:])

    def _read(self, name: str, start: int, nbytes: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        buf = torch.empty(nbytes, dtype=torch.uint8)  # not zeroed first, as a bytearray would be (~20% of a read)
        view, got = memoryview(buf.numpy()), 0
        while got < nbytes:  # pread may return less than asked on large reads
            part = os.preadv(self.fd, [view[got:]], start + got)
            if part <= 0:
                self._fail(f"tensor {name!r} ends early")
            got += part
        return buf.view(dtype).reshape(shape)


def sha256_fd(fd: int) -> str:
    """sha256 of a whole file read in chunks from an open descriptor (its offset is left alone)."""
    h, off = hashlib.sha256(), 0
    while True:
        chunk = os.pread(fd, HASH_CHUNK, off)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        off += len(chunk)


def _as_bytes(value) -> Tuple[str, Tuple[int, ...], memoryview]:
    """(safetensors dtype name, shape, raw little-endian bytes) of a torch tensor or numpy array."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype not in NAMES:
            raise TypeError(f"cannot write dtype {t.dtype} to safetensors")
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        return NAMES[t.dtype], tuple(t.shape), memoryview(raw).cast("B")
    a = np.ascontiguousarray(value)
    if a.dtype not in NUMPY_NAMES:
        raise TypeError(f"cannot write numpy dtype {a.dtype} to safetensors")
    return NUMPY_NAMES[a.dtype], tuple(a.shape), memoryview(a.reshape(-1).view(np.uint8)).cast("B")


def append_file(src, out) -> None:
    """Copy the rest of the open file ``src`` to the end of the unbuffered file ``out``: in the kernel
    (``os.copy_file_range``: no pass through this process's memory) where the system allows it, else in
    chunks. Both files' offsets advance by the bytes copied."""
    copy = getattr(os, "copy_file_range", None)
    left = os.fstat(src.fileno()).st_size - src.tell()
    while copy is not None and left > 0:
        try:
            done = copy(src.fileno(), out.fileno(), min(left, 1 << 30))
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise  # a full disk, an I/O error: the caller's to report
            break  # not on this file system: nothing of this call was copied
        if done == 0:
            break
        left -= done
    shutil.copyfileobj(src, out, HASH_CHUNK)


class _Shard:
    """One shard being filled: per element size, a spill file of the tensors' data."""

    def __init__(self, folder: Path, index: int):
        self.folder, self.index = folder, index
        self.entries: List[Tuple[str, str, Tuple[int, ...], int, int]] = []  # name, dtype, shape, itemsize, nbytes
        self.spills: Dict[int, object] = {}
        self.nbytes = 0

    def spill(self, itemsize: int):
        if itemsize not in self.spills:
            self.spills[itemsize] = open(self.folder / f".shard-{self.index}.{itemsize}.spill", "wb")
        return self.spills[itemsize]

    def assemble(self, dest: Path, metadata: dict) -> None:
        """Header + spilled data (largest element size first) into ``dest``; spills removed."""
        header: Dict[str, object] = {"__metadata__": metadata}
        offset = 0
        for size in sorted(self.spills, reverse=True):
            for name, dtype, shape, itemsize, nbytes in self.entries:
                if itemsize == size:
                    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                    offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-(len(text) + 8) % 8)  # data starts 8-aligned
        with open(dest, "wb", buffering=0) as out:  # unbuffered: the spills are appended at the descriptor's offset
            out.write(struct.pack("<Q", len(text)) + text)
            for size in sorted(self.spills, reverse=True):
                f = self.spills[size]
                f.close()
                with open(f.name, "rb", buffering=0) as src:
                    append_file(src, out)
                os.unlink(f.name)
            os.fsync(out.fileno())


class ShardWriter:
    """Tensors written one at a time into the HF shard layout of ``folder`` (see the module docstring).

    ``add(name, value)`` writes a torch tensor or numpy array; ``add_chunks`` one whose row chunks come
    from an iterator (their bytes concatenated are the tensor's). ``close()`` names the shards, writes the
    index when there are several, and returns the file names. The shard a tensor goes to is decided when
    it is added (greedy in the order added; a tensor larger than ``max_shard_bytes`` gets its own)."""

    def __init__(self, folder, max_shard_bytes: int, metadata: Optional[dict] = None, digests: bool = False):
        self.folder = Path(folder)
        self.digests: Optional[Dict[str, str]] = {} if digests else None  # {tensor: sha256 of its bytes}
        self.max = max_shard_bytes or MAX_SHARD_BYTES
        self.metadata = {"format": "pt", **(metadata or {})}
        self.done: List[Tuple[Path, List[str]]] = []
        self.shard = _Shard(self.folder, 0)
        self.names: Dict[str, int] = {}
        self.total = 0

    def _room(self, nbytes: int) -> _Shard:
        if self.shard.entries and self.shard.nbytes + nbytes > self.max:
            self._finish()
        return self.shard

    def _finish(self) -> None:
        dest = self.folder / f".shard-{self.shard.index}.safetensors.part"
        self.shard.assemble(dest, self.metadata)
        self.done.append((dest, [e[0] for e in self.shard.entries]))
        self.shard = _Shard(self.folder, self.shard.index + 1)

    def add(self, name: str, value) -> None:
        """Write one tensor (torch or numpy) now."""
        dtype, shape, raw = _as_bytes(value)
        self._record(name, dtype, shape, len(raw))
        self.shard.spill(DTYPES[dtype].itemsize).write(raw)
        if self.digests is not None:
            self.digests[name] = hashlib.sha256(raw).hexdigest()

    def add_chunks(self, name: str, dtype, shape: Tuple[int, ...], chunks: Iterable) -> None:
        """Write one tensor of ``dtype`` (torch dtype) and ``shape`` from row chunks, in order."""
        item = dtype.itemsize
        nbytes = item
        for s in shape:
            nbytes *= int(s)
        self._record(name, NAMES[dtype], tuple(int(s) for s in shape), nbytes)
        f, written, h = self.shard.spill(item), 0, hashlib.sha256()
        for chunk in chunks:
            cdtype, _, raw = _as_bytes(chunk)
            if cdtype != NAMES[dtype]:
                raise TypeError(f"{name}: a chunk of dtype {cdtype} in a {NAMES[dtype]} tensor")
            f.write(raw)
            if self.digests is not None:
                h.update(raw)
            written += len(raw)
        if self.digests is not None:
            self.digests[name] = h.hexdigest()
        if written != nbytes:
            raise ValueError(f"{name}: chunks gave {written} bytes, {list(shape)} {NAMES[dtype]} needs {nbytes}")

    def _record(self, name: str, dtype: str, shape: Tuple[int, ...], nbytes: int) -> None:
        if name in self.names:
            raise ValueError(f"{name}: written twice")
        shard = self._room(nbytes)
        shard.entries.append((name, dtype, shape, DTYPES[dtype].itemsize, nbytes))
        shard.nbytes += nbytes
        self.names[name] = shard.index
        self.total += nbytes

    def close(self) -> List[str]:
        """Finish the last shard, give every shard its final name, write the index; the file names."""
        if self.shard.entries or not self.done:
            self._finish()
        files = shard_file_names(len(self.done))
        for (part, _), name in zip(self.done, files):
            os.replace(part, self.folder / name)
        write_index(self.folder, files, [names for _, names in self.done], self.total)
        return files

    def abort(self) -> None:
        """Remove the spill and part files (the folder itself is the caller's)."""
        for f in self.shard.spills.values():
            f.close()
        for p in list(self.folder.glob(".shard-*")):
            p.unlink(missing_ok=True)


def read_header(path) -> Dict[str, TensorInfo]:
    """{tensor: TensorInfo} of a safetensors file, from its header alone."""
    with TensorFile.open(path) as f:
        return dict(f.infos)


def write_safetensors(folder: Path, tensors: Dict[str, torch.Tensor], max_shard_bytes: int = MAX_SHARD_BYTES,
                      metadata: Optional[dict] = None) -> List[str]:
    """Write torch tensors as model.safetensors, or shards + index beyond ``max_shard_bytes``, one at a time."""
    writer = ShardWriter(folder, max_shard_bytes, metadata)
    for k, v in tensors.items():
        writer.add(k, v)
    return writer.close()
