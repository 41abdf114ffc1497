"""Who may write an artifact folder, and what a killed writer left behind.

Every name mfqat creates beside an output ``DEST`` is hidden and carries the writer's PID::

    .DEST.lock              exclusive flock held by the one writer for the whole save
    .DEST.PID-RAND.partial  the new folder being written by process PID
    .DEST.old-PID           the previous DEST while PID swaps the new one in

Single-writer rule: one process writes one path at a time; a second writer gets
:class:`WriterBusyError` at once (readers never block and never see a half-written folder).
Under the lock, leftovers of dead PIDs are cleaned: a backup is put back when ``DEST`` is
missing (a kill between the two renames), everything else is deleted, and each action is logged.
Only what mfqat provably wrote is deleted: a partial folder carries the hidden marker folder
``.mfqat-partial/`` naming its writer's PID (removed just after the folder is renamed in), a backup
is an artifact holding its kind's marker file; a folder that merely has such a name is left, with a
warning.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

LOG = logging.getLogger("mfqat")

# kind -> the marker file that makes a folder an mfqat artifact of that kind
KINDS = {"anchor": "mfqat.json", "mlx-export": "mfqat_export.json", "convert": "mfqat_convert.json",
         "mlx-checkpoint": "mlx_step.json", "peft-adapter": "adapter_config.json",
         "train-checkpoint": "mfqat_step.json", "hf-model": "config.json"}
RUN_RECORD = "mfqat_run.json"  # in a run's --out (train, mx-qlora): what that command wrote there


class WriterBusyError(RuntimeError):
    """Another process (or another save in this one) is writing the same path."""


class UnsafeOutputError(ValueError):
    """The output would replace the input or the current directory."""


@dataclass
class Stray:
    """A leftover of a save: a partial folder or a backup of the previous artifact."""
    path: Path
    kind: str  # "partial" or "old"
    pid: int


def is_kind(path: Path, kind: Optional[str]) -> bool:
    """True when ``path`` is a folder holding the marker file of ``kind``."""
    return kind in KINDS and (path / KINDS[kind]).is_file()


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists (ours counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_path(dest: Path) -> Path:
    """The lock file beside ``dest``."""
    return dest.parent / f".{dest.name}.lock"


@contextlib.contextmanager
def writer_lock(dest: Path) -> Iterator[None]:
    """Hold the exclusive writer lock of ``dest``; raise WriterBusyError when someone else does."""
    lp = lock_path(dest)
    while True:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WriterBusyError(f"{dest}: another process is writing it (lock {lp.name} is held); mfqat "
                                  "allows one writer per path: wait for that save to finish") from None
        try:
            same = os.stat(lp).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the previous holder removed the file as we locked it: lock the current one
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lp)  # still holding the lock, so nobody else holds this inode
        os.close(fd)


def partial_name(dest: Path) -> str:
    """The hidden name of a new partial folder for ``dest``."""
    return f".{dest.name}.{os.getpid()}-{os.urandom(4).hex()}.partial"


PARTIAL_MARK = ".mfqat-partial"  # a folder (never sealed into a manifest, which lists files) holding "pid"


def mark_partial(tmp: Path) -> None:
    """Mark a new partial folder as this process's (:func:`is_our_partial` reads the mark)."""
    (tmp / PARTIAL_MARK).mkdir()
    (tmp / PARTIAL_MARK / "pid").write_text(str(os.getpid()))


def unmark_partial(tmp: Path) -> None:
    """Remove the mark before the partial folder becomes the artifact."""
    shutil.rmtree(tmp / PARTIAL_MARK, ignore_errors=True)


def is_our_partial(path: Path, pid: int) -> bool:
    """True when ``path`` carries the mark :func:`mark_partial` makes, naming ``pid`` (a mark whose
    ``pid`` file is missing or empty is one the writer was killed while making or removing)."""
    mark = path / PARTIAL_MARK
    if mark.is_symlink() or not mark.is_dir():
        return False
    try:
        said = (mark / "pid").read_text().strip() if (mark / "pid").exists() else ""
    except (OSError, UnicodeDecodeError):
        return False
    return said in ("", str(pid))


def backup_path(dest: Path) -> Path:
    """Where the previous artifact waits while the new one is renamed in."""
    return dest.parent / f".{dest.name}.old-{os.getpid()}"


def find_strays(dest: Path) -> List[Stray]:
    """Partial folders and backups of ``dest`` (any PID) that mfqat left beside it."""
    name = re.escape(dest.name)
    partial = re.compile(rf"\.{name}\.(\d+)-[0-9a-f]+\.partial")
    old = re.compile(rf"\.{name}\.old-(\d+)")
    out = []
    if not dest.parent.is_dir():
        return out
    for p in dest.parent.iterdir():
        for kind, pat in (("partial", partial), ("old", old)):
            m = pat.fullmatch(p.name)
            if m and p.is_dir() and not p.is_symlink():
                out.append(Stray(p, kind, int(m.group(1))))
    return out


def ours(s: Stray, complete: Callable[[Path], bool]) -> bool:
    """True when mfqat provably wrote a stray: a partial with its mark, a backup that is ``complete``."""
    return is_our_partial(s.path, s.pid) if s.kind == "partial" else complete(s.path)


def recover(dest: Path, complete: Callable[[Path], bool]) -> List[str]:
    """Clean what dead writers left beside ``dest`` (call with the writer lock held).

    A backup is renamed back when ``dest`` is missing and the backup is ``complete``; other
    strays of dead PIDs that mfqat provably wrote (:func:`ours`) are deleted (backups only once
    ``dest`` exists); a folder that only looks like one is left with a warning. Returns (and logs)
    one line per action.
    """
    said: List[str] = []
    dead = []
    for s in find_strays(dest):
        if pid_alive(s.pid):
            continue
        if ours(s, complete):
            dead.append(s)
        elif _rmdir_empty(s.path):  # killed between mkdir and the mark: nothing in it to lose
            said.append(f"removed {s.path.name} beside {dest} (empty, left by killed process {s.pid})")
        else:
            said.append(f"left {s.path.name} beside {dest}: named like an mfqat leftover but it carries no mark "
                        "mfqat wrote; remove it yourself if it is not yours")
    if not dest.exists() and not dest.is_symlink():
        for s in sorted((s for s in dead if s.kind == "old"), key=lambda s: s.path.stat().st_mtime, reverse=True):
            if complete(s.path):
                os.replace(s.path, dest)
                dead.remove(s)
                said.append(f"restored {dest} from {s.path.name} (a save by process {s.pid} was killed "
                            "between its two renames)")
                break
    for s in dead:
        if s.kind == "old" and not dest.exists():
            said.append(f"kept {s.path.name} beside {dest}: it may be the only copy of an earlier save")
            continue
        remove_marks_last(s.path)
        said.append(f"removed {s.path.name} beside {dest} (left by killed process {s.pid})")
    pid_file = dest / PARTIAL_MARK / "pid"
    if (dest / PARTIAL_MARK).is_dir() and not dest.is_symlink():  # killed between its rename and unmark
        try:
            pid = int(pid_file.read_text().strip() or 0) if pid_file.is_file() else 0
        except (OSError, ValueError):
            pid = 0
        if not pid or not pid_alive(pid):
            shutil.rmtree(dest / PARTIAL_MARK, ignore_errors=True)
            said.append(f"removed the marker {PARTIAL_MARK} a killed save left inside {dest}")
    for line in said:
        LOG.warning("mfqat: %s", line)
    return said


def _rmdir_empty(path: Path) -> bool:
    """Remove ``path`` when it is an empty folder (True), else leave it (False)."""
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False


def remove_marks_last(path: Path) -> None:
    """Delete a folder mfqat wrote, its marks (the partial mark, the kinds' marker files) last, so that
    a kill during the deletion leaves a folder still recognized as mfqat's (or an empty one)."""
    def order(c: Path) -> int:  # config.json marks only an hf-model, and an anchor holds one too: before the rest
        return 3 if c.name == PARTIAL_MARK else 2 if c.name in KINDS.values() and c.name != "config.json" else \
            1 if c.name == "config.json" else 0
    children = sorted(path.iterdir(), key=order)
    for c in children:
        if c.is_dir() and not c.is_symlink():
            shutil.rmtree(c, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                c.unlink()
    _rmdir_empty(path)


def _overlaps(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_output(dest: Path, overwrite: bool, kind: Optional[str], protect: Sequence[Path] = ()) -> None:
    """Refuse an output that would lose data: the input, the cwd, a file, a folder not ours."""
    real = dest.resolve()
    for p in protect:
        if _overlaps(real, Path(p).resolve()):
            raise UnsafeOutputError(f"{dest}: the output would overwrite or sit inside the input {p}; choose another output")
    if real == Path.cwd().resolve() or real in Path.cwd().resolve().parents:
        raise UnsafeOutputError(f"{dest}: refusing to replace the current directory (or a folder holding it)")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise FileExistsError(f"{dest} exists and is not a folder; mfqat never deletes what it did not write: "
                              "remove it or choose another output")
    if not dest.exists() or not any(dest.iterdir()):
        return
    what = f"an mfqat {kind}" if kind else "an mfqat artifact"
    if not overwrite:
        raise FileExistsError(f"{dest} exists and is not empty; pass overwrite=True (--overwrite) to replace "
                              f"{what} written there before")
    if not is_kind(dest, kind):
        raise FileExistsError(f"{dest} is not {what} (no {KINDS.get(kind, 'marker file')}); refusing to "
                              "replace a folder mfqat did not write, even with overwrite")


def check_inputs(dest: Path, protect: Sequence[Optional[Path]], flag: str = "--out") -> None:
    """Refuse an output equal to, inside or above an existing input (UnsafeOutputError)."""
    real = Path(dest).resolve()
    for p in protect:
        if p and Path(p).exists() and _overlaps(real, Path(p).resolve()):
            raise UnsafeOutputError(f"{flag} {dest}: the output would overwrite, hold or sit inside the input {p}; "
                                    f"choose another {flag}")


def read_run_record(out: Path) -> Optional[dict]:
    """The run record of a run folder (:data:`RUN_RECORD`), None when it has none (or an unreadable one)."""
    f = Path(out) / RUN_RECORD
    if f.is_symlink() or not f.is_file():
        return None
    try:
        rec = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(rec, dict) and isinstance(rec.get("files"), dict) and isinstance(rec.get("folders"), dict)
    return rec if ok else None


def file_sha256(path: Path) -> str:
    """Hex sha256 of a (small) file."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def owned_output(out: Path, rec: Optional[dict], name: str, kind: Optional[str]) -> bool:
    """True when ``out/name`` is what the run recorded in ``rec`` wrote there: a file with the recorded
    sha256, or a recorded folder that (for a ``kind``) still holds that kind's marker file."""
    path = Path(out) / name
    if rec is None or path.is_symlink():
        return False
    if kind == "file":
        return path.is_file() and rec["files"].get(name) == file_sha256(path)
    return path.is_dir() and name in rec["folders"] and (kind is None or is_kind(path, kind))


def check_run_folder(out: Path, command: str, outputs: Dict[str, Optional[str]], overwrite: bool,
                     protect: Sequence[Optional[Path]] = (), resume: Optional[Path] = None) -> None:
    """Refuse a run's ``--out`` that would lose data, before any model loads.

    ``outputs`` maps each name the run writes into ``out`` to ``"file"`` or the kind of folder
    (:data:`KINDS`; None: a folder of no kind). ``out`` must not overlap an input (``protect``);
    an existing non-empty ``out`` must be an earlier run of the same ``command`` (its
    :data:`RUN_RECORD`) and needs ``overwrite`` (a ``resume`` from a checkpoint inside it
    continues that run); an output there is replaced only when that run wrote it and it is
    unchanged since (a user's file of the same name is never replaced).
    """
    out = Path(out)
    check_inputs(out, protect)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise FileExistsError(f"--out {out} exists and is not a folder; mfqat never deletes what it did not write: "
                              "remove it or choose another --out")
    if not out.exists() or not any(out.iterdir()):
        return
    rec = read_run_record(out)
    if rec is None or rec.get("command") != command:
        raise FileExistsError(f"--out {out} exists, is not empty and is no earlier `mfqat {command}` run (no "
                              f"{RUN_RECORD} of one); mfqat writes a run into a new or empty folder: choose another "
                              "--out")
    continuing = resume is not None and out.resolve() in Path(resume).resolve().parents
    if not overwrite and not continuing:
        raise FileExistsError(f"--out {out} holds an earlier `mfqat {command}` run; pass --overwrite to replace "
                              "its outputs, or choose another --out")
    for name, kind in outputs.items():
        path = out / name
        if (path.exists() or path.is_symlink()) and not owned_output(out, rec, name, kind):
            raise FileExistsError(f"--out {out}: {name} there was not written by `mfqat {command}` (or was changed "
                                  "since); mfqat never replaces a file it did not write: move it away or choose "
                                  "another --out")
