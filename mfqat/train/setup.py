"""What the accelerate training loop sets up around its steps: the QATConfig with the command line's
overrides, the learning-rate schedule, the data, trackers, memory and the master-weights folder."""
from __future__ import annotations

import math
import resource
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from mfqat.data.sources import token_blocks
from mfqat.data.jsonl import training_texts
from mfqat.formats import canonical_name, get_format
from mfqat.train.args import FAMILIES, parse_pairs
from mfqat.quant.derive import check_reachable
from mfqat.storage.io import atomic_directory
from mfqat.qat.config import QATConfig
from mfqat.qat.learned_scales import ATTR as LEARNED_ATTR


# The recipe a run without --qat-config and without --formats trains (BENCHMARKS.md "Joint MF-QAT").
DEFAULT_RECIPE = "mxint_joint_search"


def load_qat_config(args) -> QATConfig:
    """The QATConfig of --qat-config (default :data:`DEFAULT_RECIPE`, or QATConfig's defaults when
    --formats is given alone) with the command line's overrides applied."""
    source = args.qat_config or (None if args.formats else DEFAULT_RECIPE)
    data = QATConfig.read_yaml(source) if source else {}
    if args.formats:
        data["formats"] = [canonical_name(f) for f in args.formats.split(",")]
    if args.schedule:
        data["schedule"] = args.schedule
    if args.joint_sample is not None:
        data["joint_sample"] = args.joint_sample
    if args.loss_weights:
        data["loss_weights"] = {k: float(v) for k, v in (x.split("=") for x in args.loss_weights.split(","))}
    if args.distill_weight is not None:
        data["distill_weight"] = args.distill_weight
    if getattr(args, "learn_scales", None):
        data["learn_scales"] = True
    if getattr(args, "learned_scales_lr", None) is not None:
        data["learned_scales_lr"] = args.learned_scales_lr
    if getattr(args, "keep_quantized_weights", False):
        data["keep_quantized_weights"] = True
    if getattr(args, "train_vision", False):
        data["train_vision"] = True
    try:
        return QATConfig(**data)
    except TypeError as e:  # a field of the wrong type (block_size: 32.0): the user's file, not a bug
        raise ValueError(f"--qat-config {source or '(command line)'}: {e}") from None


def master_dtype(args) -> torch.dtype:
    """The torch dtype of --dtype (the master weights, their gradients and the optimizer state)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[getattr(args, "dtype", "float32")]


def trained_formats(cfg: QATConfig) -> list:
    """Every format a config trains (``formats`` and ``layer_formats``), each once, in order."""
    return list(dict.fromkeys(cfg.formats + [f for v in cfg.layer_formats.values() for f in v]))


def check_run_values(args, cfg: Optional[QATConfig]) -> None:
    """What the command line asks of a run that only its QAT config can answer, checked before the model
    loads (ValueError naming the flag): --lr-mult families and --loss-weights formats the run trains, and
    an --anchor-format that every trained format is sliced (or derived) from and, for a run that trains
    through its anchor, that anchor."""
    if cfg is None:
        if args.lr_mult or args.anchor_format:
            raise ValueError(f"{'--lr-mult' if args.lr_mult else '--anchor-format'} needs MF-QAT: --no-qat trains "
                             "no format and saves no anchor")
        return
    formats = trained_formats(cfg)
    families = {get_format(f).family for f in formats}
    parse_pairs(args.lr_mult, "--lr-mult", families, f"a family this run trains ({', '.join(formats)})")
    if args.anchor_format:
        fmt = canonical_name(args.anchor_format)
        if cfg.through_anchor and cfg.anchor_format and fmt != cfg.anchor_format:
            raise ValueError(f"--anchor-format {fmt}: this run trains every format through a {cfg.anchor_format} "
                             f"anchor; save that one (drop --anchor-format, or set anchor_format in the QAT config)")
        if not get_format(fmt).is_mx:
            raise ValueError(f"--anchor-format {fmt}: an anchor is an MX format (mxint8, mxfp8_e4m3, ...)")
        for f in formats:
            try:
                check_reachable(fmt, f, name=f"--anchor-format {fmt}")
            except ValueError as e:
                raise ValueError(f"{e}; this run trains {', '.join(formats)}") from None


def make_lr_lambda(args, ctl) -> Callable[[int], float]:
    """LR factor per optimizer step: linear warm-up, then constant or cosine decay to 0, times the
    --lr-mult multiplier of the step's (highest) format family."""
    mults = parse_pairs(args.lr_mult, "--lr-mult", FAMILIES, "a format family")

    def factor(step: int) -> float:
        f = (step + 1) / args.warmup_steps if step < args.warmup_steps else 1.0
        if args.lr_schedule == "cosine" and step >= args.warmup_steps:
            span = max(args.steps - args.warmup_steps, 1)
            f = 0.5 * (1 + math.cos(math.pi * min(step - args.warmup_steps, span) / span))
        if mults and ctl is not None:
            f *= mults.get(get_format(ctl.step_formats(step, args.steps)[0]).family, 1.0)
        return f
    return factor


def check_model_fits(model, seq_len: int, flag: str = "--seq-len") -> None:
    """ValueError when ``seq_len`` is beyond the model's positions (``max_position_embeddings``): such a run
    would train for minutes on positions the model has no embedding or rotary range for."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(n, int) and n > 0 and seq_len > n:
        raise ValueError(f"{flag} {seq_len} is beyond the model's {n} positions (max_position_embeddings in its "
                         f"config.json); choose {flag} {n} or less")


def check_token_ids(model, *blocks: torch.Tensor, what: str = "the text") -> None:
    """ValueError when a token id of ``blocks`` is outside the model's vocabulary (its input embedding):
    a tokenizer that is not the model's own fails here, before the first step, not in the middle of one."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    top = max((int(b.max()) for b in blocks if b.numel()), default=-1)
    if isinstance(vocab, int) and top >= vocab:
        raise ValueError(f"{what}: the tokenizer gives token id {top}, beyond the model's {vocab}-token vocabulary "
                         "(its embedding); use the model's own tokenizer (--tokenizer) or fix vocab_size in its "
                         "config.json")


def check_importance_state(model, state: object, where: str) -> None:
    """The importance sums of a checkpoint (mfqat.qat.importance_state): {module name: {"sum", "tokens",
    "pending_sum", "pending_tokens"}}, each sum None or a finite, non-negative float64 vector of the module's
    input width, each count a non-negative int; ValueError naming the file otherwise."""
    from mfqat.qat.importance_state import input_width
    from mfqat.qat.prepare import qat_modules

    mods = dict(qat_modules(model))
    if not isinstance(state, dict):
        raise ValueError(f"{where}: expected {{module: importance sums}}, got {type(state).__name__}")
    for name, e in state.items():
        at = f"{where}: {name!r}"
        if name not in mods or not isinstance(e, dict) or set(e) - {"sum", "tokens", "pending_sum", "pending_tokens"}:
            raise ValueError(f"{at}: not an MF-QAT module of this model with its importance sums")
        for key in ("tokens", "pending_tokens"):
            v = e.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{at}.{key}: expected a count >= 0, got {v!r}")
        for key in ("sum", "pending_sum"):
            t = e.get(key)
            if t is None:
                continue
            width = input_width(mods[name])
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float64 or tuple(t.shape) != (width,):
                raise ValueError(f"{at}.{key}: expected float64 ({width},), got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            if not torch.isfinite(t).all() or (t < 0).any():
                raise ValueError(f"{at}.{key}: holds negative, NaN or infinite sums of squares")


def load_importance(model, folder, rank: int) -> bool:
    """mfqat.qat.importance_state.load_state, its file checked first (a crafted one is a one-line ValueError
    naming it, never a traceback or sums of the wrong shape); False when the checkpoint holds none."""
    from mfqat.qat import importance_state

    for r in (rank, 0):
        path = importance_state.state_file(folder, r)
        if path.is_file():
            break
    else:
        return False
    where = f"--resume {folder}: {path.name}"
    try:
        state = torch.load(path, weights_only=True)
    except Exception as e:  # pickle.UnpicklingError, RuntimeError, EOFError, ...: never executed, never a traceback
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"{where}: not the importance sums mfqat saves ({first})") from None
    check_importance_state(model, state, where)
    return importance_state.load_state(model, folder, rank)


def load_data(args, tok, num_processes: int):
    """(train blocks, held-out blocks) of --seq-len tokens; the tiny model reads bytes as tokens."""
    text_train, text_eval = training_texts(args.text, args.dataset, tok)
    need_blocks = args.steps * args.batch_size * args.grad_accum * num_processes
    if tok is not None:
        return (token_blocks(tok, text_train, args.seq_len, max_blocks=need_blocks),
                token_blocks(tok, text_eval, args.seq_len, max_blocks=args.eval_blocks))

    def enc(text: str, n: int) -> torch.Tensor:
        ids = torch.tensor(list(text.encode()[:n]), dtype=torch.long) % 320
        return ids[: ids.numel() // args.seq_len * args.seq_len].reshape(-1, args.seq_len)
    return enc(text_train, args.seq_len * need_blocks * 2), enc(text_eval, args.seq_len * args.eval_blocks)


def save_master(model, tok, path: Path) -> None:
    """The full-precision master weights as a plain HF folder (MF-QAT modules are ordinary Linears
    to ``save_pretrained``: the state dict keys are unchanged; learned affine scales, which the anchor
    stores, are left out)."""
    state = model.state_dict()
    learned = [k for k in state if f".{LEARNED_ATTR}." in f".{k}"]
    kwargs = {"state_dict": {k: v for k, v in state.items() if k not in learned}} if learned else {}
    with atomic_directory(path, overwrite=True, kind="hf-model") as tmp:  # a run's own earlier master only
        model.save_pretrained(tmp, safe_serialization=True, **kwargs)
        if tok is not None:
            tok.save_pretrained(tmp)


def peak_memory_mib() -> float:
    """Peak memory of this process: CUDA allocations on a GPU, else the peak resident set (RSS)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _forever(loader) -> Iterator:
    """The loader's batches, epoch after epoch."""
    while True:
        for (batch,) in loader:
            yield batch


def log_with(report_to: str):
    """accelerate's ``log_with`` for --report-to: None ('none'), 'all', or a list of tracker names."""
    names = [n.strip() for n in report_to.split(",") if n.strip() and n.strip() != "none"]
    if names == ["all"]:
        return "all"
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, _available_trackers

    available = {str(getattr(t, "value", t)) for t in _available_trackers}  # LoggerType members, not str
    for n in names:
        if n not in LOGGER_TYPE_TO_CLASS:
            raise ValueError(f"--report-to {n}: not an accelerate tracker ({', '.join(LOGGER_TYPE_TO_CLASS)})")
        if n not in available:
            raise ValueError(f"--report-to {n}: the {n} package is not installed (pip install {n})")
    return names or None
