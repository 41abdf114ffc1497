"""The learned scales kept in the anchor (anchor format version 4): per affine width, the bfloat16 scale
and bias of every group (docs/architecture.md, "Words").

Two things write them: ``save_anchor`` of a model trained with ``QATConfig.learn_scales`` (learned with the
weights, mfqat.qat.learned_scales; :func:`learned_widths`), and
``mfqat refine ANCHOR --formats affine4,...`` (mfqat.export.refine; written by
mfqat.anchor.learned_scales_store), which learns, for every width, the
bfloat16 scale and bias of each group of the affine model derived from the anchor, codes fixed. They
are stored beside the anchor's weights, one file per width::

    refined-affine4-<sha12>.safetensors    {tensor}.scales, {tensor}.biases   (bfloat16, [..., in / group])

and listed in ``mfqat.json`` under ``refined`` (``{"affine4": {"file", "group_size", "tensors", ...}}``) and in
its manifest, so a changed or truncated file is refused like any weight file (the on-disk names keep the word
of the ``mfqat refine`` command that first wrote them). The codes are not
stored: they are the derived ones (:func:`mfqat.quant.derive.derive_affine` of the anchor's values,
deterministic), so one anchor still reproduces every width code for code, now with its learned scales:
``load_anchor(anchor, "affine4")`` and ``export-mlx --recipe uniform:affine4`` use them. Adding a width
rewrites only ``mfqat.json`` (atomically, after the new file is on disk) and keeps every other file.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from mfqat._moved import old_names
from mfqat.formats import base_name, canonical_name, get_format
from mfqat.formats import ElementFormat
from mfqat.qat.learned_scales import learned_tensor
from mfqat.quant.api import quantize
from mfqat.quant.mxtensor import MXTensor
from mfqat.storage.manifest import AnchorError, check_name

LEARNED_SCALES_VERSION = 4  # the anchor format version that introduced learned scales (mfqat.json ``refined``)


@dataclass
class LearnedWidth:
    """One width's learned values: ``scales[name] = (scales, biases)``, bfloat16, per group of ``group_size``."""

    fmt: str
    group_size: int
    scales: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def apply(self, name: str, derived: MXTensor) -> MXTensor:
        """``derived`` (the tensor's derived affine codes in this width) with the learned scales and biases;
        AnchorError when the stored shapes do not fit (the anchor was edited)."""
        if name not in self.scales:
            return derived
        s, b = self.scales[name]
        if s.shape != derived.scales.shape or b.shape != derived.scales.shape:
            raise AnchorError(f"learned {self.fmt} scales: {name}: stored scales {tuple(s.shape)} do not fit the "
                              f"derived groups {tuple(derived.scales.shape)}; refine the anchor again")
        return MXTensor(derived.codes, s.float(), derived.fmt, derived.block_size, derived.dtype, b.float(),
                        derived.scale_rule)


def learned_scales_file(fmt: str) -> str:
    """The file holding width ``fmt``'s learned scales and biases."""
    return f"refined-{canonical_name(fmt)}.safetensors"


def encode_learned_scales(fmt: str, tensors: Dict[str, MXTensor]) -> Tuple[str, bytes]:
    """(file name, safetensors bytes) of width ``fmt``'s scales and biases: ``{name}.scales`` /
    ``{name}.biases`` in bfloat16, the name ``refined-affineK-<sha12>.safetensors`` (its own content hash,
    so a new width file never overwrites a listed one)."""
    data = save_safetensors_bytes({f"{n}.{part}": t.contiguous() for n, q in tensors.items()
                                   for part, t in (("scales", q.scales.to(torch.bfloat16)),
                                                   ("biases", q.biases.to(torch.bfloat16)))})
    digest = hashlib.sha256(data).hexdigest()
    return learned_scales_file(fmt).replace(".safetensors", f"-{digest[:12]}.safetensors"), data


def check_learned_scales_name(name: str, fmt: str, data: bytes, where: Path) -> None:
    """A width file is named ``refined-<fmt>-<sha12>.safetensors`` by :func:`encode_learned_scales`: refuse
    (AnchorError) a name for another width or whose hash is not the first 12 hex digits of the bytes' sha256
    (the file was changed and the anchor re-sealed)."""
    stem = learned_scales_file(fmt)[: -len(".safetensors")]
    m = re.fullmatch(re.escape(stem) + r"-([0-9a-f]{12})\.safetensors", name)
    if m is None:
        raise AnchorError(f"{where / name}: not named {stem}-<sha12>.safetensors as mfqat writes the {fmt} width; "
                          "refine the anchor again")
    if hashlib.sha256(data).hexdigest()[:12] != m.group(1):
        raise AnchorError(f"{where / name}: the file's sha256 does not start with the {m.group(1)} in its name: it was "
                          "changed after refine wrote it (and the anchor re-sealed); refine the anchor again")


def learned_widths(state: Dict[str, torch.Tensor], learned: Dict[Tuple[str, str], torch.Tensor], anchor: ElementFormat,
                   block_size: int, scale_rule: str, group_size: int) -> Dict[str, Dict[str, MXTensor]]:
    """{width: {tensor: MXTensor}} of the scales a model trained with ``learn_scales`` learned
    (``learned``: mfqat.qat.learned_scales.pop_learned), on the anchor's own values of each master weight in
    ``state``: the derived codes under the learned bfloat16 scales, exactly what its forward used."""
    out: Dict[str, Dict[str, MXTensor]] = {}
    for (name, fmt), ac in sorted(learned.items()):
        if name not in state:
            raise ValueError(f"save_anchor: learned {fmt} scales for {name}, which the state dict does not hold")
        values = quantize(state[name].float(), anchor, block_size, scale_rule).dequantize(torch.float32)
        out.setdefault(canonical_name(fmt), {})[name] = learned_tensor(values, fmt, group_size, ac.float().cpu())
    return out


def check_learned_scales(meta: dict, version: int, where: str) -> None:
    """Validate the ``refined`` field of mfqat.json (the learned scales, format version 4)."""
    entries = meta.get("refined")
    if entries is None:
        return
    if version < LEARNED_SCALES_VERSION:
        raise AnchorError(f"{where}: field 'refined' needs format version {LEARNED_SCALES_VERSION}, the file says "
                          f"{version}; the anchor was edited or is corrupt: save it again")
    if not isinstance(entries, dict):
        raise AnchorError(f"{where}: field 'refined': expected an object {{format: entry}}")
    manifest = meta.get("manifest") or {}
    for fmt, e in entries.items():
        try:
            family = get_format(fmt).family
        except (KeyError, ValueError):
            family = None
        if family != "affine":
            raise AnchorError(f"{where}: field 'refined': {fmt!r} is not an affine width (affine2..affine8)")
        if not isinstance(e, dict) or not isinstance(e.get("group_size"), int) or isinstance(e.get("group_size"), bool) \
                or e["group_size"] < 1:
            raise AnchorError(f"{where}: field 'refined.{fmt}': expected an object with a positive 'group_size'")
        try:
            get_format(fmt).check_block_size(e["group_size"])
        except ValueError as err:
            raise AnchorError(f"{where}: field 'refined.{fmt}.group_size': {err}") from None
        name = check_name(e.get("file"), f"{where}: field 'refined.{fmt}.file'")
        if name not in manifest:
            raise AnchorError(f"{where}: field 'refined.{fmt}.file': {name} is not in the manifest")


def read_learned_scales(meta: dict, read_bytes, where: Path) -> Dict[str, LearnedWidth]:
    """{fmt: LearnedWidth} of an anchor whose mfqat.json was validated; ``read_bytes(name)`` returns a file's
    checked bytes. A tensor the file names that the anchor does not quantize is refused."""
    out: Dict[str, LearnedWidth] = {}
    for fmt, e in (meta.get("refined") or {}).items():
        data = read_bytes(e["file"])
        check_learned_scales_name(e["file"], fmt, data, where)
        try:
            raw = load_safetensors_bytes(data)
        except AnchorError:
            raise
        except Exception as err:  # safetensors raises its own types on a bad header
            raise AnchorError(f"{where / e['file']}: cannot read safetensors ({err})") from None
        width = LearnedWidth(canonical_name(fmt), e["group_size"], info=dict(e))
        for key in raw:
            if not key.endswith(".scales"):
                continue
            name = key[: -len(".scales")]
            if name not in meta["tensors"] or f"{name}.biases" not in raw:
                raise AnchorError(f"{where / e['file']}: {key}: no such quantized tensor, or its biases are missing; "
                                  "refine the anchor again")
            for part in (key, f"{name}.biases"):
                t = raw[part]
                if t.dtype != torch.bfloat16 or not bool(torch.isfinite(t).all()):
                    raise AnchorError(f"{where / e['file']}: {part}: learned scales and biases are finite bfloat16 "
                                      f"values, got {t.dtype}" + ("" if t.dtype != torch.bfloat16 else
                                      " holding NaN or infinite values (a width learned from diverged training, "
                                      "or an edited file)") + "; refine the anchor again")
            width.scales[name] = (raw[key], raw[f"{name}.biases"])
        out[width.fmt] = width
    return out


def learned_scale_widths(meta: dict) -> Dict[str, int]:
    """{width: group size} of the learned scales an anchor's mfqat.json lists (no file read)."""
    return {fmt: e["group_size"] for fmt, e in (meta.get("refined") or {}).items()}


def pick(stored: Dict[str, LearnedWidth], fmt: str, group_size: int) -> Optional[LearnedWidth]:
    """The stored width for ``fmt`` at ``group_size``, or None (other groups use the derived values)."""
    width = stored.get(base_name(fmt))  # affine3@g128: affine3's learned scales, when learnt in groups of 128
    return width if width is not None and width.group_size == group_size else None


# the names these had in mfqat.anchor.refined (one release)
__getattr__ = old_names(__name__, {"REFINED_VERSION": "LEARNED_SCALES_VERSION", "RefinedWidth": "LearnedWidth",
                                   "refined_file": "learned_scales_file", "encode_refined": "encode_learned_scales",
                                   "check_refined_name": "check_learned_scales_name",
                                   "check_refined": "check_learned_scales", "read_refined": "read_learned_scales",
                                   "refined_widths": "learned_scale_widths"})
