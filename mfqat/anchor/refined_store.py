"""Writing learned affine scales and biases into an existing anchor (see mfqat.anchor.refined)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import save as save_safetensors_bytes

from mfqat.anchor.checkpoint import META_FILE, read_anchor
from mfqat.anchor.refined import REFINED_VERSION, refined_file
from mfqat.formats import canonical_name
from mfqat.quant.mxtensor import MXTensor
from mfqat.storage.guard import writer_lock
from mfqat.storage.io import current_umask, fsync_dir, write_json
from mfqat.storage.manifest import canonical_digest


def _write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~current_umask())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def add_refined(path: Path, fmt: str, group_size: int, tensors: Dict[str, MXTensor], info: dict,
                overwrite: bool = False) -> Path:
    """Store width ``fmt``'s learned scales and biases (``tensors``: the refined MXTensors) in the anchor at
    ``path``. The anchor is re-read and verified first; the new file is written and synced before mfqat.json
    is replaced, and the manifest gains only that file (files the anchor did not list stay unlisted). A width
    already stored is replaced only with ``overwrite``."""
    path = Path(path)
    fmt = canonical_name(fmt)
    with writer_lock(path):
        meta = dict(read_anchor(path).meta)
        refined = dict(meta.get("refined") or {})
        if fmt in refined and not overwrite:
            raise FileExistsError(f"{path}: already holds refined {fmt} scales ({refined[fmt]['file']}); pass "
                                  "--overwrite to replace them")
        missing = [n for n in tensors if n not in meta["tensors"]]
        if missing:
            raise ValueError(f"{path}: {missing[0]} is not a quantized tensor of the anchor")
        data = save_safetensors_bytes({f"{n}.{part}": t.contiguous() for n, q in tensors.items()
                                       for part, t in (("scales", q.scales.to(torch.bfloat16)),
                                                       ("biases", q.biases.to(torch.bfloat16)))})
        name = refined_file(fmt)
        _write_bytes(path / name, data)
        refined[fmt] = {"file": name, "group_size": int(group_size), "tensors": len(tensors), **info}
        meta["refined"] = refined
        meta["manifest"] = {**meta["manifest"], name: hashlib.sha256(data).hexdigest()}
        meta["format_version"] = max(int(meta["format_version"]), REFINED_VERSION)
        meta.pop("digest", None)
        meta["digest"] = canonical_digest(meta)
        write_json(path / META_FILE, meta)
        fsync_dir(path)
    return path
