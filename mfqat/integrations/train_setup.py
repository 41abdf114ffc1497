"""What the accelerate training loop sets up around its steps: the QATConfig with the command line's
overrides, the learning-rate schedule, the data, trackers, memory and the master-weights folder."""
from __future__ import annotations

import math
import resource
from pathlib import Path
from typing import Callable, Iterator

import torch

from mfqat.data.sources import token_blocks
from mfqat.data.jsonl import training_texts
from mfqat.formats import canonical_name, get_format
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
    return QATConfig(**data)


def make_lr_lambda(args, ctl) -> Callable[[int], float]:
    """LR factor per optimizer step: linear warm-up, then constant or cosine decay to 0, times the
    --lr-mult multiplier of the step's (highest) format family."""
    mults = {k: float(v) for k, v in (x.split("=") for x in args.lr_mult.split(",") if x)}

    def factor(step: int) -> float:
        f = (step + 1) / args.warmup_steps if step < args.warmup_steps else 1.0
        if args.lr_schedule == "cosine" and step >= args.warmup_steps:
            span = max(args.steps - args.warmup_steps, 1)
            f = 0.5 * (1 + math.cos(math.pi * min(step - args.warmup_steps, span) / span))
        if mults and ctl is not None:
            f *= mults.get(get_format(ctl.step_formats(step, args.steps)[0]).family, 1.0)
        return f
    return factor


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
