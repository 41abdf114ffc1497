"""`mfqat mlx-train`: MF-QAT (or LoRA) fine-tuning on MLX with progress, evaluation and an anchor.

    mfqat mlx-train [MODEL_DIR] --qat-config mxint_2468 --steps 60 --out runs/mlx
    mfqat mlx-train EXPORT_DIR --lora-rank 8 --steps 30 --out runs/mlx-lora   # LoRA on an export

Same data, schedule and evaluation as the PyTorch loop (scripts/train.py): pydoc text, held-out
perplexity per format, a loss-curve PNG, a summary table, and an anchor that PyTorch loads.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mfqat.data.sources import token_blocks
from mfqat.data.jsonl import training_texts
from mfqat.eval.report import plot_curve
from mfqat.quant.derive import is_derived
from mfqat.formats import canonical_name, get_format
from mfqat.progress import progress, quiet_dependency_logs
from mfqat.qat.config import QATConfig
from mfqat.mlx.models import hf_tokenizer, load_for_training
from mfqat.mlx import runtime
from mfqat.mlx.observers import clip_rates
from mfqat.mlx.qat import prepare, set_format
from mfqat.storage.guard import check_run_folder
from mfqat.storage.io import RunFolder, atomic_directory
from mfqat.train.args import check_finite, local_inputs
from mfqat.train.summary import run_summary, write_summary


MLX_MINIMUMS = {"steps": 1, "batch_size": 1, "seq_len": 2, "save_every": 0, "lora_rank": 0, "eval_blocks": 1,
                "grad_clip": 0, "weight_decay": 0, "lr": 0}


def loss_fn(model: nn.Module, batch: mx.array) -> mx.array:
    """Mean next-token cross-entropy over every position (as HF's ``labels=input_ids`` loss)."""
    return loss_and_logits(model, batch)[0]


def loss_and_logits(model: nn.Module, batch: mx.array):
    """(mean next-token CE, float32 logits): ``loss_fn`` that also hands back its logits."""
    logits = model(batch[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean"), logits


def perplexity(model: nn.Module, blocks: mx.array, batch_size: int = 4, desc: Optional[str] = None) -> float:
    """exp(mean NLL) over held-out blocks (the token-weighted mean, as mfqat.eval.perplexity)."""
    total, count = 0.0, 0
    for i in progress(range(0, blocks.shape[0], batch_size), desc=desc, leave=False, disable=desc is None):
        b = blocks[i:i + batch_size]
        nll = loss_fn(model, b)
        n = b.shape[0] * (b.shape[1] - 1)
        total += nll.item() * n
        count += n
    return math.exp(total / count)


def make_optimizer(lr: float, weight_decay: float = 0.0) -> optim.Optimizer:
    """AdamW with bias correction (torch.optim.AdamW's update)."""
    return optim.AdamW(learning_rate=lr, weight_decay=weight_decay, bias_correction=True)


def distill_loss_fn(model: nn.Module, batch: mx.array, teacher: mx.array, alpha: float) -> mx.array:
    """(1 - alpha) * CE + alpha * mean-token KL(teacher || model), as mfqat.qat.joint."""
    logits = model(batch[:, :-1]).astype(mx.float32)
    ce = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="mean")
    log_t, log_s = nn.log_softmax(teacher, axis=-1), nn.log_softmax(logits, axis=-1)
    kl = (mx.exp(log_t) * (log_t - log_s)).sum(axis=-1).mean()
    return (1 - alpha) * ce + alpha * kl


def joint_grads(model: nn.Module, batch: mx.array, formats: List[str], cfg: QATConfig):
    """The joint MF-QAT step on MLX: sum_f w_f * grad L_f / sum w, one format at a time; returns
    (weighted loss, grads). The distillation teacher is the highest format's logits, returned by
    its own loss pass (no extra forward)."""
    total_w = sum(cfg.weight_of(f) for f in formats)
    alpha = cfg.distill_weight
    loss_sum, grads_sum, teacher = 0.0, None, None
    for i, fmt in enumerate(formats):
        set_format(model, fmt)
        w = cfg.weight_of(fmt) / total_w
        if teacher is not None:
            fn = nn.value_and_grad(model, lambda m, b: distill_loss_fn(m, b, teacher, alpha))
            loss, grads = fn(model, batch)
        elif alpha and i == 0:
            (loss, logits), grads = nn.value_and_grad(model, loss_and_logits)(model, batch)
            teacher = mx.stop_gradient(logits)
        else:
            loss, grads = nn.value_and_grad(model, loss_fn)(model, batch)
        grads = tree_map(lambda g: g * w, grads)
        grads_sum = grads if grads_sum is None else tree_map(lambda a, b: a + b, grads_sum, grads)
        mx.eval(grads_sum)
        loss_sum += w * loss.item()
    return loss_sum, grads_sum


def train_steps(model: nn.Module, batches: Iterable[mx.array], steps: int, lr: float,
                grad_clip: float = 1.0, desc: str = "mlx fine-tune", weight_decay: float = 0.0,
                opt: Optional[optim.Optimizer] = None, start: int = 0,
                on_step: Optional[Callable[[int, optim.Optimizer], None]] = None) -> List[float]:
    """Run optimizer steps ``start`` .. ``steps - 1`` (``batches`` yields the batch of each of them);
    the MF-QAT controller (if any) picks each step's format(s). ``on_step(step_done, opt)`` runs after
    every step (checkpoints); ``opt`` continues a restored optimizer."""
    opt = opt or make_optimizer(lr, weight_decay)
    value_and_grad = nn.value_and_grad(model, loss_fn)
    ctl = model.__dict__.get("mfqat_controller")
    losses = []
    bar = progress(zip(range(start, steps), batches), total=steps, initial=start, desc=desc)
    for step, batch in bar:
        fmt = ctl.set_step(model, step, steps) if ctl else "fp"
        formats = ctl.step_formats(step, steps) if ctl else [fmt]
        if len(formats) > 1:
            loss_value, grads = joint_grads(model, batch, formats, ctl.config)
            fmt = "+".join(formats)
        else:
            loss, grads = value_and_grad(model, batch)
            loss_value = None
        if grad_clip:
            grads, _ = optim.clip_grad_norm(grads, grad_clip)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        losses.append(loss.item() if loss_value is None else loss_value)
        bar.set_postfix(fmt=fmt, loss=f"{losses[-1]:.3f}")
        if on_step:
            on_step(step + 1, opt)
    return losses


def batches_from(blocks: np.ndarray, batch_size: int, seed: int) -> Iterable[mx.array]:
    """Shuffled batches, repeating the data as often as needed."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(blocks))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield mx.array(blocks[order[i:i + batch_size]])


def lora_config(rank: int, scale: float = 20.0, keys: Optional[List[str]] = None) -> dict:
    """mlx-lm's ``lora_parameters`` (it takes ``scale``; peft's ``alpha`` is ``scale * rank``)."""
    cfg = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys:
        cfg["keys"] = list(keys)
    return cfg


def apply_lora(model: nn.Module, rank: int = 8, scale: float = 20.0, num_layers: int = -1,
               keys: Optional[List[str]] = None) -> nn.Module:
    """Freeze the model and add mlx-lm LoRA adapters (QLoRA on quantized layers) to the last
    ``num_layers`` blocks (-1: all), on the modules named by ``keys`` (e.g. "self_attn.q_proj";
    None: mlx-lm's default, every Linear)."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model.freeze()
    n = len(model.layers) if num_layers < 0 else num_layers
    linear_to_lora_layers(model, n, lora_config(rank, scale, keys))
    if not model.trainable_parameters() or not tree_flatten(model.trainable_parameters()):
        raise ValueError(f"--lora-targets {keys} matched no module of the model; use paths inside a block, "
                         "e.g. self_attn.q_proj,mlp.down_proj")
    return model


def save_adapters(model: nn.Module, out: Path, rank: int, scale: float, num_layers: int,
                  keys: Optional[List[str]] = None) -> Path:
    """adapters.safetensors + adapter_config.json in mlx-lm's layout (``--adapter-path`` loads it), written
    atomically; replaces only an earlier adapter folder (mfqat.storage.io.atomic_directory)."""
    with atomic_directory(out, overwrite=True, kind="peft-adapter") as tmp:
        mx.save_safetensors(str(tmp / "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
        (tmp / "adapter_config.json").write_text(json.dumps({
            "fine_tune_type": "lora", "num_layers": num_layers,
            "lora_parameters": lora_config(rank, scale, keys)}, indent=2))
    return out


def build_parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="mlx-lm/HF dir or mfqat export (default: SmolLM2-135M)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="same as the positional model")
    p.add_argument("--qat-config", default=None, help="YAML QATConfig file, or the name of a shipped recipe (mxint_joint, "
                   "mxint_468_cyclic, ...: see docs/recipes.md); default: joint mxint8/6/4 (mxint_joint)")
    p.add_argument("--formats", default=None, help="comma list overriding the config's formats")
    p.add_argument("--schedule", default=None)
    p.add_argument("--no-qat", action="store_true", help="plain fine-tuning")
    p.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters instead of MF-QAT")
    p.add_argument("--lora-alpha", type=float, default=None,
                   help="peft-style alpha: scale = alpha / rank (default: mlx-lm's scale 20)")
    p.add_argument("--lora-targets", default=None,
                   help="comma list of module paths inside a block (e.g. self_attn.q_proj,self_attn.v_proj); "
                        "default: every Linear")
    p.add_argument("--lora-layers", type=int, default=-1, help="adapt the last N blocks (-1: all)")
    p.add_argument("--steps", "--iters", "--max-steps", dest="steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", "--learning-rate", dest="lr", type=float, default=2e-5)
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint (model + optimizer) every N steps")
    p.add_argument("--resume", default=None, help="OUT/checkpoint-STEP folder to continue from")
    p.add_argument("--grad-checkpoint", action="store_true",
                   help="recompute each decoder block's activations in backward (mx.checkpoint)")
    p.add_argument("--memory-limit", type=float, default=None, metavar="GIB", help="mx.set_memory_limit")
    p.add_argument("--cache-limit", type=float, default=None, metavar="GIB", help="mx.set_cache_limit (0: no cache)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default=None, help="training text: file, folder, or pydoc (default)")
    p.add_argument("--data", default=None, help="mlx-lm's data layout: a folder with train.jsonl [+ valid.jsonl] ('text', chat 'messages' or 'prompt'/'completion' records; see mfqat.data.jsonl)")
    p.add_argument("--eval-formats", default=None,
                   help="comma list evaluated at the end (default: the formats the recipe trains)")
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--anchor-format", default=None, help="default: the QAT config's anchor_format")
    p.add_argument("--out", "--save-path", "--output-dir", dest="out", default="runs/mlx")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the adapters, anchor, summary.json and loss.png an earlier run wrote in --out")
    return p


OUTPUTS = ("adapters", "anchor", "summary.json", "loss.png")  # what a run writes into --out


def run_outputs(a: argparse.Namespace) -> dict:
    """{name: "file" or folder kind} of what this run writes into --out (mfqat.storage.guard.check_run_folder)."""
    outs = {"summary.json": "file", "loss.png": "file"}
    if a.lora_rank:
        outs["adapters"] = "peft-adapter"
    elif not a.no_qat:
        outs["anchor"] = "anchor"
    if a.save_every and a.save_every > 0:
        for step in [*range(a.save_every, a.steps + 1, a.save_every), a.steps]:
            outs[f"checkpoint-{step}"] = "mlx-checkpoint"
    return outs


def check_outputs(a: argparse.Namespace) -> None:
    """--out, checked before the model loads by the guard every run shares: not over the model or the text,
    an existing folder only an earlier mlx-train run with --overwrite (or the run a --resume continues), a
    file it did not write never replaced."""
    check_finite(a)
    check_run_folder(Path(a.out), "mlx-train", run_outputs(a), a.overwrite,
                     protect=local_inputs(a.model or a.model_flag, a.text, a.data),
                     resume=Path(a.resume) if a.resume else None)


def main(argv: Optional[List[str]] = None) -> dict:
    """Train on MLX; return the summary (also OUT/summary.json)."""
    a = build_parser().parse_args(argv)
    for dest, low in MLX_MINIMUMS.items():  # before the model loads (the command line checks these first)
        if getattr(a, dest) < low:
            raise ValueError(f"--{dest.replace('_', '-')} must be >= {low}, got {getattr(a, dest)}")
    check_outputs(a)
    if not a.lr > 0:
        raise ValueError(f"--lr must be > 0, got {a.lr}")
    quiet_dependency_logs()  # see mfqat.progress
    out = Path(a.out)
    mx.random.seed(a.seed)
    limits = runtime.set_limits(a.memory_limit, a.cache_limit)
    model, tok, src = load_for_training(a.model or a.model_flag)
    htok = hf_tokenizer(tok)
    train_text, held_text = training_texts(a.text, a.data, htok)
    train = token_blocks(htok, train_text, a.seq_len, max_blocks=a.steps * a.batch_size).numpy()
    held = mx.array(token_blocks(htok, held_text, a.seq_len, max_blocks=a.eval_blocks).numpy())
    cfg = None
    lora_scale = a.lora_alpha / a.lora_rank if (a.lora_alpha is not None and a.lora_rank) else 20.0
    lora_keys = [k for k in (a.lora_targets or "").split(",") if k] or None
    lora_layers = len(model.layers) if a.lora_layers < 0 else a.lora_layers
    if a.lora_rank:
        apply_lora(model, a.lora_rank, lora_scale, lora_layers, lora_keys)
    elif not a.no_qat:
        data = QATConfig.read_yaml(a.qat_config) if a.qat_config else {}
        if a.formats:
            data["formats"] = [canonical_name(f) for f in a.formats.split(",")]
        if a.schedule:
            data["schedule"] = a.schedule
        cfg = QATConfig(**data)
        prepare(model, cfg)
    if a.grad_checkpoint and cfg is not None and cfg.activation_observer:
        raise SystemExit("mfqat mlx-train: --grad-checkpoint reruns each forward in backward, which would enter "
                         "the activation observer's window twice; drop one of the two")
    checkpointed = runtime.checkpoint_layers(model) if a.grad_checkpoint else 0
    opt, start = make_optimizer(a.lr, a.weight_decay), 0
    if a.resume:
        start = runtime.load_checkpoint(Path(a.resume), model, opt)
    batches = batches_from(train, a.batch_size, a.seed)
    run = RunFolder(out, "mlx-train").start()  # the first write into --out
    for _ in range(start):  # resume: the batches of an uninterrupted run
        next(batches)

    def on_step(step: int, o: optim.Optimizer) -> None:
        if a.save_every and (step % a.save_every == 0 or step == a.steps):  # the last step too
            runtime.save_checkpoint(out / f"checkpoint-{step}", model, o, step)
            run.folder(f"checkpoint-{step}", "mlx-checkpoint")
    mx.reset_peak_memory()
    t = time.perf_counter()
    losses = train_steps(model, batches, a.steps, a.lr, a.grad_clip, weight_decay=a.weight_decay, opt=opt,
                         start=start, on_step=on_step)
    train_s = time.perf_counter() - t
    mem_line, mem = runtime.summary_memory(limits)
    summary = run_summary(a.steps, train_s, losses, source=str(src), start_step=start,
                          grad_checkpoint_blocks=checkpointed, **mem)
    if cfg is not None and cfg.activation_observer:  # mean over layers of the clipped fraction of inputs
        rates = clip_rates(model)
        summary["activation_clip_rate"] = sum(rates.values()) / max(1, len(rates))
    rows = []
    if cfg is not None:
        for f in [canonical_name(x) for x in (a.eval_formats or ",".join(cfg.formats)).split(",") if x]:
            set_format(model, f)
            group = cfg.affine_group_size if is_derived(f) else cfg.block_size
            rows.append({"format": f, "bits/weight": get_format(f).bits_per_weight(group),
                         "perplexity": perplexity(model, held, desc=f"eval {f}")})
        set_format(model, None)
    rows.append({"format": "fp (master)" if not a.lora_rank else "lora", "bits/weight": float("nan"),
                 "perplexity": perplexity(model, held, desc="eval")})
    if a.lora_rank:
        save_adapters(model, out / "adapters", a.lora_rank, lora_scale, lora_layers, lora_keys)
        summary["adapters"] = str(run.folder("adapters", "peft-adapter"))
    elif cfg is not None:
        from mfqat.mlx.anchor import save_anchor

        save_anchor(model, out / "anchor", a.anchor_format or cfg.anchor_format or "mxint8", source_dir=src,
                    step=a.steps, schedule=cfg.to_dict(), overwrite=True)
        summary["anchor"] = str(run.folder("anchor", "anchor"))
    summary["eval"] = rows
    if losses:
        run.write("loss.png", lambda p: plot_curve(losses, p, "training loss (MLX)"))
    write_summary(run, summary, f"out={out}", mem_line)
    return summary


if __name__ == "__main__":
    main()
