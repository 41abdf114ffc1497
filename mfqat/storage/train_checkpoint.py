"""Training checkpoints (``OUT/checkpoint-STEP``) that a resume can trust.

A checkpoint folder written by ``mfqat train`` / ``mfqat mlx-train`` carries one step file
(``mfqat_step.json`` / ``mlx_step.json``) holding the step and a manifest: the sha256 of every file
below the folder (sub-folders included, e.g. the anchor saved beside the state), sealed with a digest
(mfqat.storage.manifest.canonical_digest). A resume first verifies the folder against
that manifest and refuses anything else: a folder with no manifest, a truncated or edited file, a file
the manifest does not list (e.g. a ``custom_checkpoint_0.pkl`` dropped into a downloaded checkpoint,
which accelerate would unpickle with ``weights_only=False``), or a step that is not a positive integer.

Imports nothing heavy: the command line checks a ``--resume`` folder before any model loads.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Dict, Optional, Union

from mfqat.storage.io import sha256_file, write_json
from mfqat.storage.manifest import HEX64, AnchorError, canonical_digest

KIND = "mfqat-training-checkpoint"
UNSAFE = re.compile(r"custom_checkpoint_\d+\.pkl")  # accelerate: torch.load(weights_only=False)


def _files(folder: Path, meta_name: str) -> Dict[str, Path]:
    """{path relative to ``folder``: path} of every file below it but the step file; hidden names (the
    writer's ``.lock`` files) are skipped; a symlink anywhere is refused (it could point outside)."""
    found: Dict[str, Path] = {}
    for root, dirs, names in os.walk(folder):
        for n in sorted(dirs + names):
            p = Path(root) / n
            if n.startswith("."):
                if n in dirs:
                    dirs.remove(n)
                continue
            if p.is_symlink():
                raise AnchorError(f"{p}: a symlink in a checkpoint folder is refused")
            if n in names:
                rel = p.relative_to(folder).as_posix()
                if rel != meta_name:
                    found[rel] = p
    return found


def seal_checkpoint(folder: Union[str, Path], step: int, meta_name: str = "mfqat_step.json",
                    extra: Optional[dict] = None) -> Path:
    """Write ``meta_name`` = {step, sha256 of every file below ``folder``, ``extra`` (e.g. the run's settings),
    digest}; call it last."""
    folder = Path(folder)
    meta = {"kind": KIND, "step": int(step), **(extra or {}),
            "manifest": {rel: sha256_file(p) for rel, p in _files(folder, meta_name).items()}}
    meta["digest"] = canonical_digest(meta)
    write_json(folder / meta_name, meta)
    return folder / meta_name


def verify_checkpoint(folder: Union[str, Path], meta_name: str = "mfqat_step.json",
                      steps: Optional[int] = None) -> int:
    """The step of a checkpoint folder that :func:`seal_checkpoint` wrote and nobody changed since;
    AnchorError (a ValueError) naming what is wrong otherwise."""
    folder = Path(folder)
    where = f"--resume {folder}"
    if not folder.is_dir():
        raise AnchorError(f"{where}: no such checkpoint folder")
    if not (folder / meta_name).is_file():
        raise AnchorError(f"{where}: not a checkpoint this mfqat wrote ({meta_name} is missing); give an "
                          "OUT/checkpoint-STEP folder written with --save-every")
    try:
        meta = json.loads((folder / meta_name).read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise AnchorError(f"{where}: {meta_name}: corrupt JSON ({e})") from None
    if not isinstance(meta, dict) or "manifest" not in meta or meta.get("kind") != KIND:
        raise AnchorError(f"{where}: {meta_name} has no manifest (written by an older mfqat, or not by mfqat); "
                          "only checkpoints whose files mfqat can verify are resumed")
    try:
        digest_ok = meta.get("digest") == canonical_digest(meta)
    except (ValueError, TypeError):
        digest_ok = False
    if not digest_ok:
        raise AnchorError(f"{where}: {meta_name}: digest mismatch: the step file was edited or corrupted")
    manifest = meta["manifest"]
    if not isinstance(manifest, dict) or not all(isinstance(v, str) and HEX64.fullmatch(v) for v in manifest.values()):
        raise AnchorError(f"{where}: {meta_name}: field 'manifest' is not {{file: sha256}}")
    present = _files(folder, meta_name)
    pickles = [rel for rel in present if UNSAFE.fullmatch(rel)]
    if pickles:  # the digest is no signature: whoever edits a checkpoint can re-seal it
        raise AnchorError(f"{where}: refused: {pickles[0]}: mfqat never writes accelerate's custom pickles, which "
                          "accelerate loads with weights_only=False (they could run code)")
    extra = sorted(set(present) - set(manifest))
    if extra:
        raise AnchorError(f"{where}: refused: files not written by mfqat (not in its manifest): {extra[:3]}")
    for rel, digest in manifest.items():
        if rel not in present:
            raise AnchorError(f"{where}: {rel}: listed in {meta_name} but missing; the checkpoint is incomplete")
        if sha256_file(present[rel]) != digest:
            raise AnchorError(f"{where}: refused: {rel}: sha256 mismatch: the file is truncated or was modified")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise AnchorError(f"{where}: {meta_name}: step must be a positive integer, got {step!r}")
    if steps is not None and step > steps:
        raise AnchorError(f"{where}: the checkpoint is at step {step}, past --steps {steps}")
    return step
