"""Up-front checks of the `mfqat` command line: user mistakes fail in a line, before any model loads.

Each check raises :class:`UsageError`; mfqat.cli.app prints it as ``mfqat <cmd>: error: ...`` and exits 2.
Only cheap checks live here (paths, names, flag combinations), so they import nothing heavy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path
from typing import Iterable, Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
BUILTIN_MODELS = ("smollm2", "tiny")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class UsageError(ValueError):
    """A mistake on the command line (exit status 2)."""


def is_anchor(path: Optional[str]) -> bool:
    """True when ``path`` is an mfqat anchor folder."""
    return bool(path) and (Path(path) / "mfqat.json").is_file()


def has_tokenizer(folder: str) -> bool:
    """True when ``folder`` holds tokenizer files (what AutoTokenizer / mlx_lm.load read)."""
    return any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def need_path(path: Optional[str], flag: str, what: str = "file or folder") -> None:
    """``path`` (given with ``flag``) must exist."""
    if path and not Path(path).exists():
        raise UsageError(f"{flag} {path}: no such {what}")


def need_output(out: str, overwrite: bool, kind: str, protect: Iterable[str] = ()) -> None:
    """``--out`` of convert / export-mlx, checked before any model loads (the writer checks again under
    its lock): not the input or the cwd, not a file, not a non-empty folder without ``--overwrite`` (nor,
    with it, a folder that is no mfqat ``kind``), and inside a folder this process can write in."""
    from mfqat.storage.guard import check_output  # stdlib only

    dest = Path(out).absolute()
    try:
        check_output(dest, overwrite, kind, [Path(p) for p in protect if p])
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    need_writable_file(out, "--out")  # its nearest existing folder is one this process can write in


def need_searched_format(fmt: Optional[str]) -> None:
    """``convert --scale-search`` needs a ``--to`` that the search can serve (mxint6..mxint3, and the
    MXFP formats an anchor trained with the search rule: mfqat.anchor.search.searchable_formats)."""
    from mfqat.formats import canonical_name
    from mfqat.quant.scale_rules import SEARCH_RULE_FORMATS  # loads torch: only with --scale-search

    if not fmt or canonical_name(fmt) not in SEARCH_RULE_FORMATS:
        raise UsageError(f"--scale-search: --to {fmt or '(the anchor format)'} is not searched; the search serves "
                         f"{', '.join(SEARCH_RULE_FORMATS)} (other formats keep their scale rule)")


ANCHOR_FORMATS = ("mxint8", "mxfp8_e4m3")  # what an anchor (and export-mlx's PTQ anchor of a model) holds


def need_something_to_refine(a: argparse.Namespace) -> None:
    """``--refine`` with ``uniform:`` an anchor format: every tensor is exported as the anchor stores it, so there is
    nothing to learn; refused before a PTQ anchor is written or the anchor read."""
    from mfqat.formats import canonical_name

    kind, _, fmt = a.recipe.partition(":")
    try:
        fmt = canonical_name(fmt) if kind == "uniform" and fmt else None
    except (KeyError, ValueError):
        return  # an unknown format: the recipe's own check names it
    if a.refine and fmt in ANCHOR_FORMATS:
        raise UsageError(f"--refine with recipe {a.recipe!r}: every tensor stays in the anchor's own 8-bit format, "
                         "which is exported as stored (nothing to learn): choose a lower format (e.g. uniform:affine4, "
                         "uniform:mxint4, uniform:nvfp4) or drop --refine")


def need_calib_sources(spec: Optional[str]) -> None:
    """``--calib-text PATH[:WEIGHT],...``: every source exists ('pydoc' and 'generated' are built in),
    weights positive."""
    if not spec:
        return
    from mfqat.data.mix import parse_mix

    try:
        sources = parse_mix(spec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for path, _ in sources:
        if path not in ("pydoc", "generated"):
            need_path(path, "--calib-text")


def need_affine_for_gptq(a) -> None:
    """``export-mlx --gptq`` changes the codes of derived affine matrices: refused up front (before a PTQ anchor
    or a sensitivity pass) for a recipe that plans none."""
    if not getattr(a, "gptq", False):
        return
    from mfqat.export.recipes import parse_recipe  # loads torch: only with --gptq

    try:
        family = parse_recipe(a.recipe)[2]
    except (ValueError, KeyError):
        return  # an unknown recipe is refused by the export, which names the recipes
    if family != "affine":
        raise UsageError(f"--gptq with --recipe {a.recipe}: GPTQ changes the codes of derived affine matrices and "
                         "this recipe plans none; use an affine recipe (uniform:affine4, auto:BPW:affine, seed:affine) "
                         "or drop --gptq")


def need_calib_text(a) -> None:
    """``--calib-text`` (of eval / convert) goes with ``--scale-search`` and must exist."""
    if a.calib_text and not a.scale_search:
        raise UsageError("--calib-text calibrates the scale search: add --scale-search")
    need_calib_sources(a.calib_text)


def need_model(path: Optional[str], flag: str) -> None:
    """A model argument: a built-in name, an existing folder with config.json, or a .gguf file."""
    if not path or path in BUILTIN_MODELS:
        return
    p = Path(path)
    if p.suffix == ".gguf":
        return need_path(path, flag, ".gguf file")
    if not p.is_dir():
        if HUB_ID.fullmatch(path):
            return  # a Hub id: transformers resolves it (from its cache when offline)
        raise UsageError(f"{flag} {path}: no such model folder (give a local HF folder, an anchor, a .gguf file, "
                         f"a Hub id or one of {', '.join(BUILTIN_MODELS)})")
    if not (p / "config.json").is_file():
        raise UsageError(f"{flag} {path}: not a model folder (no config.json)")
    need_config(path, flag)


CONFIG_SIZES = ("hidden_size", "num_hidden_layers", "vocab_size")  # what every supported family's config gives


def need_config(path: str, flag: str) -> None:
    """A model folder's config.json: a JSON object whose (text) model config has positive integer
    :data:`CONFIG_SIZES`; without them transformers builds a model of its default sizes and the weights
    do not fit (a traceback after the model loaded, or a model of the wrong shape)."""
    f = Path(path) / "config.json"
    try:
        cfg = json.loads(f.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"{flag} {path}: config.json is not readable JSON ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{flag} {path}: config.json is not a JSON object")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    for key in CONFIG_SIZES:
        v = text.get(key, cfg.get(key))
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"{flag} {path}: config.json has no positive integer '{key}' (got {v!r}); the weights "
                             "cannot be placed in a model without it: restore the model's own config.json")


def need_formats(names: Iterable[str], flag: str) -> None:
    """Every name is a known element format."""
    from mfqat.formats import ALIASES, known_formats

    known = set(known_formats())
    for n in names:
        if n and n.lower() not in known and n.lower() not in ALIASES:
            raise UsageError(f"{flag}: unknown format '{n}'; known formats: {', '.join(sorted(known))}")


def need_tokenizer(model: str, tokenizer: Optional[str], cmd: str) -> None:
    """An anchor without tokenizer files needs --tokenizer (a folder that has them)."""
    if tokenizer:
        need_path(tokenizer, "--tokenizer", "folder")
        if not has_tokenizer(tokenizer):
            raise UsageError(f"--tokenizer {tokenizer}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) there")
    elif is_anchor(model) and not has_tokenizer(model):
        raise UsageError(f"{model}: the anchor has no tokenizer (it was saved without one); pass --tokenizer DIR, a "
                         f"folder with the model's tokenizer files, e.g. the model it was trained from")


def positional_or_model(a: argparse.Namespace, dest: str, cmd: str) -> None:
    """``mfqat CMD X`` or ``mfqat CMD --model X`` (mlx-lm's spelling): set ``a.<dest>``."""
    pos, flag = getattr(a, dest), getattr(a, "model_flag", None)
    if pos and flag and pos != flag:
        raise UsageError(f"two models given ({pos} and --model {flag}); give one")
    setattr(a, dest, pos or flag)
    if not getattr(a, dest):
        raise UsageError(f"the model is missing: mfqat {cmd} MODEL (or --model MODEL)")


def at_least(a: argparse.Namespace, minimums: dict) -> None:
    """Numeric flags below their minimum ({dest: minimum}) fail here, before any model loads."""
    from mfqat.train.args import at_least as check_minimums

    try:
        check_minimums(a, minimums)
    except ValueError as e:
        raise UsageError(str(e)) from None


def finite(a: argparse.Namespace) -> None:
    """Every float flag is a finite number (nan and inf pass a ``<`` check; they fail here)."""
    for dest, v in vars(a).items():
        if isinstance(v, float) and not math.isfinite(v):
            raise UsageError(f"--{dest.replace('_', '-')} must be a finite number, got {v}")


def positive(a: argparse.Namespace, dest: str) -> None:
    """``a.<dest>`` > 0 (a learning rate: zero learns nothing, a negative one climbs the loss)."""
    v = getattr(a, dest)
    if v is not None and not v > 0:
        raise UsageError(f"--{dest.replace('_', '-')} must be > 0, got {v}")


AUTO_FAMILIES = {"mxint": "mxint2", "mxfp": "mxfp4_e2m1", "affine": "affine3"}  # the lowest level of each ladder


def need_one_group_unless_auto(a: argparse.Namespace) -> None:
    """``--group-size 64,128`` (several groups) only with ``--recipe auto:BPW:affine``: levels of its plan."""
    if isinstance(a.group_size, tuple) and not (a.recipe.startswith("auto:") and a.recipe.endswith(":affine")):
        raise UsageError(f"--group-size {','.join(map(str, a.group_size))} with --recipe {a.recipe}: several groups are "
                         "levels of an auto:BPW:affine plan; give one group (e.g. --group-size 64) for this recipe")


def need_auto_budget(a: argparse.Namespace) -> None:
    """``--recipe auto:BPW[:FAMILY]``: BPW a finite number no lower than the smallest plan (every tensor in
    the family's lowest level: its MX figure, then, for an anchor, the stored bits it would write, norms
    and headers included, from the anchor's shapes: mfqat.export.recipes.check_stored_budget) and no higher
    than 16 (bfloat16), FAMILY one of the ladders; checked before the sensitivity pass (minutes) rather than
    after it."""
    kind, _, rest = a.recipe.partition(":")
    if kind != "auto":
        return
    budget, _, family = rest.partition(":")
    try:
        bpw = float(budget)
    except ValueError:
        raise UsageError(f"--recipe {a.recipe}: write the budget in bits per weight, e.g. auto:4.5") from None
    if family and family not in AUTO_FAMILIES:
        raise UsageError(f"--recipe {a.recipe}: unknown family '{family}'; choose from {', '.join(AUTO_FAMILIES)}")
    if not family:
        family = anchor_family(a.anchor) or "mxint"
    from mfqat.formats import get_format

    lowest = AUTO_FAMILIES.get(family, "mxint2")
    groups = a.group_size if isinstance(a.group_size, tuple) else (a.group_size,)
    group = max(groups) if family == "affine" else anchor_block_size(a.anchor)  # the cheapest a tensor may take
    floor = get_format(lowest).bits_per_weight(group)
    if not math.isfinite(bpw) or not floor <= bpw <= 16:
        raise UsageError(f"--recipe {a.recipe}: the budget must be a number of bits per weight from {floor:g} (every "
                         f"tensor in {lowest}) to 16, got {budget}")
    if is_anchor(a.anchor):  # the budget counts the stored bytes: the smallest plan's, from the anchor's shapes
        from mfqat.anchor.checkpoint import AnchorError, read_anchor
        from mfqat.export.recipes import check_stored_budget
        from mfqat.export.sensitivity import BudgetTooSmall

        try:
            anchor = read_anchor(a.anchor, lazy=True)
        except (AnchorError, OSError, ValueError):
            return  # the export reports what is wrong with the anchor itself
        try:
            check_stored_budget(anchor, a.recipe, a.group_size, a.scale_dtype)
        except BudgetTooSmall as exc:
            raise UsageError(str(exc)) from None
        except (ValueError, OSError):
            return  # anything else: the export names it


def _anchor_meta(path: Optional[str]) -> dict:
    try:
        meta = json.loads((Path(path) / "mfqat.json").read_text()) if is_anchor(path) else {}
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def anchor_family(path: Optional[str]) -> Optional[str]:
    """The format family of an anchor's mfqat.json (None: not an anchor, or unreadable)."""
    from mfqat.formats import get_format

    try:
        return get_format(_anchor_meta(path).get("format")).family
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def anchor_block_size(path: Optional[str]) -> int:
    """An anchor's block size (32 when it does not say)."""
    bs = _anchor_meta(path).get("block_size")
    return bs if isinstance(bs, int) and bs > 0 else 32


def can_write_in(folder: Path) -> bool:
    """True when this process can create a file in ``folder`` (asked of the file system with a temporary
    file, removed at once: permission bits say nothing for root, or on a read-only mount)."""
    import tempfile

    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".mfqat-probe-"):
            return True
    except OSError:
        return False


def need_writable_file(path: str, flag: str) -> None:
    """A file to be written: its folder (the nearest existing one) is a folder this process can write in."""
    parent = Path(path).absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder; choose another {flag}")
    if not can_write_in(parent):
        raise UsageError(f"{flag} {path}: cannot write in {parent} (no write permission, or a read-only file "
                         f"system); choose another {flag}")


def need_writable_out(out: str) -> None:
    """A run's --out (train, mx-qlora, mlx-train): it, or the nearest folder above it that exists, is a
    folder this process can write in (checked before the minutes of training, not at the first save)."""
    need_writable_file(str(Path(out) / "summary.json"), "--out")


def need_writable_anchor(anchor: str) -> None:
    """``refine`` changes the anchor in place (a new width file, mfqat.json replaced) and takes the writer
    lock beside it: both folders must be writable, checked before the minutes of learning."""
    folder = Path(anchor).absolute()
    for where in (folder, folder.parent):
        if not can_write_in(where):
            raise UsageError(f"{anchor}: cannot write in {where} (read-only, or no write permission); refine stores "
                             "the learned scales in the anchor: copy it somewhere writable and refine the copy")


def check(cmd: str, a: argparse.Namespace) -> None:
    """The up-front checks of one subcommand's parsed arguments."""
    if cmd == "train":
        from mfqat.train.args import check_train_args

        check_train_args(a)
        need_model(a.model, "--model")
        if a.text and a.dataset:
            raise UsageError("give --text (plain text) or --dataset, not both")
        need_path(a.text, "--text")
        need_path(a.dataset, "--dataset")
        from mfqat.train.args import check_resume, check_train_output  # argparse only: nothing heavy
        try:
            check_resume(a)
            check_train_output(a)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        need_writable_out(a.out)
        need_formats((a.formats or "").split(",") + a.eval_formats.split(","), "--formats/--eval-formats")
        if a.anchor_format:
            need_formats([a.anchor_format], "--anchor-format")
    elif cmd == "mlx-train":
        if a.model and a.model_flag and a.model != a.model_flag:
            raise UsageError(f"two models given ({a.model} and --model {a.model_flag}); give one")
        need_model(a.model or a.model_flag, "MODEL")
        if a.text and getattr(a, "data", None):
            raise UsageError("give --text (plain text) or --data (a folder with train.jsonl), not both")
        need_path(a.text, "--text")
        need_path(getattr(a, "data", None), "--data", "folder")
        need_formats((a.formats or "").split(",") + (a.eval_formats or "").split(","), "--formats/--eval-formats")
        from mfqat.mlx.train import MLX_MINIMUMS, check_outputs

        at_least(a, MLX_MINIMUMS)
        try:
            check_outputs(a)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        need_writable_out(a.out)
        if a.resume:
            from mfqat.storage.train_checkpoint import verify_checkpoint

            verify_checkpoint(a.resume, "mlx_step.json", a.steps)
    elif cmd == "mx-qlora":
        if not is_anchor(a.anchor):
            raise UsageError(f"{a.anchor}: not an mfqat anchor (no mfqat.json); mx-qlora trains on an anchor")
        if not has_tokenizer(a.anchor):
            raise UsageError(f"{a.anchor}: the anchor has no tokenizer; mx-qlora tokenizes with it (save the anchor "
                             "with its tokenizer)")
        need_config(a.anchor, "ANCHOR")
        from mfqat.mxqlora.train import QLORA_MINIMUMS, check_outputs as check_qlora_outputs

        finite(a)
        at_least(a, QLORA_MINIMUMS)
        positive(a, "lr")
        try:
            check_qlora_outputs(a)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        need_writable_out(a.out)
        need_path(a.text, "--text")
        need_formats((a.formats or "").split(",") + a.eval_formats.split(","), "--formats/--eval-formats")
    elif cmd in ("convert", "export-mlx"):
        positional_or_model(a, "anchor", cmd)
        need_output(a.out, a.overwrite, "convert" if cmd == "convert" else "mlx-export", [a.anchor])
        if cmd == "convert":
            if not is_anchor(a.anchor):
                raise UsageError(f"{a.anchor}: not an mfqat anchor (no mfqat.json); convert reads anchors")
            need_config(a.anchor, "ANCHOR")
            need_formats([a.to or ""], "--to")
            if a.scale_search:
                if not has_tokenizer(a.anchor):
                    raise UsageError(f"{a.anchor}: --scale-search calibrates with the anchor's tokenizer; this "
                                     "anchor has none (save_anchor(..., tokenizer=...))")
                need_searched_format(a.to)
            need_calib_text(a)
        else:
            need_model(a.anchor, "ANCHOR")
            need_tokenizer(a.anchor, a.tokenizer, cmd)
            if a.tokenizer and a.recipe.startswith("auto") and not has_tokenizer(a.anchor):
                raise UsageError("--recipe auto:BPW calibrates with the anchor's own tokenizer; this anchor has "
                                 "none: use uniform:FMT or seed with --tokenizer")
            need_calib_sources(a.calib_text)
            need_path(a.imatrix_path, "--imatrix-path", "imatrix GGUF file")
            need_one_group_unless_auto(a)
            need_auto_budget(a)
            finite(a)
            at_least(a, {"refine_steps": 1, "refine_blocks": 1, "gptq_blocks": 1, "sensitivity_blocks": 1})
            if getattr(a, "sensitivity_blocks", None) is not None and not a.recipe.startswith("auto:"):
                raise UsageError(f"--sensitivity-blocks {a.sensitivity_blocks} sets auto:BPW's sensitivity pass; "
                                 f"--recipe {a.recipe} has none: drop it")
            if a.no_refine and a.refine_steps is not None:
                raise UsageError(f"--refine-steps {a.refine_steps} with --no-refine: drop one (--no-refine exports "
                                 "the derived scales, with no refine steps)")
            if a.no_refine and getattr(a, "refine_blocks", None) is not None:
                raise UsageError(f"--refine-blocks {a.refine_blocks} with --no-refine: drop one (--no-refine exports "
                                 "the derived scales, with no calibration)")
            for flag in ("gptq_blocks", "gptq_damp", "gptq_grid_search"):
                if getattr(a, flag, None) is not None and getattr(a, flag) is not False and not getattr(a, "gptq", False):
                    raise UsageError(f"--{flag.replace('_', '-')} sets --gptq's calibration: add --gptq or drop it")
            positive(a, "gptq_damp")
            positive(a, "refine_lr")
            positive(a, "refine_exponent_lr")
            need_something_to_refine(a)
            need_affine_for_gptq(a)
            if not 2 <= a.base_bits <= 8:
                raise UsageError(f"--base-bits must be between 2 and 8 (the bits of the recipe's base format), "
                                 f"got {a.base_bits}")
    elif cmd == "refine":
        if not is_anchor(a.anchor):
            raise UsageError(f"{a.anchor}: not an mfqat anchor (no mfqat.json); refine stores learned scales in an anchor")
        if not has_tokenizer(a.anchor):
            raise UsageError(f"{a.anchor}: the anchor has no tokenizer; refine tokenizes the calibration text with it")
        need_config(a.anchor, "ANCHOR")
        need_formats(a.formats.split(","), "--formats")
        finite(a)
        at_least(a, {"steps": 1})
        positive(a, "lr")
        need_calib_sources(a.calib_text)
        need_writable_anchor(a.anchor)
    elif cmd == "eval":
        positional_or_model(a, "model", cmd)
        need_model(a.model, "MODEL")
        need_tokenizer(a.model, a.tokenizer, cmd)
        need_formats(a.formats.split(","), "--formats")
        need_path(a.text, "--text")
        at_least(a, {"seq_len": 2, "blocks": 1})
        if Path(a.plot).exists() and not a.overwrite:
            raise UsageError(f"--plot {a.plot} exists; pass --overwrite to replace it, or choose another --plot")
        if Path(a.plot).is_dir():
            raise UsageError(f"--plot {a.plot} is a folder; give a .png file name")
        need_writable_file(a.plot, "--plot")
        if a.compare and not (is_anchor(a.model) and a.fp_model):
            raise UsageError("--compare: give an anchor and --fp-model (the full-precision model whose direct "
                             "quantization is compared with Slice-and-Scale)")
        need_model(a.fp_model, "--fp-model")
        if a.scale_search and not is_anchor(a.model):
            raise UsageError("--scale-search lowers an anchor: give an anchor directory as MODEL")
        need_calib_text(a)
        bad = [b for b in a.bnb.split(",") if b and b not in ("nf4", "int8")]
        if bad:
            raise UsageError(f"--bnb {','.join(bad)}: choose from nf4, int8")
        if a.bnb and is_anchor(a.model) and not a.fp_model:
            raise UsageError("--bnb quantizes a full-precision model with bitsandbytes: for an anchor, give the "
                             "model it came from as --fp-model")
    elif cmd in ("generate", "serve"):
        positional_or_model(a, "model", cmd)
        p = Path(a.model)
        if not p.is_dir():
            raise UsageError(f"model directory '{a.model}' does not exist (give a local MLX model directory, e.g. "
                             "one written by mfqat export-mlx)")
        if not (p / "config.json").is_file():
            raise UsageError(f"'{a.model}' is not an MLX model directory: it has no config.json")
        if is_anchor(a.model):
            raise UsageError(f"{a.model} is an anchor (PyTorch); run it on MLX after `mfqat export-mlx {a.model} "
                             "--out DIR`")
        need_config(a.model, "MODEL")
        need_path(a.adapter_path, "--adapter-path", "folder")
        finite(a)
        if cmd == "generate":
            at_least(a, {"max_tokens": 1, "temp": 0})
            if not 0 < a.top_p <= 1:
                raise UsageError(f"--top-p must be in (0, 1], got {a.top_p}")
        elif not 1 <= a.port <= 65535:
            raise UsageError(f"--port must be between 1 and 65535, got {a.port}")
    elif cmd == "verify":
        need_path(a.path, "PATH", "folder")
