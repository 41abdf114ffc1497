"""Writing learned scales into an existing anchor (`mfqat refine`; see mfqat.anchor.learned_scales)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, Optional

from mfqat._build import __version__
from mfqat._moved import old_names
from mfqat.anchor.checkpoint import META_FILE, read_anchor
from mfqat.anchor.learned_scales import LEARNED_SCALES_VERSION, encode_learned_scales
from mfqat.formats import canonical_name
from mfqat.quant.mxtensor import MXTensor
from mfqat.storage.guard import writer_lock
from mfqat.storage.io import fsync_dir, write_bytes, write_json
from mfqat.storage.manifest import canonical_digest


def add_learned_scales(path: Path, fmt: str, group_size: int, tensors: Dict[str, MXTensor], info: dict,
                overwrite: bool = False, learned_from: Optional[Dict[str, str]] = None) -> Path:
    """Store width ``fmt``'s learned scales and biases (``tensors``: MXTensors or LearnedScales) in the anchor at
    ``path``, under its writer lock (the one save_anchor takes).

    ``learned_from``: the weight files (``mfqat.json`` ``files``: name -> sha256) of the anchor the values were
    learned on; when the anchor at ``path`` now holds other weights (re-saved while refine was learning), the
    values would decode its codes wrongly, so they are refused. The new file gets a name of its own
    (``refined-affineK-<sha>.safetensors``) and is synced before ``mfqat.json`` is replaced atomically; a
    width's previous file is removed only after that, so a crash at any point leaves a readable anchor (at
    worst an unlisted orphan file, removed by the next call). The manifest gains only that file (files the
    anchor never listed stay unlisted). A width already stored is replaced only with ``overwrite``."""
    path = Path(path).absolute()  # the lock file save_anchor uses for this folder, whatever the cwd
    fmt = canonical_name(fmt)
    with writer_lock(path):
        meta = dict(read_anchor(path).meta)
        if int(meta.get("format_version", 1)) < 2 or "manifest" not in meta:
            raise ValueError(f"{path}: a format-version-1 anchor has no manifest to list learned scales in; "
                             "load and save it again with this mfqat (load_anchor, then save_anchor)")
        if learned_from is not None and meta["files"] != learned_from:
            raise ValueError(f"{path}: the anchor's weights changed while refine was learning (it was saved again); "
                             "its codes no longer match the learned scales: run mfqat refine again")
        stored = dict(meta.get("refined") or {})
        if fmt in stored and not overwrite:
            raise FileExistsError(f"{path}: already holds learned {fmt} scales ({stored[fmt]['file']}); pass "
                                  "--overwrite to replace them")
        missing = [n for n in tensors if n not in meta["tensors"]]
        if missing:
            raise ValueError(f"{path}: {missing[0]} is not a quantized tensor of the anchor")
        _remove_orphans(path, stored)
        name, data = encode_learned_scales(fmt, tensors)
        digest = hashlib.sha256(data).hexdigest()
        write_bytes(path / name, data)
        old = stored.get(fmt, {}).get("file")
        stored[fmt] = {"file": name, "group_size": int(group_size), "tensors": len(tensors),
                        "mfqat_version": __version__, **info}
        manifest = {k: v for k, v in meta["manifest"].items() if k != old}
        meta.update(refined=stored, manifest={**manifest, name: digest},
                    format_version=max(int(meta["format_version"]), LEARNED_SCALES_VERSION))
        meta.pop("digest", None)
        meta["digest"] = canonical_digest(meta)
        write_json(path / META_FILE, meta)
        fsync_dir(path)
        if old and old != name:
            (path / old).unlink(missing_ok=True)
    return path


def _remove_orphans(path: Path, stored: dict) -> None:
    """Delete ``refined-*.safetensors`` files no width lists (left by a crash between the two writes)."""
    listed = {e.get("file") for e in stored.values()}
    for f in path.glob("refined-*.safetensors"):
        if f.name not in listed:
            f.unlink(missing_ok=True)


__getattr__ = old_names(__name__, {"add_refined": "add_learned_scales"})  # its name in mfqat.anchor.refined_store
