"""Validation of an anchor's ``mfqat.json`` and of the tensors read for it.

Every check raises :class:`~mfqat.storage.manifest.AnchorError` naming the file and the field, so that
malformed or crafted metadata never surfaces as a raw KeyError / ZeroDivisionError.

Format versions: 1 (``files``: sha256 per weight file, no manifest; still read), 2 (adds
``manifest`` over every file, ``digest`` over mfqat.json itself, ``full_precision``) and 3 (written
only when a format's scale rule is ``search``: the rule in ``scale_rules`` and a float32
``<tensor>.importance`` per searched tensor, which an older mfqat would ignore and lower wrongly) and 4
(written only when the anchor holds learned affine scales: ``refined``, mfqat.anchor.learned_scales).
"""
from __future__ import annotations

import re

from typing import Dict

import torch

from mfqat.anchor.learned_scales import check_learned_scales
from mfqat.formats import get_format
from mfqat.storage.manifest import AnchorError, check_digests, check_name
from mfqat.quant.reference import SCALE_RULES
from mfqat.quant.scale_rules import SEARCH_RULE, check_scale_rules

ANCHOR_FORMAT_VERSION = 4
BASE_FORMAT_VERSION = 2  # what an anchor without a searched format is written as (older mfqat reads it)
SEARCH_FORMAT_VERSION = 3  # an anchor with a searched format (version 4 only adds learned scales: mfqat refine)
TENSOR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _int(value: object, where: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise AnchorError(f"{where}: expected an integer >= {low}, got {value!r}")
    return value


def check_version(meta: dict, where: str) -> int:
    """format_version: an integer from 1 to the newest this mfqat reads."""
    v = meta.get("format_version")
    if isinstance(v, int) and not isinstance(v, bool) and v > ANCHOR_FORMAT_VERSION:
        raise AnchorError(f"{where}: anchor format version {v!r} is newer than this mfqat supports "
                          f"({ANCHOR_FORMAT_VERSION}); upgrade mfqat (written by mfqat {meta.get('mfqat_version')!r})")
    _int(v, f"{where}: field 'format_version'")
    if v >= 2 and "digest" not in meta:
        raise AnchorError(f"{where}: field 'digest' is missing (required from format version 2)")
    return v


def check_tensor_entry(name: object, e: object, anchor_format: str, block: int, where: str) -> None:
    """One ``tensors`` entry: format = the anchor's, a non-empty positive shape in whole blocks, a float dtype."""
    at = f"{where}: field 'tensors.{name}"
    if not isinstance(name, str) or not name:
        raise AnchorError(f"{where}: field 'tensors': tensor names must be non-empty strings, got {name!r}")
    if not isinstance(e, dict):
        raise AnchorError(f"{at}': expected an object, got {type(e).__name__}")
    if e.get("format") != anchor_format:
        raise AnchorError(f"{at}.format': {e.get('format')!r} is not the anchor's format {anchor_format!r}")
    shape = e.get("shape")
    if not isinstance(shape, list) or not shape:
        raise AnchorError(f"{at}.shape': expected a non-empty list of sizes, got {shape!r}")
    for s in shape:
        _int(s, f"{at}.shape'")
    if shape[-1] % block:
        raise AnchorError(f"{at}.shape': last size {shape[-1]} is not a multiple of block_size {block}")
    dtype = e.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
        raise AnchorError(f"{at}.dtype': {e.get('dtype')!r} is not one of {sorted(TENSOR_DTYPES)}")


TENSOR_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def check_tied(tied: object, tensors: dict, where: str) -> None:
    """The ``tied`` field: {alias: tensor name} of parameters saved once (an alias is then not an error
    when the weights lack it). Each a plain parameter name, the alias no quantized tensor of the anchor and
    not itself a target, no alias of itself: else a tampered entry could excuse a weight that is missing."""
    if not isinstance(tied, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
        raise AnchorError(f"{where}: field 'tied': expected an object {{alias: tensor name}}")
    for alias, target in tied.items():
        at = f"{where}: field 'tied.{alias}'"
        if not TENSOR_NAME.fullmatch(alias) or not TENSOR_NAME.fullmatch(target):
            raise AnchorError(f"{at}: {alias!r} -> {target!r} is not a pair of parameter names")
        if alias == target or alias in tensors or alias in tied.values() or target in tied:
            raise AnchorError(f"{at}: {alias} -> {target} is no alias of a saved tensor (an alias is not saved "
                              "itself, and points at a tensor that is); the anchor was edited: save it again")


def validate_meta(meta: dict, where: str) -> dict:
    """Check every field of a parsed mfqat.json (already digest-checked); return it."""
    version = check_version(meta, where)
    fmt = meta.get("anchor_format")
    try:
        f = get_format(fmt) if isinstance(fmt, str) else None
    except (KeyError, ValueError):
        f = None
    if f is None or not f.is_mx:
        raise AnchorError(f"{where}: field 'anchor_format': {fmt!r} is not an MX format")
    block = _int(meta.get("block_size"), f"{where}: field 'block_size'")
    if meta.get("scale_rule") not in SCALE_RULES:
        raise AnchorError(f"{where}: field 'scale_rule': {meta.get('scale_rule')!r} is not one of {SCALE_RULES}")
    if meta.get("scale_rules") is not None:
        try:
            check_scale_rules(meta["scale_rules"], "field 'scale_rules'")
        except ValueError as e:
            raise AnchorError(f"{where}: {e}") from None
        if version < 3 and SEARCH_RULE in meta["scale_rules"].values():
            raise AnchorError(f"{where}: field 'scale_rules': the 'search' rule needs format version 3, "
                              f"the file says {version}; the anchor was edited or is corrupt: save it again")
    tensors = meta.get("tensors")
    if not isinstance(tensors, dict):
        raise AnchorError(f"{where}: field 'tensors': expected an object, got {type(tensors).__name__}")
    for name, e in tensors.items():
        check_tensor_entry(name, e, f.name, block, where)
    check_tied(meta.get("tied", {}), tensors, where)
    files = check_digests(meta.get("files"), f"{where}: field 'files'")
    if version >= 2:
        manifest = check_digests(meta.get("manifest"), f"{where}: field 'manifest'")
        for name, digest in files.items():
            if manifest.get(name) != digest:
                raise AnchorError(f"{where}: field 'files.{name}' disagrees with the manifest")
    step = meta.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise AnchorError(f"{where}: field 'step': expected an integer or null, got {step!r}")
    fp = meta.get("full_precision", {})
    if not isinstance(fp, dict):
        raise AnchorError(f"{where}: field 'full_precision': expected an object {{tensor: reason}}")
    check_learned_scales(meta, version, where)
    return meta


def check_quantized(name: str, codes: torch.Tensor, scales: torch.Tensor, e: dict, bits: int, block: int,
                    where: str) -> None:
    """Codes and scales read for ``name``: uint8, with the shapes its entry implies."""
    for part, t in (("codes", codes), ("scales", scales)):
        if t.dtype != torch.uint8:
            raise AnchorError(f"{where}: tensor {name}.{part}: dtype {str(t.dtype).replace('torch.', '')}, "
                              "expected uint8")
    shape = tuple(e["shape"])
    want_codes = shape[:-1] + (shape[-1] * bits // 8,)
    want_scales = shape[:-1] + (shape[-1] // block,)
    if tuple(codes.shape) != want_codes or tuple(scales.shape) != want_scales:
        raise AnchorError(f"{where}: tensor {name}: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} "
                          f"do not match shape {shape} with {bits}-bit codes and block {block}")


def weight_files(meta: dict) -> Dict[str, str]:
    """{weight file: sha256} of a validated anchor (names already confined)."""
    return {check_name(n, "files"): d for n, d in meta["files"].items()}


def check_importance(name: str, imp: torch.Tensor, e: dict, where: str) -> torch.Tensor:
    """A stored ``<name>.importance``: float32, one finite non-negative entry per input column."""
    cols = e["shape"][-1]
    if imp.dtype != torch.float32 or tuple(imp.shape) != (cols,):
        raise AnchorError(f"{where}: tensor {name}.importance: {str(imp.dtype).replace('torch.', '')} "
                          f"{tuple(imp.shape)}, expected float32 ({cols},)")
    if not torch.isfinite(imp).all() or (imp < 0).any():
        raise AnchorError(f"{where}: tensor {name}.importance holds negative, NaN or Inf values; the file is "
                          "corrupt: save the anchor again")
    return imp
