"""Anchor checkpoints: one MXINT8 / MXFP8 model on disk, any lower format on load (docs/file-formats.md).

Directory layout (what ``from_pretrained`` users recognise, plus mfqat's own metadata)::

    config.json  tokenizer files  mfqat.json
    model.safetensors   (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)

Quantized tensors are stored as ``{name}.codes`` (packed uint8) and ``{name}.scales`` (E8M0
uint8); everything else as plain tensors. ``mfqat.json`` records the format version, anchor
format, block size, scale rule, every quantized tensor (format, shape, dtype), tied aliases,
the tensors kept in full precision and why, the training schedule and step, a sha256 per weight
file, and (format version 2) a manifest over every file plus a digest of itself (mfqat.storage.manifest).
Version-1 anchors (no manifest) are still read; their config and tokenizer are not checked.
"""
from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import torch
from torch import nn

from mfqat._build import __version__
from mfqat.anchor.meta import (ANCHOR_FORMAT_VERSION, BASE_FORMAT_VERSION, SEARCH_FORMAT_VERSION,  # noqa: F401
                          TENSOR_DTYPES,
                          check_importance, check_quantized, check_version, validate_meta, weight_files)
from mfqat.formats import canonical_name, get_format
from mfqat.storage.io import PathLike, atomic_directory, sha256_file, write_bytes, write_json
from mfqat.anchor.config import model_config, write_anchor_config
from mfqat._moved import renamed
from mfqat.anchor.learned_scales import (LEARNED_SCALES_VERSION, LearnedWidth, encode_learned_scales, learned_widths,
                                         pick, read_learned_scales)
from mfqat.qat.learned_scales import pop_learned
from mfqat.anchor.tensors import (default_targets, full_precision, quantize_targets,  # noqa: F401
                                 recorded_importance, unblockable)
from mfqat.storage.manifest import AnchorError, Snapshot, load_meta, retry_read, seal
from mfqat.storage.model_card import write_model_card
from mfqat.qat.prepare import qat_modules
from mfqat.storage.shard_files import MAX_SHARD_BYTES
from mfqat.storage.tensor_files import TensorFile, TensorFileError, sha256_fd, write_safetensors
from mfqat.anchor.lazy import LazyQuantized, LazyTensors, tensor_shape
from mfqat.storage.sharded import unique_state_dict
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.derive import DERIVED_GROUP_SIZE, check_reachable, derive, is_derived
from mfqat.quant.scale_rules import SEARCH_RULE, anchor_rules, anchor_scale_rules
from mfqat.quant.slice import slice_and_scale

META_FILE = "mfqat.json"


@dataclass
class Anchor:
    """An anchor read from disk: quantized tensors (MXTensor), plain tensors, metadata."""

    path: Path
    meta: dict
    quantized: Dict[str, MXTensor] = field(default_factory=dict)
    plain: Dict[str, torch.Tensor] = field(default_factory=dict)
    config: Optional[dict] = None  # config.json as read (checked from version 2), less mfqat's quantization_config
    learned_scales: Dict[str, LearnedWidth] = field(default_factory=dict)  # per affine width (version 4)
    files: Dict[str, TensorFile] = field(default_factory=dict, repr=False)  # open weight files (lazy reads)
    refined = renamed("Anchor", "refined", "learned_scales")

    def materialize(self) -> "Anchor":
        """Read every tensor now and keep it (plain dicts; the weight files are closed). Returns self."""
        if isinstance(self.quantized, LazyTensors):
            self.quantized = {k: self.quantized[k] for k in self.quantized}
        if isinstance(self.plain, LazyTensors):
            self.plain = {k: self.plain[k] for k in self.plain}
        _close(self.files)
        self.files = {}
        return self

    def shape(self, name: str) -> tuple:
        """Shape of tensor ``name`` (quantized or plain) without reading it."""
        return tensor_shape(self.quantized if name in self.quantized else self.plain, name)

    @property
    def format(self) -> str:
        """The anchor's own format."""
        return self.meta["anchor_format"]

    def in_format(self, fmt: Optional[str], group_size: int = DERIVED_GROUP_SIZE) -> Dict[str, MXTensor]:
        """Every quantized tensor converted to ``fmt`` (None: the anchor's) by Slice-and-Scale, or
        for a derived format by re-quantizing the dequantized anchor (affine: in groups of ``group_size``;
        nvfp4: blocks of 16; mfqat.quant.derive)."""
        if fmt is None:
            return dict(self.quantized)
        check_reachable(self.format, canonical_name(fmt), name=str(self.path))
        return {k: self.lowered(k, fmt, group_size) for k in self.quantized}

    def lowered(self, name: str, fmt: Optional[str], group_size: int = DERIVED_GROUP_SIZE) -> MXTensor:
        """One quantized tensor in ``fmt`` (None: the anchor's own), as :meth:`in_format` gives it."""
        q = self.quantized[name]
        if fmt is None:
            return q
        fmt = canonical_name(fmt)
        if is_derived(fmt):
            return self.derived(name, fmt, group_size, q.dequantize(torch.float32))
        return slice_and_scale(q, fmt)  # the recorded scale rules

    def derived(self, name: str, fmt: str, group_size: int = DERIVED_GROUP_SIZE,
                values: Optional[torch.Tensor] = None) -> MXTensor:
        """Quantized tensor ``name`` in the derived format ``fmt``: re-quantized from the anchor's values
        (``values`` when the caller already dequantized them), with the learned scales and biases the anchor
        stores for that width and group (mfqat.anchor.learned_scales)."""
        q = derive(self.quantized[name].dequantize(torch.float32) if values is None else values, fmt, group_size)
        width = pick(self.learned_scales, fmt, q.block_size)
        return width.apply(name, q) if width is not None else q

    def state_dict(self, fmt: Optional[str] = None, dtype: torch.dtype = torch.float32,
                   group_size: int = DERIVED_GROUP_SIZE) -> Dict[str, torch.Tensor]:
        """A full state dict with quantized weights dequantized in ``fmt``."""
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.plain.items()}
        for k, q in self.in_format(fmt, group_size).items():
            sd[k] = q.dequantize(dtype)
        return sd


def _write_learned(folder: Path, widths: Dict[str, Dict[str, MXTensor]], group_size: int,
                   step: Optional[int]) -> dict:
    """Write each width's learned-scales file into ``folder``; returns mfqat.json's ``refined`` field."""
    out = {}
    for fmt, tensors in widths.items():
        name, data = encode_learned_scales(fmt, tensors)
        write_bytes(folder / name, data)
        out[fmt] = {"file": name, "group_size": int(group_size), "tensors": len(tensors), "mfqat_version": __version__,
                    "learned": "with the weights (QATConfig.learn_scales)", "step": step}
    return out


def anchor_plan(model: nn.Module, fmt: Optional[str], block_size: int, scale_rule: str,
                targets: Optional[List[str]], scale_rules: Optional[Dict[str, str]]) -> tuple:
    """(format, block size, targets, recorded scale-rule table, the anchor format's rule) that
    :func:`save_anchor` quantizes with (the arguments of the same names, checked; see there)."""
    f = get_format(fmt or next((m.anchor_format for _, m in qat_modules(model) if m.anchor_format), "mxint8"))
    if not f.is_mx:
        raise ValueError(f"anchors are stored in an MX format (mxint8 or mxfp8 recommended), not '{f.name}'")
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"save_anchor: block_size={block_size!r} is not an integer; give the number of elements "
                        f"per block (e.g. {f.default_block_size})")
    f.check_block_size(block_size)  # 0, negative or a size the format does not take: one line, before any work
    if targets is None:
        prepared = [t for n, m in qat_modules(model) for t in m.target_names(n)]
        targets = prepared or default_targets(model, block_size)
        block_size = next((m.block_size for _, m in qat_modules(model)), block_size)
    model_rules = next((m.scale_rules for _, m in qat_modules(model) if m.scale_rules), None)
    recorded = anchor_rules(f.name, scale_rule, scale_rules if scale_rules is not None else model_rules)
    return f, block_size, targets, recorded, recorded[f.name]


def check_state(model: nn.Module, sd: Dict[str, torch.Tensor], tied: Dict[str, str], targets: List[str], f,
                block_size: int) -> None:
    """Refuse a state dict that holds LoRA adapters, lacks a target, or quantizes nothing (ValueError)."""
    if any("lora_" in k for k in sd):
        raise ValueError("the model holds LoRA adapters: merge them first (peft: model.merge_and_unload())")
    missing = [t for t in targets if t not in sd and t not in tied]
    if missing:
        raise ValueError(f"targets not found in the model's state dict: {missing[:5]}")
    if not any(k in targets for k in sd):  # an anchor of no quantized tensor would still be labelled with its formats
        odd = next(iter(unblockable(model, block_size).items()), None)
        raise ValueError(f"save_anchor: block_size {block_size} quantizes no tensor" + (f" ({odd[0]}: {odd[1]})"
                         if odd else " (the model has no decoder-block Linear to quantize)") + "; refusing an anchor "
                         "that would be labelled " + f.name + " while holding only full-precision weights")


def write_side_files(tmp: Path, model: nn.Module, tokenizer, fmt: str, block_size: int, scale_rule: str,
                     recorded: Dict[str, str], name: str) -> None:
    """config.json (with its quantization_config), the tokenizer files and the model card of an anchor."""
    config = getattr(model, "config", None)
    if config is not None:
        write_anchor_config(config, tmp, fmt, block_size, scale_rule, recorded)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    write_model_card(tmp, "anchor", getattr(config, "_name_or_path", None) or None, [fmt], name=name)


def save_anchor(model: nn.Module, path: PathLike, fmt: Optional[str] = None, tokenizer=None,
                block_size: int = 32, scale_rule: str = "floor", targets: Optional[List[str]] = None,
                step: Optional[int] = None, schedule: Optional[dict] = None,
                max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False,
                state_dict: Optional[Dict[str, torch.Tensor]] = None,
                scale_rules: Optional[Dict[str, str]] = None) -> Path:
    """Write an anchor checkpoint (atomic: a crash never leaves a half anchor that loads).

    Quantizes the MF-QAT modules' master weights of a prepared model, or (plain model,
    post-training quantization) every decoder-block Linear weight, to ``fmt``. An existing
    non-empty ``path`` is refused unless ``overwrite`` and it is an anchor (mfqat.storage.io.atomic_directory).
    A sharded (FSDP2) model needs ``state_dict``: its full state dict, gathered on every rank by
    :func:`mfqat.storage.sharded.full_state_dict`.

    ``fmt``: the anchor format; default the format a prepared model trained through (its
    ``anchor_format``, e.g. mxfp8_e4m3 for an MXFP family), else mxint8.

    Scale rules: ``scale_rules`` if given, else a prepared model's, else the measured defaults; the
    anchor is quantized with its format's rule and records its family's table, which ``load_anchor``
    slices with (:func:`mfqat.quant.scale_rules.anchor_rules`).
    """
    f, block_size, targets, recorded, scale_rule = anchor_plan(model, fmt, block_size, scale_rule, targets,
                                                               scale_rules)
    sd, tied = unique_state_dict(model, state_dict)
    learned = pop_learned(sd, tied)  # QATConfig.learn_scales: stored as the anchor's widths, not as tensors
    check_state(model, sd, tied, targets, f, block_size)
    tensors, entries = quantize_targets(sd, targets, f, block_size, scale_rule)
    tensors.update({f"{k}.importance": v for k, v in recorded_importance(model, entries, recorded).items()})
    version = SEARCH_FORMAT_VERSION if SEARCH_RULE in recorded.values() else BASE_FORMAT_VERSION
    fp = full_precision(model, sd, entries, block_size)
    group = next((m.affine_group_size for _, m in qat_modules(model)), DERIVED_GROUP_SIZE)
    learned = {k: v for k, v in learned.items() if k[0] in entries}  # a layer left out of the anchor: no width
    trained_through = {m.anchor_format for _, m in qat_modules(model) if m.anchor_format}
    if learned and trained_through != {f.name}:
        raise ValueError(f"save_anchor: the learned affine scales were trained on the codes derived from a "
                         f"{'/'.join(sorted(trained_through))} anchor, not {f.name}; they would decode this anchor's "
                         f"codes wrongly: save the anchor in {'/'.join(sorted(trained_through))}")
    widths = learned_widths(sd, learned, f, block_size, scale_rule, group)
    if widths:
        version = max(version, LEARNED_SCALES_VERSION)
    with atomic_directory(path, overwrite=overwrite, kind="anchor") as tmp:
        write_side_files(tmp, model, tokenizer, f.name, block_size, scale_rule, recorded, Path(path).name)
        files = write_safetensors(tmp, tensors, max_shard_bytes)
        meta = {"format_version": version, "mfqat_version": __version__, "anchor_format": f.name,
                "block_size": block_size, "scale_rule": scale_rule, "scale_rules": recorded,
                "tensors": entries, "tied": tied,
                "full_precision": fp, "schedule": schedule, "step": step,
                "files": {name: sha256_file(tmp / name) for name in files}}
        if widths:
            meta["refined"] = _write_learned(tmp, widths, group, step)
        write_json(tmp / META_FILE, seal(meta, tmp, META_FILE))
    return Path(path)


def read_meta(path: PathLike) -> dict:
    """Read and validate mfqat.json (digest, version, every field); AnchorError names file and field."""
    def read(snap: Snapshot) -> dict:
        return validate_meta(load_meta(snap, META_FILE, "anchor", check_version), str(snap.path / META_FILE))
    return retry_read(Path(path), read)


def _open_weights(snap: Snapshot, meta: dict, verify: bool) -> Dict[str, TensorFile]:
    """Every weight file opened (and hashed in chunks, from the descriptor it will be read through);
    {file: TensorFile} with each header checked."""
    files: Dict[str, TensorFile] = {}
    try:
        for name, digest in weight_files(meta).items():
            fd = snap.open(name)
            try:
                if verify:
                    snap.check_digest(name, sha256_fd(fd), digest)
                files[name] = TensorFile(fd, str(snap.path / name))
            except BaseException:
                os.close(fd)
                raise
    except TensorFileError as e:
        _close(files)
        raise AnchorError(str(e)) from None
    except BaseException:
        _close(files)
        raise
    return files


def _close(files: Dict[str, TensorFile]) -> None:
    for f in files.values():
        f.close()


def _read_snapshot(snap: Snapshot, verify: bool, lazy: bool = False) -> Anchor:
    """One consistent read of an anchor folder (see read_anchor)."""
    where = snap.path / META_FILE
    meta = validate_meta(load_meta(snap, META_FILE, "anchor", check_version), str(where))
    manifest = meta.get("manifest", {})
    if verify:
        later = {e["file"] for e in (meta.get("refined") or {}).values()}  # read and checked by read_learned_scales
        for name in manifest:
            if name not in meta["files"] and name != "config.json" and name not in later:
                snap.read_checked(name, manifest[name])
    config = None
    if snap.exists("config.json") or "config.json" in manifest:
        try:
            config = model_config(json.loads(snap.read_checked("config.json", manifest.get("config.json") if verify
                                                               else None)))
        except ValueError as e:
            raise AnchorError(f"{snap.path / 'config.json'}: corrupt JSON ({e})") from None
    files = _open_weights(snap, meta, verify)
    try:
        anchor = _index_tensors(snap, meta, files, config)
    except BaseException:
        _close(files)
        raise
    anchor.learned_scales = read_learned_scales(
        meta, lambda name: snap.read_checked(name, manifest.get(name) if verify else None), snap.path)
    if not lazy:
        anchor.materialize()
    return anchor


def _index_tensors(snap: Snapshot, meta: dict, files: Dict[str, TensorFile], config: Optional[dict]) -> Anchor:
    """The anchor's lazy tensor mappings, every name, shape and dtype checked against mfqat.json from the
    headers (values are read when asked for, and checked then)."""
    refs: Dict[str, tuple] = {}
    for f in files.values():
        for name, info in f.infos.items():
            if name in refs:
                raise AnchorError(f"{f.where}: tensor {name} is also in {refs[name][0].where}; the weight files do "
                                  "not match the metadata: save the anchor again")
            refs[name] = (f, info)
    bs = meta["block_size"]
    rules = anchor_scale_rules(meta)
    importance: Dict[str, torch.Tensor] = {}
    for k, e in meta["tensors"].items():
        if f"{k}.codes" not in refs or f"{k}.scales" not in refs:
            raise AnchorError(f"{snap.path}: tensor {k}: codes or scales missing from the weight files")
        (cf, ci), (_, si) = refs.pop(f"{k}.codes"), refs.pop(f"{k}.scales")
        meta_tensor = lambda i: torch.empty(i.shape, dtype=i.dtype, device="meta")  # noqa: E731
        check_quantized(k, meta_tensor(ci), meta_tensor(si), e, get_format(e["format"]).bits, bs, cf.where)
        if f"{k}.importance" in refs:
            f, _ = refs.pop(f"{k}.importance")
            importance[k] = check_importance(k, f.read(f"{k}.importance"), e, f.where)
    stray = [k for k in refs if k.endswith(".importance")]
    if stray:
        raise AnchorError(f"{refs[stray[0]][0].where}: tensor {stray[0]} belongs to no quantized tensor of "
                          f"mfqat.json; the weight files do not match the metadata: save the anchor again")
    codes = {k: refs_of(files, f"{k}.codes") for k in meta["tensors"]}

    def build(k: str) -> MXTensor:
        e = meta["tensors"][k]
        (cf, _), (sf, _) = codes[k], refs_of(files, f"{k}.scales")
        f = get_format(e["format"])
        c, s = cf.read(f"{k}.codes"), sf.read(f"{k}.scales")
        check_quantized(k, c, s, e, f.bits, bs, cf.where)
        q = MXTensor.unpack(c, s, f, bs, tuple(e["shape"]), TENSOR_DTYPES[e.get("dtype", "float32")],
                            scale_rule=meta["scale_rule"])
        q.slice_rules = rules
        q.importance = importance.get(k)
        return q

    anchor = Anchor(snap.path, meta, config=config)
    anchor.quantized = LazyQuantized({k: tuple(e["shape"]) for k, e in meta["tensors"].items()}, build)
    anchor.plain = LazyTensors(refs)
    anchor.files = files
    return anchor


def refs_of(files: Dict[str, TensorFile], name: str) -> tuple:
    """(file, info) of tensor ``name`` among an anchor's weight files."""
    for f in files.values():
        if name in f.infos:
            return f, f.infos[name]
    raise KeyError(name)


def read_anchor(path: PathLike, verify: bool = True, lazy: bool = False) -> Anchor:
    """Read an anchor: check hashes, shapes and formats; name the file or tensor that is wrong.

    Each weight file is hashed (in chunks) and read through one descriptor, so the bytes hashed are the
    bytes parsed; all files come from one folder even while another process saves over ``path`` (then
    the read is retried). ``lazy``: the tensors are read when asked for, one at a time and not kept
    (mfqat.anchor.lazy; what the streaming export uses), else all of them now.
    """
    return retry_read(Path(path), lambda snap: _read_snapshot(snap, verify, lazy))


def empty_model(config: dict, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The Hugging Face model of ``config`` - the class that builds the whole checkpoint, a vision-language
    release's included, as :func:`model_class` picks it - with its weights allocated but not initialised
    (they are about to be loaded: random init of a billion parameters costs minutes)."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.initialization import no_init_weights

    from mfqat.models import family_for

    auto = getattr(transformers, family_for(config["model_type"]).hf_auto_class)
    with no_init_weights():
        return auto.from_config(CONFIG_MAPPING[config["model_type"]].from_dict(config), dtype=dtype)


def unfilled(anchor: Anchor, names: Iterable[str]) -> List[str]:
    """The tensors among ``names`` (a model's state-dict keys) that must come from the anchor and that it
    does not hold: not a tied alias (``meta['tied']``: ``tie_weights`` fills it), not a vision tower's tensor
    when the anchor holds no tower tensor at all (a text-only anchor: a text forward never runs the tower)."""
    from mfqat.models import family_for

    held = set(anchor.quantized) | set(anchor.plain)
    tied = set(anchor.meta.get("tied", {}))
    family = family_for((anchor.config or {}).get("model_type"))
    text_only = not any(map(family.tower, held))
    return [k for k in names if k not in held and k not in tied and not (text_only and family.tower(k))]


def load_format(model: nn.Module, anchor: Anchor, fmt: Optional[str], group_size: int = DERIVED_GROUP_SIZE,
                plain: bool = True) -> None:
    """Load the anchor in ``fmt`` into ``model`` in place, one tensor at a time (a lazily read anchor is never
    held whole): each quantized tensor lowered and dequantized into the model's dtype, then (``plain``) the
    tensors kept in full precision. AnchorError when a name or shape does not match the model, and (``plain``:
    the model is being filled, e.g. one of :func:`empty_model` whose memory is uninitialised) before anything
    is read when the anchor lacks a tensor the model needs (:func:`unfilled`), which would stay garbage."""
    own = dict(model.state_dict(keep_vars=True))
    missing = unfilled(anchor, own) if plain else []
    if missing:
        raise AnchorError(f"{anchor.path}: the anchor holds no value for {len(missing)} tensor(s) of the model "
                          f"its config.json builds ({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); "
                          "they would be left uninitialised. The weights are incomplete or config.json names more "
                          "than they hold (a truncated or hand-edited anchor): save or copy the anchor again")
    names = [(k, True) for k in anchor.quantized] + ([(k, False) for k in anchor.plain] if plain else [])
    for k, quantized in names:
        if k not in own or tuple(own[k].shape) != tuple(anchor.shape(k)):
            raise AnchorError(f"{anchor.path}: tensor {k} {tuple(anchor.shape(k))} does not match the model "
                              f"({tuple(own[k].shape) if k in own else 'absent'}); config.json and the weights disagree")
        value = anchor.lowered(k, fmt, group_size).dequantize(torch.float32) if quantized else anchor.plain[k]
        with torch.no_grad():
            own[k].data.copy_(value)
        del value


def model_class(anchor: Anchor):
    """(the transformers Auto class of the whole checkpoint - a VL release's -, the HF config) of an anchor;
    AnchorError when its config.json is missing or names no known model_type."""
    import transformers
    from transformers import CONFIG_MAPPING

    from mfqat.models import family_for

    if not isinstance(anchor.config, dict) or anchor.config.get("model_type") not in CONFIG_MAPPING:
        raise AnchorError(f"{anchor.path}: config.json is missing or has no known model_type")
    config = CONFIG_MAPPING[anchor.config["model_type"]].from_dict(anchor.config)
    return getattr(transformers, family_for(anchor.config["model_type"]).hf_auto_class), config


def warn_kept_full_precision(anchor: Anchor, fmt: Optional[str], _stacklevel: int = 2) -> None:
    """Warn that the tensors the anchor kept in full precision for their odd width stay so in ``fmt``."""
    odd = [k for k, why in anchor.meta.get("full_precision", {}).items() if str(why).startswith("in_features")]
    if fmt is not None and odd and canonical_name(fmt) != anchor.format:
        warnings.warn(f"{anchor.path}: {', '.join(odd)} stay full precision in {fmt} (in_features not a multiple "
                      f"of the block size {anchor.meta['block_size']})", stacklevel=_stacklevel + 1)


def anchor_model(anchor: Anchor, fmt: Optional[str] = None, device: Union[str, torch.device] = "cpu",
                 dtype: torch.dtype = torch.float32, group_size: int = DERIVED_GROUP_SIZE,
                 _stacklevel: int = 2) -> nn.Module:
    """The Hugging Face model of an anchor already read, its quantized weights in ``fmt`` (see load_anchor)."""
    path = anchor.path
    sd = anchor.state_dict(fmt, dtype, group_size)
    warn_kept_full_precision(anchor, fmt, _stacklevel)
    auto, config = model_class(anchor)
    model = auto.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    real_missing = unfilled(anchor, missing)
    if real_missing or unexpected:
        raise AnchorError(f"{path}: weights do not match config.json: missing {real_missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    model.tie_weights()
    model = model.to(device).eval()
    model.mfqat_format = fmt or anchor.format
    return model
