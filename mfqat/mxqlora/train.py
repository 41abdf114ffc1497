"""`mfqat mx-qlora`: train one LoRA adapter on a frozen MX anchor for all of its formats.

    mfqat mx-qlora runs/mfqat/anchor --formats mxint8,mxint6,mxint4 --steps 30 --out runs/mxqlora

Each step runs the base in the schedule's format (``cyclic``: one format per step in turn;
``joint``: the mean of all formats' losses, one backward each; ``fixed``: the first format only)
and updates only the adapters (AdamW). Ends with the adapter in PEFT's format (OUT/adapter; with
--mlx-adapter-path also as an mlx-lm adapter folder for the anchor's MLX exports), a
held-out perplexity per format and OUT/summary.json (s/step, peak memory).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List, Optional

import torch

from mfqat.data.sources import load_text, split_text, token_blocks
from mfqat.eval.perplexity import perplexity
from mfqat.formats import canonical_name, get_format
from mfqat.train.lora import DEFAULT_TARGETS
from mfqat.train.args import at_least, check_finite, local_inputs
from mfqat.train.setup import check_model_fits, check_token_ids, peak_memory_mib
from mfqat.train.summary import run_summary, write_summary
from mfqat.mxqlora.model import lora_parameters, mx_qlora_model, save_mx_adapter, set_base_format
from mfqat.mxqlora.mlx_adapter import peft_to_mlx
from mfqat.progress import progress
from mfqat.storage.guard import check_output, check_run_folder
from mfqat.storage.io import RunFolder

SCHEDULES = ("cyclic", "joint", "fixed")
QLORA_MINIMUMS = {"steps": 1, "batch_size": 1, "seq_len": 2, "lora_rank": 1, "eval_blocks": 1, "lr": 0,
                  "lora_dropout": 0}


def build_parser() -> argparse.ArgumentParser:
    """Arguments of `mfqat mx-qlora`."""
    p = argparse.ArgumentParser(prog="mfqat mx-qlora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("anchor", help="anchor folder (mfqat train / save_anchor), with its tokenizer")
    p.add_argument("--formats", default=None, help="comma list of base formats (default: the anchor's format)")
    p.add_argument("--schedule", default="cyclic", choices=SCHEDULES)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", default=DEFAULT_TARGETS,
                   help="comma list of Linear names to adapt, or all-linear (default: every quantized Linear)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--text", default=None, help="training text: file, folder, or pydoc (default)")
    p.add_argument("--eval-formats", default="", help="comma list (default: --formats)")
    p.add_argument("--eval-blocks", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each block's activations in backward (less memory, one more forward), as QLoRA does")
    p.add_argument("--out", default="runs/mxqlora")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the outputs of an earlier `mfqat mx-qlora` run in --out (never a file it did not "
                        "write) and an earlier adapter at --mlx-adapter-path")
    p.add_argument("--mlx-adapter-path", default=None, metavar="DIR",
                   help="also write the adapter as an mlx-lm adapter folder (mlx_lm.load(EXPORT, adapter_path=DIR), "
                        "mlx_lm.generate --adapter-path DIR) for any `mfqat export-mlx` of this anchor")
    return p


def step_formats(schedule: str, formats: List[str], step: int) -> List[str]:
    """The base formats one optimizer step trains."""
    if schedule == "joint":
        return formats
    if schedule == "cyclic":
        return [formats[step % len(formats)]]
    return formats[:1]


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Non-reentrant activation checkpointing of the decoder blocks (the recomputed forward runs in
    the base format of the forward: each format's backward follows its own forward at once)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def check_outputs(a: argparse.Namespace) -> None:
    """--out (mfqat.storage.guard.check_run_folder) and --mlx-adapter-path (an earlier adapter only with
    --overwrite), neither over the anchor or the text: checked before the anchor loads."""
    inputs = local_inputs(a.anchor, a.text)
    check_run_folder(Path(a.out), "mx-qlora", {"adapter": "peft-adapter", "summary.json": "file"}, a.overwrite,
                     protect=inputs)
    if a.mlx_adapter_path:
        check_output(Path(a.mlx_adapter_path).absolute(), a.overwrite, "peft-adapter", inputs)


def main(argv: Optional[List[str]] = None) -> dict:
    """Train, save the adapter, evaluate; return the summary (also OUT/summary.json)."""
    from transformers import AutoTokenizer

    a = build_parser().parse_args(argv)
    check_finite(a)
    at_least(a, QLORA_MINIMUMS)  # before the anchor loads
    if not a.lr > 0:
        raise ValueError(f"--lr must be > 0, got {a.lr}")
    check_outputs(a)
    torch.manual_seed(a.seed)
    model = mx_qlora_model(a.anchor, a.lora_rank, a.lora_alpha, a.lora_dropout, a.lora_targets.split(","))
    check_model_fits(model, a.seq_len)
    anchor_fmt = model.mx_qlora["anchor_format"]
    formats = [canonical_name(f) for f in (a.formats.split(",") if a.formats else [anchor_fmt])]
    for f in formats:
        set_base_format(model, f)  # refuses formats the anchor cannot slice to, before training
    tok = AutoTokenizer.from_pretrained(a.anchor)
    text_train, text_eval = split_text(load_text(a.text))
    train = token_blocks(tok, text_train, a.seq_len, max_blocks=max(a.steps * a.batch_size, 1))
    held = token_blocks(tok, text_eval, a.seq_len, max_blocks=a.eval_blocks)
    check_token_ids(model, train, held, what=f"--text {a.text or 'pydoc'}")
    if a.gradient_checkpointing:
        enable_checkpointing(model)
    opt = torch.optim.AdamW(lora_parameters(model), lr=a.lr)
    g = torch.Generator().manual_seed(a.seed)
    model.train()
    losses: List[float] = []
    t0 = time.perf_counter()
    bar = progress(total=a.steps, desc=f"MX-QLoRA {a.schedule}")
    for step in range(a.steps):
        batch = train[torch.randint(0, train.shape[0], (a.batch_size,), generator=g)]
        fmts = step_formats(a.schedule, formats, step)
        total = 0.0
        for f in fmts:
            set_base_format(model, f)
            loss = model(input_ids=batch, labels=batch).loss / len(fmts)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        bar.set_postfix(loss=f"{total:.3f}", fmt="+".join(fmts))
        bar.update(1)
    bar.close()
    train_s = time.perf_counter() - t0
    out = Path(a.out)
    run = RunFolder(out, "mx-qlora").start()
    adapter = save_mx_adapter(model, out / "adapter")
    run.folder("adapter", "peft-adapter")
    mlx_adapter = peft_to_mlx(adapter, a.mlx_adapter_path, overwrite=a.overwrite) if a.mlx_adapter_path else None
    rows = []
    for f in [canonical_name(x) for x in (a.eval_formats.split(",") if a.eval_formats else formats)]:
        set_base_format(model, f)
        rows.append({"format": f, "bits/weight": get_format(f).bits_per_weight(32),
                     "perplexity": perplexity(model, held, desc=f"eval {f}")})
    summary = run_summary(a.steps, train_s, losses, old_keys=("s_per_step",), schedule=a.schedule, formats=formats,
                          gradient_checkpointing=a.gradient_checkpointing, peak_memory_mib=peak_memory_mib(),
                          adapter=str(adapter), mlx_adapter=mlx_adapter and str(mlx_adapter), eval=rows,
                          **model.mx_qlora)
    write_summary(run, summary, f"adapter={adapter}")
    return summary


if __name__ == "__main__":
    main()
