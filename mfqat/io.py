"""Atomic writes: files and whole directories appear complete or not at all."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Union

PathLike = Union[str, Path]


def fsync_file(path: PathLike) -> None:
    """Flush a written file to disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def sha256_file(path: PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def write_json(path: PathLike, data: dict) -> None:
    """Write JSON through a temp file + fsync + rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_directory(dest: PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside ``dest``; on success it replaces ``dest`` in one rename.

    On an exception the temporary folder is removed and ``dest`` is left as it was.
    """
    dest = Path(dest).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} exists; pass overwrite=True (or --force) to replace it")
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial"))
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_file(f)
        old = None
        if dest.exists():
            old = dest.parent / f".{dest.name}.old-{os.getpid()}"
            os.replace(dest, old)
        os.replace(tmp, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
