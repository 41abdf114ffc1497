"""Atomic writes: files and whole directories appear complete or not at all."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterator, Optional, Sequence, Union

from mfqat.storage.guard import (RUN_RECORD, WriterBusyError, backup_path, check_output, file_sha256,  # noqa: F401
                                 is_kind, mark_partial, owned_output, read_run_record,
                                 partial_name, recover, remove_marks_last, unmark_partial,
                                 writer_lock)

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


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_file(path: PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Write ``path`` through a temp file beside it + fsync + rename (mode as the umask gives a new file),
    so a crash leaves the old file or the new one; ``write(f)`` fills the binary file. Disk full is
    :func:`disk_full`'s one-line error, the temp file removed."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~current_umask())
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            raise disk_full(path, e) from e
        raise
    fsync_dir(path.parent)


def write_json(path: PathLike, data: dict) -> None:
    """Write JSON atomically (:func:`write_file`)."""
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    write_file(path, lambda f: f.write(text.encode()))


def write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` atomically (:func:`write_file`)."""
    write_file(path, lambda f: f.write(data))


def write_torch(path: PathLike, obj) -> None:
    """``torch.save`` atomically (:func:`write_file`)."""
    import torch

    write_file(path, lambda f: torch.save(obj, f))


def fsync_dir(path: PathLike) -> None:
    """Make renames inside a folder durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def settle(folder: Path) -> None:
    """fsync every file of a written folder and give everything the modes the umask gives new
    files (some writers, safetensors and tempfile among them, create files 0600)."""
    mask = current_umask()
    for f in [folder, *folder.rglob("*")]:
        if f.is_symlink():
            continue
        if f.is_dir():
            os.chmod(f, 0o777 & ~mask)
        else:
            os.chmod(f, 0o666 & ~mask)
            fsync_file(f)


def swap_in(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``; an existing ``dest`` is moved to a backup first and put back
    if the second rename fails. A kill between the two renames is repaired by the next save."""
    backup = None
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    elif dest.exists():
        backup = backup_path(dest)
        if backup.exists() or backup.is_symlink():  # our own PID's name, but mfqat removes its backups at once
            raise FileExistsError(f"{backup} exists (not written by this save); mfqat never deletes what it did "
                                  "not write: move it away and save again")
        os.replace(dest, backup)
    try:
        os.replace(tmp, dest)
    except BaseException:
        if backup is not None:
            os.replace(backup, dest)
        raise
    unmark_partial(dest)  # after the rename: a partial is never without its mark (recover() cleans a stale one)
    fsync_dir(dest.parent)
    if backup is not None:
        remove_marks_last(backup)


@contextlib.contextmanager
def atomic_directory(dest: PathLike, overwrite: bool = False, kind: Optional[str] = None,
                     protect: Sequence[PathLike] = ()) -> Iterator[Path]:
    """Yield a partial folder beside ``dest``; on success it replaces ``dest`` in one rename.

    Refuses (before writing anything) an output that overlaps a ``protect`` path or the cwd, a
    file, and a non-empty folder unless ``overwrite`` and it is an artifact of ``kind``
    (see :data:`mfqat.storage.guard.KINDS`). Holds the writer lock of ``dest`` throughout and first
    cleans what killed writers left. On an exception the partial folder is removed and
    ``dest`` is left as it was. Folders and files get the modes the umask gives.
    """
    dest = Path(dest).absolute()
    protect = [Path(p) for p in protect]
    check_output(dest, overwrite, kind, protect)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with writer_lock(dest):
        recover(dest, lambda p: is_kind(p, kind) if kind else False)
        check_output(dest, overwrite, kind, protect)
        tmp = dest.parent / partial_name(dest)
        tmp.mkdir()
        try:
            mark_partial(tmp)
            yield tmp
            settle(tmp)
            swap_in(tmp, dest)
        except BaseException as e:
            if tmp.is_dir():
                remove_marks_last(tmp)
            if isinstance(e, OSError) and e.errno in DISK_FULL:
                raise disk_full(dest, e) from e
            raise


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A save ran out of space; ``errno`` is kept, ``str()`` is the one-line message."""

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full(dest: Path, exc: OSError) -> DiskFullError:
    """The one-line error of a save that ran out of space (ENOSPC / EDQUOT): names ``dest`` and says
    what is on disk now (the previous artifact, untouched, or nothing)."""
    left = (f"the previous {dest.name} is intact" if dest.exists() else "nothing was written there")
    return DiskFullError(exc.errno, f"{dest}: {exc.strerror or 'no space left on device'} while saving; {left} "
                   "(the partial copy was removed); free some space and run again")


class RunFolder:
    """A run's ``--out`` (train, mx-qlora, mlx-train): the files and folders it writes there, recorded in
    :data:`~mfqat.storage.guard.RUN_RECORD` so that a later ``--overwrite`` replaces only what this
    command wrote (checked up front by :func:`mfqat.storage.guard.check_run_folder`)."""

    def __init__(self, out: PathLike, command: str):
        self.out = Path(out)
        self.command = command

    def start(self) -> "RunFolder":
        """Create the folder and its record (an earlier run's record of this command is kept)."""
        self.out.mkdir(parents=True, exist_ok=True)
        rec = read_run_record(self.out)
        if rec is None or rec.get("command") != self.command:
            self._save({"command": self.command, "files": {}, "folders": {}})
        return self

    def _save(self, rec: dict) -> None:
        write_json(self.out / RUN_RECORD, rec)

    def _record(self) -> dict:
        rec = read_run_record(self.out)
        if rec is None or rec.get("command") != self.command:
            raise FileExistsError(f"{self.out / RUN_RECORD}: missing or changed during the run; nothing more is "
                                  "written there")
        return rec

    def write(self, name: str, produce: Callable[[Path], object]) -> Path:
        """Write the file ``name``: ``produce(path)`` writes a temporary file (same suffix), which then
        replaces ``name``; a file of that name this run's record does not hold is never replaced."""
        rec = self._record()
        path = self.out / name
        if (path.exists() or path.is_symlink()) and not owned_output(self.out, rec, name, "file"):
            raise FileExistsError(f"{path}: not written by `mfqat {self.command}` (or changed since); mfqat never "
                                  "replaces a file it did not write: move it away")
        tmp = self.out / f".{name}.{os.getpid()}.tmp{path.suffix}"
        try:
            produce(tmp)
            fsync_file(tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        rec["files"][name] = file_sha256(path)
        self._save(rec)
        return path

    def write_text(self, name: str, text: str) -> Path:
        """Write a text file (:meth:`write`)."""
        return self.write(name, lambda p: Path(p).write_text(text))

    def folder(self, name: str, kind: Optional[str]) -> Path:
        """Record a folder written into the run (by its own atomic writer); returns its path."""
        rec = self._record()
        rec["folders"][name] = kind
        self._save(rec)
        return self.out / name
