"""MF-QAT fine-tuning of a causal LM with accelerate (single process, DDP or FSDP).

    accelerate launch [--config_file configs/accelerate/ddp.yaml] scripts/train.py \
        --qat-config configs/mxint_2468.yaml --steps 120 --out runs/mfqat

Defaults: the embedded SmolLM2-135M, Python's pydoc text, progressive mxint2->4->6->8.
Ends by saving an MXINT8 (or --anchor-format) anchor and printing a perplexity table.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import List, Optional

import torch
from torch.utils.data import DataLoader, TensorDataset
from tqdm.auto import tqdm

from ..anchor import save_anchor
from ..data import load_model, load_text, split_text, token_blocks, tiny_llama
from ..eval.elastic import evaluate_formats, ptq_state
from ..eval.perplexity import perplexity
from ..eval.report import format_table, plot_curve
from ..formats import canonical_name, get_format
from ..qat.config import QATConfig
from ..qat.prepare import prepare, set_format


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M); "
                   "'tiny' builds a tiny random Llama")
    p.add_argument("--text", default=None, help="training text: file, folder, or pydoc (default)")
    p.add_argument("--qat-config", default=None, help="YAML QATConfig (default: progressive mxint2->4->6->8)")
    p.add_argument("--formats", default=None, help="comma list overriding the config's formats")
    p.add_argument("--schedule", default=None, help="override the config's schedule")
    p.add_argument("--no-qat", action="store_true", help="plain fine-tuning (the fair baseline)")
    p.add_argument("--distill", type=float, default=0.0, metavar="ALPHA",
                   help="self-distillation: loss = (1-ALPHA)*CE + ALPHA*KL(fp master model || quantized model); "
                        "one extra no-grad forward per step")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--optim", default="adamw", choices=["adamw", "adamw8bit", "paged_adamw8bit"])
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/mfqat")
    p.add_argument("--anchor-format", default="mxint8")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint (accelerate state + anchor) every N steps")
    p.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    p.add_argument("--eval-formats", default="", help="comma list evaluated on held-out text at the end")
    p.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks of seq-len tokens")
    p.add_argument("--dump-weights", default=None, help="(tests) write a per-rank weight checksum here")
    return p


def make_optimizer(name: str, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit / paged AdamW when asked and available (else AdamW, said once)."""
    if name != "adamw":
        try:
            import bitsandbytes as bnb

            cls = bnb.optim.AdamW8bit if name == "adamw8bit" else bnb.optim.PagedAdamW8bit
            return cls(params, lr=lr, weight_decay=weight_decay)
        except Exception as e:  # pragma: no cover - depends on the bnb build
            print(f"[mfqat] {name} unavailable ({e}); using torch AdamW")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def distillation_loss(model, base, ctl, batch: torch.Tensor, step: int, total: int, alpha: float) -> torch.Tensor:
    """(1 - alpha) * next-token CE + alpha * per-token KL from the full-precision master model (the
    same weights, no fake-quant) to the model in this step's formats."""
    import torch.nn.functional as F

    with torch.no_grad():
        set_format(base, None)
        teacher = model(input_ids=batch).logits.float()
        ctl.set_step(base, step, total)  # back to this step's per-layer formats
    out = model(input_ids=batch, labels=batch)
    vocab = teacher.shape[-1]
    kl = F.kl_div(F.log_softmax(out.logits.float().reshape(-1, vocab), -1),
                  F.log_softmax(teacher.reshape(-1, vocab), -1), log_target=True, reduction="batchmean")
    return (1 - alpha) * out.loss + alpha * kl


def load_qat_config(args) -> QATConfig:
    cfg = QATConfig.from_yaml(args.qat_config) if args.qat_config else QATConfig()
    if args.formats:
        cfg.formats = [canonical_name(f) for f in args.formats.split(",")]
    if args.schedule:
        cfg.schedule = args.schedule
    cfg.__post_init__()
    return cfg


def main(argv: Optional[List[str]] = None) -> dict:
    """Run training; return a summary dict (also written to OUT/summary.json)."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    args = build_parser().parse_args(argv)
    # without CUDA, cpu=True lets torchrun-style launches (accelerate launch --multi_gpu) run as
    # MULTI_CPU ranks over gloo instead of silently running N independent single processes
    acc = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available())
    set_seed(args.seed)
    out = Path(args.out)
    if args.model == "tiny":
        model, tok = tiny_llama(vocab_size=320), None
    else:
        model, tok = load_model(args.model)
    text_train, text_eval = split_text(load_text(args.text))
    if tok is None:  # tiny model: bytes as tokens
        enc = lambda t, n: torch.tensor(list(t.encode()[: n]), dtype=torch.long) % 320  # noqa: E731
        need = args.seq_len * args.batch_size * args.steps * 2
        ids = enc(text_train, need)
        train = ids[: ids.numel() // args.seq_len * args.seq_len].reshape(-1, args.seq_len)
        ev = enc(text_eval, args.seq_len * args.eval_blocks)
        held = ev[: ev.numel() // args.seq_len * args.seq_len].reshape(-1, args.seq_len)
    else:
        train = token_blocks(tok, text_train, args.seq_len, max_blocks=args.steps * args.batch_size * acc.num_processes)
        held = token_blocks(tok, text_eval, args.seq_len, max_blocks=args.eval_blocks)
    cfg = None if args.no_qat else load_qat_config(args)
    if cfg is not None:
        prepare(model, cfg)
    model.train()
    g = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(TensorDataset(train), batch_size=args.batch_size, shuffle=True, generator=g, drop_last=True)
    opt = make_optimizer(args.optim, [p for p in model.parameters() if p.requires_grad], args.lr, args.weight_decay)
    model, opt, loader = acc.prepare(model, opt, loader)
    base = acc.unwrap_model(model)
    ctl = base.__dict__.get("mfqat_controller")
    start = 0
    if args.resume:
        acc.load_state(args.resume)
        start = json.loads((Path(args.resume) / "mfqat_step.json").read_text())["step"]
    losses: List[float] = []
    fmts: List[str] = []
    bar = tqdm(total=args.steps, initial=start, desc="MF-QAT" if cfg else "fine-tune", disable=not acc.is_main_process)
    step, t0 = start, time.perf_counter()
    while step < args.steps:
        for (batch,) in loader:
            if step >= args.steps:
                break
            fmt = ctl.set_step(base, step, args.steps) if ctl else "fp"
            if args.distill and ctl:
                loss = distillation_loss(model, base, ctl, batch, step, args.steps, args.distill)
            else:
                loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            if args.grad_clip:
                acc.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss.item())
            fmts.append(fmt)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", fmt=fmt)
            bar.update(1)
            if args.save_every and step % args.save_every == 0 and step < args.steps:
                ckpt = out / f"checkpoint-{step}"
                acc.save_state(str(ckpt))
                if acc.is_main_process:
                    (ckpt / "mfqat_step.json").write_text(json.dumps({"step": step}))
                    if cfg:
                        save_anchor(base, ckpt / "mfqat_anchor", args.anchor_format, tok, step=step,
                                    schedule=cfg.to_dict(), overwrite=True)
    bar.close()
    train_s = time.perf_counter() - t0
    acc.wait_for_everyone()
    summary = {"steps": args.steps, "train_seconds": train_s, "final_loss": losses[-1] if losses else None,
               "losses": losses, "formats": fmts}
    if args.dump_weights:
        flat = torch.cat([p.detach().float().flatten() for p in base.parameters()])
        Path(f"{args.dump_weights}.rank{acc.process_index}").write_text(repr(flat.double().sum().item()) + " " +
                                                                        repr(flat.abs().double().sum().item()))
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        if cfg:
            save_anchor(base, out / "anchor", args.anchor_format, tok, step=step, schedule=cfg.to_dict(),
                        overwrite=True)  # a rerun into the same --out replaces its own anchor
            summary["anchor"] = str(out / "anchor")
        rows = []
        for f in [x for x in args.eval_formats.split(",") if x]:
            if cfg:  # the QAT forward in format f: fake-quant of the master weights
                set_format(base, f)
                ppl = perplexity(base, held, desc=f"eval {f}")
            else:  # plain fine-tune: post-training quantization of the fine-tuned weights
                ppl = evaluate_formats(base, {f: ptq_state(base, f)}, held)[0]["perplexity"]
            rows.append({"format": f, "bits/weight": get_format(f).bits_per_weight(32), "perplexity": ppl})
        if cfg:
            set_format(base, None)
        rows.append({"format": "fp (master)", "bits/weight": 32.0, "perplexity": perplexity(base, held, desc="eval fp")})
        summary["eval"] = rows
        if losses:
            plot_curve(losses, out / "loss.png", "training loss", labels=fmts)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(format_table(rows, ["format", "bits/weight", "perplexity"]))
        print(f"steps={args.steps} time={train_s:.1f}s ({train_s / max(len(losses), 1):.2f} s/step) "
              f"final loss={summary['final_loss']} out={out}")
    return summary


if __name__ == "__main__":
    main()
