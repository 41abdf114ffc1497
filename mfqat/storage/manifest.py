"""Manifests: a sha256 of every file of an artifact, in its metadata JSON, itself digested.

An artifact folder (anchor, MLX export, converted checkpoint) has one metadata file
(``mfqat.json`` / ``mfqat_export.json`` / ``mfqat_convert.json``) holding::

    "manifest": {"config.json": "<sha256>", "model.safetensors": "<sha256>", ...}
    "digest":   sha256 of the canonical JSON of the metadata without "digest"

so that any edit, by hand or by a bad tool, of any file (the metadata included) is refused.
The digest detects accidents and tampering by tools that do not know it; it is not a
signature. Files are read once through one directory handle (:class:`Snapshot`) and the
bytes that were hashed are the bytes that are parsed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

from mfqat.storage.io import sha256_file

HEX64 = re.compile(r"[0-9a-f]{64}")


class AnchorError(ValueError):
    """An mfqat artifact is missing, corrupt, or does not match what was asked (names file and field)."""


class Missing(AnchorError):
    """The artifact folder does not exist (or is being swapped in by a concurrent save)."""


class Replaced(Exception):
    """The folder was replaced by a concurrent save while it was read (retry)."""


def canonical_digest(meta: dict) -> str:
    """sha256 of the metadata's canonical JSON (sorted keys, no spaces), "digest" left out."""
    body = {k: v for k, v in meta.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal(meta: dict, folder: Path, meta_name: str = "mfqat.json") -> dict:
    """Add the manifest of every file in ``folder`` (but ``meta_name``) and the digest to ``meta``."""
    folder = Path(folder)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != meta_name)
    meta["manifest"] = {n: sha256_file(folder / n) for n in names}  # in chunks: shards can be GBs
    meta["digest"] = canonical_digest(meta)
    return meta


def check_name(name: object, where: str) -> str:
    """A file name in a manifest: a plain name inside the artifact (no folders, no '..')."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or name.startswith("."):
        raise AnchorError(f"{where}: {name!r} points outside the anchor / artifact folder (only plain file "
                          "names of files inside it are allowed)")
    return name


def check_digests(entries: object, where: str) -> Dict[str, str]:
    """A {file name: sha256 hex} mapping, every name confined to the artifact."""
    if not isinstance(entries, dict) or not entries:
        raise AnchorError(f"{where}: expected a non-empty object {{file name: sha256}}, got {type(entries).__name__}")
    for name, digest in entries.items():
        check_name(name, where)
        if not isinstance(digest, str) or not HEX64.fullmatch(digest):
            raise AnchorError(f"{where}.{name}: not a sha256 hex digest")
    return entries


class Snapshot:
    """Files of one artifact folder read through one directory handle, so a concurrent save
    (which renames a whole new folder in) cannot mix two versions into one read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise Missing(f"{self.path}: no such folder") from None
        except NotADirectoryError:
            raise AnchorError(f"{self.path}: not a folder") from None

    def close(self) -> None:
        """Release the directory handle."""
        os.close(self.fd)

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def replaced(self) -> bool:
        """True when the path now names another folder than the one being read."""
        try:
            return os.stat(self.path).st_ino != os.fstat(self.fd).st_ino
        except FileNotFoundError:
            return True

    def exists(self, name: str) -> bool:
        """True when ``name`` is a regular file in the folder."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_mode & 0o170000) == 0o100000

    def open(self, name: str) -> int:
        """A read-only descriptor of one file of the folder (no symlinks followed); the caller closes it."""
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self.fd)
        except FileNotFoundError:
            if self.replaced():
                raise Replaced(name) from None
            raise AnchorError(f"{self.path / name}: file listed in the metadata is missing") from None
        except OSError as e:
            raise AnchorError(f"{self.path / name}: cannot open ({e.strerror}; symlinks are refused)") from None

    def read(self, name: str) -> bytes:
        """The bytes of one file of the folder (no symlinks followed)."""
        with os.fdopen(self.open(name), "rb") as f:
            return f.read()

    def check_digest(self, name: str, actual: str, digest: Optional[str]) -> None:
        """Refuse ``name`` when its sha256 ``actual`` is not ``digest`` (None: no check)."""
        if digest is not None and actual != digest:
            if self.replaced():
                raise Replaced(name)
            raise AnchorError(f"{self.path / name}: sha256 mismatch: the file is truncated or was modified; "
                              "re-save or re-download it")

    def read_checked(self, name: str, digest: Optional[str]) -> bytes:
        """Read ``name`` and compare its sha256 with ``digest`` (None: no check)."""
        data = self.read(name)
        if digest is not None:
            self.check_digest(name, hashlib.sha256(data).hexdigest(), digest)
        return data

    def names(self) -> List[str]:
        """Every regular, non-hidden file name in the folder."""
        return sorted(n for n in os.listdir(self.fd) if not n.startswith(".") and self.exists(n))


def load_meta(snap: Snapshot, meta_name: str, what: str = "artifact",
              check_version: Optional[Callable[[dict, str], object]] = None) -> dict:
    """Parse and digest-check the metadata file of a snapshot; ``check_version(meta, where)`` runs
    first (a newer version may digest differently) and says when a digest is required."""
    where = snap.path / meta_name
    if not snap.exists(meta_name):
        if snap.replaced():
            raise Replaced(meta_name)
        raise AnchorError(f"{snap.path}: not an mfqat {what} ({meta_name} is missing)")
    try:
        meta = json.loads(snap.read(meta_name))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise AnchorError(f"{where}: corrupt JSON ({e}); re-save it") from None
    if not isinstance(meta, dict):
        raise AnchorError(f"{where}: expected a JSON object, got {type(meta).__name__}")
    if check_version is not None:
        check_version(meta, str(where))
    if "digest" in meta or "manifest" in meta:
        try:
            ok = meta.get("digest") == canonical_digest(meta)
        except (ValueError, TypeError):
            ok = False
        if not ok:
            raise AnchorError(f"{where}: digest mismatch: the metadata was edited or corrupted after it was "
                              "written; re-save it")
    return meta


def retry_read(path: Path, read, attempts: int = 5):
    """Run ``read(snapshot)``; when a concurrent save replaced the folder meanwhile, read again."""
    for i in range(attempts):
        try:
            with Snapshot(path) as snap:
                return read(snap)
        except Replaced:
            time.sleep(0.01 * (i + 1))
        except Missing:
            if i + 1 < attempts and (path.exists() or _swapping(path)):
                time.sleep(0.01 * (i + 1))
                continue
            raise
    raise AnchorError(f"{path}: replaced by a concurrent save {attempts} times while it was read; "
                      "retry when the writer is done")


def _swapping(path: Path) -> bool:
    """True when a writer is between its two renames (the path missing, a backup beside it)."""
    return not path.exists() and any(p.name.startswith(f".{path.name}.old-") for p in path.parent.iterdir())


def unlisted_entries(snap: Snapshot, listed: set) -> List[str]:
    """The non-hidden symlinks and subfolders of a snapshot's folder that ``listed`` does not name, each as
    ``"symlink NAME"`` / ``"folder NAME"`` (the files are :meth:`Snapshot.names`' job)."""
    out = []
    for n in sorted(os.listdir(snap.fd)):
        if n.startswith(".") or n in listed:
            continue
        try:
            mode = os.stat(n, dir_fd=snap.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            continue
        if (mode & 0o170000) == 0o120000:
            out.append(f"symlink {n}")
        elif (mode & 0o170000) == 0o040000:
            out.append(f"folder {n}")
    return out


def verify_folder(path: Path, meta_name: str, extra_ok: Iterable[str] = ()) -> dict:
    """Check every file of an artifact against its manifest; refuse files the manifest lacks."""
    def read(snap: Snapshot) -> dict:
        meta = load_meta(snap, meta_name)
        if "manifest" not in meta:
            raise AnchorError(f"{snap.path / meta_name}: no manifest (written before mfqat recorded one); re-save it")
        manifest = check_digests(meta["manifest"], f"{snap.path / meta_name}: field 'manifest'")
        for name, digest in manifest.items():
            snap.read_checked(name, digest)
        extra = [n for n in snap.names() if n not in manifest and n != meta_name and n not in extra_ok]
        if extra:
            raise AnchorError(f"{snap.path}: files not covered by the manifest: {extra[:5]}")
        odd = unlisted_entries(snap, set(manifest) | {meta_name} | set(extra_ok))
        if odd:
            raise AnchorError(f"{snap.path}: {', '.join(odd[:5])} not covered by the manifest (an artifact holds only "
                              "the files its manifest lists); remove them or re-save the artifact")
        return meta
    return retry_read(Path(path), read)
