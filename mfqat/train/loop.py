"""MF-QAT fine-tuning of a causal LM with accelerate (single process, DDP or FSDP).

    accelerate launch [--config_file configs/accelerate/ddp.yaml] scripts/train.py \
        --qat-config mxint_2468 --steps 120 --out runs/mfqat

Defaults: the embedded SmolLM2-135M, Python's pydoc text, joint MF-QAT over mxint8/6/4 (mxint_joint).
Ends by saving an MXINT8 (or --anchor-format) anchor and printing a perplexity table.
"""
from __future__ import annotations

import contextlib
import json
import pickle
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.utils.data import DataLoader, TensorDataset

from mfqat.progress import progress, quiet_dependency_logs
from mfqat.anchor.checkpoint import save_anchor
from mfqat.anchor.sharded_save import save_anchor_sharded
from mfqat.data.sources import byte_tokenizer, load_model, tiny_llama
from mfqat.eval.elastic import evaluate_formats, ptq_state
from mfqat.eval.perplexity import perplexity
from mfqat.eval.report import plot_curve
from mfqat.formats import get_format
from mfqat.qat.joint import joint_backward, token_kl, weighted_loss
from mfqat.qat.observers import mean_clip_rate
from mfqat.train.lora import (base_bits_per_weight, maybe_lora, merged_copy, resume_kwargs, save_adapter,
                              trainable_summary)
from mfqat.train.optim import make_optimizer
from mfqat.qat.learned_scales import param_groups
from mfqat.train.args import (build_parser, check_resume, check_train_args, check_train_output,
                              run_identity)
from mfqat.train.setup import (_forever, check_model_fits, check_run_values, check_token_ids, load_data,
                               load_importance, load_qat_config, log_with, make_lr_lambda,  # noqa: F401
                               master_dtype, peak_memory_mib, save_master)
from mfqat.train import fsdp, grad_compress
from mfqat.train.summary import run_summary, write_summary
from mfqat.storage.io import RunFolder
from mfqat.storage.sharded import full_state_dict, is_sharded
from mfqat.storage.train_checkpoint import seal_checkpoint, verify_checkpoint
from mfqat.qat import importance_state
from mfqat.qat.importance_state import ImportanceStatistic, uses_search
from mfqat.qat.prepare import prepare, set_format


SCHEDULER_FILE = "mfqat_scheduler.json"  # the LR scheduler's state_dict (JSON, never a pickle)


def distillation_loss(model, base, ctl, batch: torch.Tensor, step: int, total: int, alpha: float) -> torch.Tensor:
    """(1 - alpha) * next-token CE + alpha * per-token KL from the full-precision master model (the
    same weights, no fake-quant) to the model in this step's formats."""
    with torch.no_grad():
        set_format(base, None)
        teacher = model(input_ids=batch).logits.float()
        ctl.set_step(base, step, total)  # back to this step's per-layer formats
    out = model(input_ids=batch, labels=batch)
    return (1 - alpha) * out.loss + alpha * token_kl(out.logits, teacher)


def micro_step(args, acc, model, base, ctl, cfg, batch: torch.Tensor, step: int, sync: bool) -> Dict[str, float]:
    """Forward + backward of one micro-batch in every format of ``step``; {format: loss}. DDP
    all-reduces only on the last backward of the last micro-batch (``sync``)."""
    scale = 1.0 / args.grad_accum
    formats = ctl.step_formats(step, args.steps) if ctl else ["fp"]
    if ctl:
        ctl.set_step(base, step, args.steps)  # per-layer formats of one-format schedules
    with contextlib.nullcontext() if sync else fsdp.no_sync(acc, model):
        if len(formats) > 1:
            return joint_backward(model, base, {"input_ids": batch, "labels": batch}, formats, cfg.weight_of,
                                  acc.backward, cfg.distill_weight, scale, lambda: fsdp.no_sync(acc, model))
        loss = (distillation_loss(model, base, ctl, batch, step, args.steps, args.distill)
                if ctl and args.distill else model(input_ids=batch, labels=batch).loss)
        acc.backward(loss * scale)
    return {formats[0]: loss.item()}


def final_eval(args, cfg, base, saved, held: torch.Tensor, lora, show: bool = True) -> List[dict]:
    """The run's closing table: perplexity in each --eval-formats format, then in full precision."""
    rows = []
    for f in [x for x in args.eval_formats.split(",") if x]:
        if cfg:  # the saved model's QAT forward in format f (through the anchor: what load_anchor(fmt=f)
            # gives). With LoRA that is the merged copy, quantized with the adapters in its weights; the
            # unmerged model would add the adapters in full precision beside the quantized base.
            set_format(saved, f)
            ppl = perplexity(saved, held, desc=f"eval {f}" if show else None)
        else:  # plain fine-tune: post-training quantization of the fine-tuned weights
            ppl = evaluate_formats(base, {f: ptq_state(base, f)}, held)[0]["perplexity"]
        rows.append({"format": f, "bits/weight": get_format(f).bits_per_weight(32), "perplexity": ppl})
    if cfg:
        set_format(saved, None)
        set_format(base, None)
    top = "fp (master)" if lora is None else f"{args.base} base + LoRA"
    bits = base_bits_per_weight(args.base, torch.finfo(master_dtype(args)).bits)
    rows.append({"format": top, "bits/weight": bits,
                 "perplexity": perplexity(base, held, desc="eval fp" if show else None)})
    return rows


def main(argv: Optional[List[str]] = None, trackers: Optional[list] = None) -> dict:
    """Run training; return a summary dict (also written to OUT/summary.json). ``trackers``:
    accelerate ``GeneralTracker`` objects to log to, besides those named by --report-to."""
    quiet_dependency_logs()  # before transformers pulls torchao in (see mfqat.progress)
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    args = build_parser().parse_args(argv)
    check_train_args(args)
    # a resume trusts only a checkpoint mfqat sealed (no pickle from elsewhere is ever loaded) and written by
    # a run with these settings: checked before any model loads
    resume_step = verify_checkpoint(args.resume, steps=args.steps) if args.resume else 0
    check_resume(args)
    check_train_output(args)  # every rank, before the barrier after which rank 0 writes into --out
    cfg = None if args.no_qat else load_qat_config(args)  # a recipe that cannot work fails before the model loads
    check_run_values(args, cfg)
    # without CUDA, cpu=True lets torchrun-style launches (accelerate launch --multi_gpu) run as
    # MULTI_CPU ranks over gloo instead of silently running N independent single processes
    out = Path(args.out)
    named = log_with(args.report_to)
    wanted = (list(trackers or []) + ([named] if isinstance(named, str) else named or [])) or None
    acc = Accelerator(mixed_precision=args.mixed_precision, cpu=not torch.cuda.is_available(),
                      log_with=wanted, project_dir=str(out))
    acc.wait_for_everyone()  # every rank checked --out (above) before rank 0 writes its run record (below)
    if wanted:
        acc.init_trackers("mfqat", config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))})
    set_seed(args.seed)
    self_shard = fsdp.self_sharded(acc)  # FSDP asked for on CPU ranks: accelerate cannot, we fully_shard
    if self_shard:
        fsdp.check_args(args, acc)
    elif fsdp.requested() and acc.num_processes == 1:
        print("[mfqat] warning: FSDP config with a single process: nothing to shard, training unsharded")
    dtype = master_dtype(args)  # --dtype: the master weights, their gradients and the optimizer state
    model, tok = (tiny_llama(vocab_size=320).to(dtype), None) if args.model == "tiny" else load_model(args.model, dtype)
    check_model_fits(model, args.seq_len)
    train, held = load_data(args, tok, acc.num_processes)  # tiny: the text's bytes are the token ids
    what = f"--dataset {args.dataset}" if args.dataset else f"--text {args.text or 'pydoc'}"
    check_token_ids(model, train, held, what=what)  # a tokenizer that is not the model's: before the first step
    tok = tok if tok is not None else byte_tokenizer()  # saved with every anchor: eval / export-mlx read it
    if cfg is not None:
        if args.distill and cfg.schedule == "joint":
            raise SystemExit("mfqat train: --distill (from the fp master) and the joint schedule do not combine; "
                             "set distill_weight in the QAT config (the joint step distills from its anchor branch)")
        prepare(model, cfg)
    lora = maybe_lora(model, args, qat=cfg is not None)  # --lora-rank / --base (after prepare: LoRA wraps MF-QAT layers)
    if lora is not None and args.eval_formats and cfg is None:
        raise SystemExit("mfqat train: --eval-formats post-training-quantizes the fine-tuned weights; with "
                         "--lora-rank and --no-qat merge the adapter first (or train with MF-QAT)")
    if lora is not None and cfg is not None and cfg.learn_scales:
        raise SystemExit("mfqat train: --learn-scales learns the scales with the base weights, which LoRA freezes; "
                         "train without --lora-rank / --base, or learn the scales afterwards with mfqat refine ANCHOR")
    model = lora if lora is not None else model
    anchor_format = args.anchor_format or (cfg.anchor_format if cfg else None) or "mxint8"
    if args.gradient_checkpointing and cfg is not None and cfg.activation_observer:
        raise SystemExit("mfqat train: --gradient-checkpointing reruns each forward in backward, which would "
                         "enter the activation observer's window twice; drop one of the two")
    if args.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(TensorDataset(train), batch_size=args.batch_size, shuffle=True, generator=g, drop_last=True)
    if self_shard:
        fsdp.shard(model)  # before the optimizer: it must hold the sharded parameters
    ctl = (model.get_base_model() if lora is not None else model).__dict__.get("mfqat_controller")
    scales_lr = ctl.config.learned_scales_lr if ctl is not None else args.lr
    opt = make_optimizer(args.optim, param_groups(model, args.lr, args.weight_decay, scales_lr), args.lr,
                         args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, make_lr_lambda(args, ctl))
    if self_shard:
        opt, loader = acc.prepare(opt, loader)
    else:
        model, opt, loader = acc.prepare(model, opt, loader)
    # the LR scheduler is not prepared (accelerate would step it once per rank), nor registered with
    # accelerate's checkpointing (which unpickles it with weights_only=False): its state is JSON
    base = acc.unwrap_model(model)
    importance = ImportanceStatistic(base) if uses_search(base) else None  # the search rule's sums, per rank
    gc = grad_compress.setup(acc, model, args.grad_compress, not args.no_error_feedback)
    start = 0
    if args.resume:
        try:  # safetensors, and torch.load(weights_only=True) for the optimizer / RNG: no pickled code runs
            acc.load_state(args.resume, **resume_kwargs(base, args.resume))  # nf4: skips bnb's save-only state
        except pickle.UnpicklingError as e:
            raise ValueError(f"--resume {args.resume}: refused: a state file holds more than tensors and plain data "
                             f"(torch.load weights_only=True: {str(e).strip().splitlines()[0][:200]})") from None
        except (RuntimeError, KeyError, EOFError) as e:
            raise ValueError(f"--resume {args.resume}: the checkpoint does not fit this run "
                             f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})") from None
        start = resume_step
        sched.load_state_dict(json.loads((Path(args.resume) / SCHEDULER_FILE).read_text()))
        if gc and grad_compress.residual_file(args.resume, acc.process_index).is_file():
            gc.load_state_dict(torch.load(grad_compress.residual_file(args.resume, acc.process_index),
                                          weights_only=True))
        if importance and not load_importance(base, args.resume, acc.process_index):
            warnings.warn(f"{args.resume} holds no importance sums (mfqat_importance_rank*.pt); the search "
                          "rule's importance statistic restarts from this step")
    run = RunFolder(out, "train").start() if acc.is_main_process else None  # the first write into --out
    grad_bytes: List[int] = []
    losses: List[float] = []
    fmts: List[str] = []
    bar = progress(total=args.steps, initial=start, desc="MF-QAT" if cfg else "fine-tune", disable=not acc.is_main_process)
    step, t0 = start, time.perf_counter()
    batches = _forever(loader)
    for _ in range(start * args.grad_accum):  # resume: the same batches as an uninterrupted run
        next(batches)
    while step < args.steps:
        step_losses: Dict[str, List[float]] = {}
        for micro in range(args.grad_accum):
            for f, v in micro_step(args, acc, model, base, ctl, cfg, next(batches), step,
                                   sync=micro == args.grad_accum - 1).items():
                step_losses.setdefault(f, []).append(v)
        if args.grad_clip:
            acc.clip_grad_norm_(model.parameters(), args.grad_clip)
        if importance:  # every rank folds the same (all-reduced) importance before the weights change
            importance_state.sync_importance(base)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if gc:
            grad_bytes.append(gc.pop_bytes()[0])
        per_fmt = {f: sum(v) / len(v) for f, v in step_losses.items()}
        losses.append(weighted_loss(per_fmt, cfg.weight_of) if cfg else per_fmt["fp"])
        fmts.append("+".join(per_fmt))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", fmt=fmts[-1])
        if wanted:
            acc.log({"train/loss": losses[-1], "train/lr": sched.get_last_lr()[0],
                     **{f"train/loss_{f}": v for f, v in per_fmt.items()}}, step=step)
        bar.update(1)
        if args.save_every and (step % args.save_every == 0 or step == args.steps):  # the last step too
            ckpt = out / f"checkpoint-{step}"
            acc.save_state(str(ckpt))
            if gc:  # each rank's own residuals
                ckpt.mkdir(parents=True, exist_ok=True)
                torch.save(gc.state_dict(), grad_compress.residual_file(ckpt, acc.process_index))
            if importance:  # and its own importance sums
                importance_state.save_state(base, ckpt, acc.process_index)
            by_rank = fsdp.per_rank_anchor(base, cfg, lora)
            if by_rank:  # every rank quantizes and writes its own part (no full state dict anywhere)
                save_anchor_sharded(base, ckpt / "mfqat_anchor", anchor_format, tok, step=step,
                                    schedule=cfg.to_dict(), overwrite=True)
            sd = full_state_dict(base) if cfg and is_sharded(base) and not by_rank else None  # every rank gathers
            acc.wait_for_everyone()  # every rank's files are written before rank 0 seals the folder
            if acc.is_main_process:
                (ckpt / SCHEDULER_FILE).write_text(json.dumps(sched.state_dict()))
                if cfg and not by_rank:
                    save_anchor(merged_copy(base), ckpt / "mfqat_anchor", anchor_format, tok, step=step,
                                schedule=cfg.to_dict(), overwrite=True, state_dict=sd)
                seal_checkpoint(ckpt, step, extra={"run": run_identity(args)})  # last: --resume refuses a folder without it
                run.folder(ckpt.name, "train-checkpoint")
    bar.close()
    train_s = time.perf_counter() - t0
    acc.wait_for_everyone()
    summary = run_summary(args.steps, train_s, losses, formats=fmts, peak_memory_mib=peak_memory_mib(),
                          optimizer=type(getattr(opt, "optimizer", opt)).__name__,  # the class behind accelerate's wrapper
                          master_dtype=args.dtype)
    if cfg is not None and cfg.activation_observer:  # mean over layers of the clipped fraction of inputs
        summary["activation_clip_rate"] = mean_clip_rate(base)
    if gc:
        summary["grad_compress"] = {"format": gc.fmt, "error_feedback": gc.error_feedback,
                                    "bytes_sent_per_step": grad_bytes}
    if args.dump_weights:
        flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().flatten()
                          for p in base.parameters()])
        Path(f"{args.dump_weights}.rank{acc.process_index}").write_text(repr(flat.double().sum().item()) + " " +
                                                                        repr(flat.abs().double().sum().item()))
    if is_sharded(base):
        summary["fsdp"] = "fully_shard (torch FSDP2) on CPU ranks" if self_shard else "accelerate FSDP"
    by_rank = fsdp.per_rank_anchor(base, cfg, lora)
    if by_rank:  # FSDP: every rank quantizes and writes its own part of the anchor (mfqat.anchor.sharded_save)
        saved_by = save_anchor_sharded(base, out / "anchor", anchor_format, tok, step=step, schedule=cfg.to_dict(),
                                       overwrite=True)  # only this command's own earlier anchor (checked up front)
        summary["anchor_save"] = {"path": "per-rank", **{k: saved_by[k] for k in (
            "ranks", "files", "max_gathered_bytes", "rank_bytes", "state_dict_bytes")}}
    elif is_sharded(base):
        summary["anchor_save"] = {"path": "full-gather"}
    sharded_eval = by_rank and not args.save_master  # the evaluation runs sharded, on every rank
    if is_sharded(base) and not sharded_eval:  # every rank joins the gather; rank 0 finishes on an unsharded copy
        sharded_importance = importance.state_dict() if importance else None
        base = fsdp.unsharded_copy(base, cfg, acc.is_main_process)
        if sharded_importance is not None and base is not None:  # the copy is a new model: carry the sums
            ImportanceStatistic(base).load_state_dict(sharded_importance)
    # what the anchor holds: LoRA merged into the weights
    saved = merged_copy(base) if cfg and (acc.is_main_process or sharded_eval) else None
    if acc.is_main_process:
        if cfg and not by_rank:
            save_anchor(saved, out / "anchor", anchor_format, tok, step=step, schedule=cfg.to_dict(),
                        overwrite=True)  # only this command's own earlier anchor (checked up front)
        if cfg:
            summary["anchor"] = str(run.folder("anchor", "anchor"))
        if lora is not None:
            save_adapter(base, out / "adapter", tok)
            summary["adapter"] = str(run.folder("adapter", "peft-adapter"))
            summary.update(trainable_summary(base), base=args.base)
        if args.save_master:
            save_master(base, tok, out / "master")
            summary["master"] = str(run.folder("master", "hf-model"))
    if acc.is_main_process or sharded_eval:  # sharded: every rank runs the same forwards (they are collectives)
        rows = final_eval(args, cfg, base, saved, held, lora, show=acc.is_main_process)
    if acc.is_main_process:
        summary["eval"] = rows
        if wanted:
            acc.log({f"eval/{r['format'].split()[0]}_ppl": r["perplexity"] for r in rows}, step=step)
        if losses:
            run.write("loss.png", lambda p: plot_curve(losses, p, "training loss", labels=fmts))
        write_summary(run, summary, f"out={out}")
    if wanted:
        acc.end_training()
    return summary


if __name__ == "__main__":
    main()
