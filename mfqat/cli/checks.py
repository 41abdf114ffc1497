"""Up-front checks of the `mfqat` command line: user mistakes fail in a line, before any model loads.

Each check raises :class:`UsageError`; mfqat.cli.app prints it as ``mfqat <cmd>: error: ...`` and exits 2.
Only cheap checks live here (paths, names, flag combinations), so they import nothing heavy.
"""
from __future__ import annotations

import argparse
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
    parent = dest.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"--out {out}: {parent} is a file, not a folder; choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: cannot write in {parent} (no write permission, or a read-only file "
                         "system); choose another --out")


def need_searched_format(fmt: Optional[str]) -> None:
    """``convert --scale-search`` needs a ``--to`` that the search can serve (mxint6..mxint3, and the
    MXFP formats an anchor trained with the search rule: mfqat.anchor.search.searchable_formats)."""
    from mfqat.formats import canonical_name
    from mfqat.quant.scale_rules import SEARCH_RULE_FORMATS  # loads torch: only with --scale-search

    if not fmt or canonical_name(fmt) not in SEARCH_RULE_FORMATS:
        raise UsageError(f"--scale-search: --to {fmt or '(the anchor format)'} is not searched; the search serves "
                         f"{', '.join(SEARCH_RULE_FORMATS)} (other formats keep their scale rule)")


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
    from mfqat.integrations.train_args import at_least as check_minimums

    try:
        check_minimums(a, minimums)
    except ValueError as e:
        raise UsageError(str(e)) from None


def check(cmd: str, a: argparse.Namespace) -> None:
    """The up-front checks of one subcommand's parsed arguments."""
    if cmd == "train":
        from mfqat.integrations.train_args import check_train_args

        check_train_args(a)
        need_model(a.model, "--model")
        if a.text and a.dataset:
            raise UsageError("give --text (plain text) or --dataset, not both")
        need_path(a.text, "--text")
        need_path(a.dataset, "--dataset")
        from mfqat.integrations.train_args import check_resume, check_train_output  # argparse only: nothing heavy
        try:
            check_resume(a)
            check_train_output(a)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
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
        except FileExistsError as e:
            raise UsageError(str(e)) from None
        if a.resume:
            from mfqat.storage.train_checkpoint import verify_checkpoint

            verify_checkpoint(a.resume, "mlx_step.json", a.steps)
    elif cmd == "mx-qlora":
        if not is_anchor(a.anchor):
            raise UsageError(f"{a.anchor}: not an mfqat anchor (no mfqat.json); mx-qlora trains on an anchor")
        if not has_tokenizer(a.anchor):
            raise UsageError(f"{a.anchor}: the anchor has no tokenizer; mx-qlora tokenizes with it (save the anchor "
                             "with its tokenizer)")
        from mfqat.qlora.train import QLORA_MINIMUMS, check_outputs as check_qlora_outputs

        at_least(a, QLORA_MINIMUMS)
        try:
            check_qlora_outputs(a)
        except (OSError, ValueError) as e:
            raise UsageError(str(e)) from None
        need_path(a.text, "--text")
        need_formats((a.formats or "").split(",") + a.eval_formats.split(","), "--formats/--eval-formats")
    elif cmd in ("convert", "export-mlx"):
        positional_or_model(a, "anchor", cmd)
        need_output(a.out, a.overwrite, "convert" if cmd == "convert" else "mlx-export", [a.anchor])
        if cmd == "convert":
            if not is_anchor(a.anchor):
                raise UsageError(f"{a.anchor}: not an mfqat anchor (no mfqat.json); convert reads anchors")
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
            if not 2 <= a.base_bits <= 8:
                raise UsageError(f"--base-bits must be between 2 and 8 (the bits of the recipe's base format), "
                                 f"got {a.base_bits}")
    elif cmd == "refine":
        if not is_anchor(a.anchor):
            raise UsageError(f"{a.anchor}: not an mfqat anchor (no mfqat.json); refine stores learned scales in an anchor")
        if not has_tokenizer(a.anchor):
            raise UsageError(f"{a.anchor}: the anchor has no tokenizer; refine tokenizes the calibration text with it")
        need_formats(a.formats.split(","), "--formats")
        at_least(a, {"steps": 1})
        if not a.lr > 0:
            raise UsageError(f"--lr must be positive, got {a.lr}")
        need_calib_sources(a.calib_text)
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
        need_path(a.adapter_path, "--adapter-path", "folder")
    elif cmd == "verify":
        need_path(a.path, "PATH", "folder")
