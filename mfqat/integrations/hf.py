"""MFQATCallback: drive MF-QAT from a transformers Trainer."""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from pathlib import Path
from typing import List, Optional

import torch
from transformers import Trainer, TrainerCallback

from mfqat.anchor.checkpoint import save_anchor
from mfqat.formats import canonical_name, get_format
from mfqat.qat import importance_state
from mfqat.qat.joint import normalized_weights, token_kl
from mfqat.qat.learned_scales import learned_parameters
from mfqat.qat.prepare import MFQATController, set_format
from mfqat.train.lora import merged_copy
from mfqat.train.args import local_inputs
from mfqat.train.setup import load_importance
from mfqat.storage.guard import check_inputs
from mfqat.integrations.hf_quantizer import register_hf_quantizer  # noqa: F401  (from_pretrained(anchor) works for Trainer users)


def find_controller(model) -> MFQATController:
    """The MFQATController of a prepared model (also through DDP / PEFT / accelerate wrappers)."""
    seen = model
    for _ in range(6):
        ctl = getattr(seen, "mfqat_controller", None) if hasattr(seen, "__dict__") else None
        if ctl is None and hasattr(seen, "__dict__"):
            ctl = seen.__dict__.get("mfqat_controller")
        if ctl is not None:
            return ctl
        seen = getattr(seen, "module", None) or getattr(seen, "base_model", None) or getattr(seen, "model", None)
        if seen is None:
            break
    raise ValueError("MFQATCallback: the model was not prepared; call mfqat.prepare(model, config) first")


def check_output_dir(output_dir: str, model) -> None:
    """The Trainer's ``output_dir`` (where it and the callback's anchors write) must not be, hold or sit
    inside the local folder the model was loaded from (UnsafeOutputError, before the first step)."""
    src = getattr(getattr(model, "config", None), "_name_or_path", None) if model is not None else None
    if isinstance(src, str) and os.path.isdir(src):
        check_inputs(Path(output_dir), local_inputs(src), flag="output_dir")


class MFQATCallback(TrainerCallback):
    """Drives the format schedule from ``state.global_step``, logs the active format, evaluates
    the eval set at several formats (elastic evaluation) and saves an anchor with each checkpoint.
    A PEFT model's anchor is written from a merged copy (adapters folded into the base weights;
    the training model is untouched); Trainer itself saves the adapters in PEFT's format.

    Args:
        eval_formats: formats evaluated at each evaluation (``eval_{fmt}_loss`` / ``_ppl`` metrics).
        anchor_format: format of the anchor saved into each checkpoint (None: no anchors;
            "auto": the QAT config's ``anchor_format``, mxint8 if it has none).
        tokenizer: saved into the anchor directories (default: the Trainer's ``processing_class``).
        max_eval_batches: cap on batches per format (None: the whole eval set).
    """

    def __init__(self, eval_formats: Optional[List[str]] = None, anchor_format: Optional[str] = "auto",
                 tokenizer=None, max_eval_batches: Optional[int] = None):
        self.eval_formats = [canonical_name(f) for f in (eval_formats or [])]
        self.anchor_format = anchor_format
        self.tokenizer = tokenizer
        self.max_eval_batches = max_eval_batches

    def anchor_fmt(self, ctl: MFQATController) -> Optional[str]:
        """The format of the anchors saved (None: no anchors)."""
        if self.anchor_format == "auto":
            return ctl.config.anchor_format or "mxint8"
        return self.anchor_format

    def on_step_begin(self, args, state, control, model=None, **kw):
        find_controller(model).set_step(model, state.global_step, max(state.max_steps, 1))

    def on_train_begin(self, args, state, control, model=None, **kw):
        check_output_dir(args.output_dir, model)
        if model is not None and not getattr(self, "driven_by_trainer", False):
            ctl = find_controller(model)
            several = ctl.step_formats(state.global_step, max(state.max_steps, 1))
            if len(several) > 1:  # a plain Trainer runs one forward per step: it would train only the first
                raise ValueError(
                    f"MFQATCallback: the QAT config's '{ctl.config.schedule}' schedule trains several formats per "
                    f"step ({', '.join(several)}); a plain transformers.Trainer runs one forward per step and would "
                    f"train only {several[0]}. Use mfqat.MFQATTrainer in place of Trainer (same arguments; it adds "
                    "this callback itself)")
        if model is None or not state.global_step or not importance_state.uses_search(model):
            return  # a resumed run (global_step > 0) continues the search rule's importance statistic
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not load_importance(model, ckpt, args.process_index):  # a crafted file: one line, never loaded
            warnings.warn(f"MFQATCallback: {importance_state.state_file(ckpt, args.process_index)} not found; the "
                          "search rule's importance statistic restarts from this step")

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if model is not None:  # the search rule's importance: all-reduced and folded once per step
            importance_state.sync_importance(model)

    def on_log(self, args, state, control, logs=None, model=None, **kw):
        if logs is not None and model is not None:
            fmt = find_controller(model).current_format()
            extra = {"mfqat_format": fmt, "mfqat_bits": get_format(fmt).bits}
            logs.update(extra)  # reporters (TensorBoard, W&B) see it
            if state.log_history:  # and so does trainer.state.log_history
                state.log_history[-1].update(extra)

    @torch.no_grad()
    def on_evaluate(self, args, state, control, metrics=None, model=None, eval_dataloader=None, **kw):
        if not self.eval_formats or eval_dataloader is None or metrics is None:
            return
        ctl = find_controller(model)
        was_training = model.training
        model.eval()
        for fmt in self.eval_formats:
            set_format(model, fmt)
            total, n = 0.0, 0
            for i, batch in enumerate(eval_dataloader):
                if self.max_eval_batches is not None and i >= self.max_eval_batches:
                    break
                batch = {k: v.to(args.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
                total += model(**batch).loss.item()
                n += 1
            loss = total / max(n, 1)
            extra = {f"eval_{fmt}_loss": loss, f"eval_{fmt}_ppl": math.exp(min(loss, 50))}
            metrics.update(extra)
            # Trainer logs the metrics before calling on_evaluate: add ours to that log entry too
            if state.log_history and any(k.startswith("eval_") for k in state.log_history[-1]):
                state.log_history[-1].update(extra)
        ctl.set_step(model, state.global_step, max(state.max_steps, 1))
        model.train(was_training)
        self._warn_reporters(args)

    def _warn_reporters(self, args) -> None:
        """Once: under a plain Trainer, reporters (TensorBoard, W&B, ...) logged the evaluation before
        this callback measured its formats, so they never see ``eval_{fmt}_*`` (MFQATTrainer's do)."""
        reports = args.report_to if isinstance(args.report_to, (list, tuple)) else [args.report_to]
        reports = [r for r in reports if r and r != "none"]
        if not reports or getattr(self, "driven_by_trainer", False) or getattr(self, "_warned_reporters", False):
            return
        self._warned_reporters = True
        names = ", ".join(f"eval_{f}_loss/_ppl" for f in self.eval_formats)
        warnings.warn(f"MFQATCallback: {names} reach the returned metrics and trainer.state.log_history, but not "
                      f"{', '.join(reports)}: a plain transformers.Trainer logs to its reporters before this callback "
                      "evaluates the formats. Use mfqat.MFQATTrainer (same arguments), which evaluates them inside "
                      "its log() call")

    def on_save(self, args, state, control, model=None, **kw):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if model is not None and importance_state.uses_search(model):  # every rank, for on_train_begin
            importance_state.save_state(model, folder, args.process_index)
        if self.anchor_format is None or not state.is_world_process_zero:
            return
        ckpt = os.path.join(folder, "mfqat_anchor")
        ctl = find_controller(model)
        base = model
        while hasattr(base, "module"):
            base = base.module
        save_anchor(merged_copy(base), ckpt, self.anchor_fmt(ctl), tokenizer=self.tokenizer or kw.get("processing_class"),
                    step=state.global_step, schedule=ctl.config.to_dict(), overwrite=True)


class MFQATTrainer(Trainer):
    """A ``transformers.Trainer`` that runs the joint MF-QAT step (``schedule: joint``).

    Each training step backpropagates ``w_f * L_f`` once per format of the step (highest first,
    gradients accumulate, DDP all-reduces once), with in-step distillation from the highest
    format's logits when ``distill_weight`` > 0. Single-format schedules run the plain step. An
    :class:`MFQATCallback` (which drives the schedule and saves anchors) is added when absent and
    runs before the reporters, so TensorBoard / W&B / the console see ``mfqat_format``.

    Evaluation (:meth:`evaluation_loop`): ``eval_loss`` is measured in one fixed format,
    ``eval_format`` (default "auto": the QAT config's anchor format), so it does not jump when the
    schedule switches; each of ``eval_formats`` adds ``eval_{fmt}_loss`` / ``eval_{fmt}_ppl`` to the
    same metrics, logged through the normal ``log()`` path. ``save_model()`` also writes an anchor
    (``OUTPUT_DIR/mfqat_anchor``, with the ``processing_class`` tokenizer).
    """

    def __init__(self, *args, eval_formats: Optional[List[str]] = None, eval_format: Optional[str] = "auto",
                 **kwargs):
        super().__init__(*args, **kwargs)
        cbs = self.callback_handler.callbacks
        cb = next((c for c in cbs if isinstance(c, MFQATCallback)), None)
        if cb is None:
            cb = MFQATCallback()
        else:
            cbs.remove(cb)
        cbs.insert(0, cb)  # before the reporters: they log what its on_log adds
        cb.driven_by_trainer = True  # runs the joint step (a plain Trainer + the callback refuses it)
        self.eval_formats = [canonical_name(f) for f in (eval_formats or cb.eval_formats)]
        cb.eval_formats = []  # evaluated here, inside the Trainer's own log() call
        self.mfqat_callback = cb
        self.eval_format = eval_format
        self._mfqat = {"weight": 1.0, "distill": 0.0, "teacher": None, "keep": False}

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, with a model's learned affine scales (``QATConfig.learn_scales``) moved into
        their own group at ``learned_scales_lr`` without weight decay (a fine-tuning lr would barely move them)."""
        built_here = self.optimizer is None  # an optimizer the user passed (optimizers=(opt, ...)) is left as given
        opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
        base = self.accelerator.unwrap_model(model if model is not None else self.model)
        learned = [p for p in learned_parameters(base) if p.requires_grad]
        ids = {id(p) for p in learned}
        if built_here and learned and not any(g.get("mfqat_learned_scales") for g in opt.param_groups):
            for g in opt.param_groups:
                g["params"] = [p for p in g["params"] if id(p) not in ids]
            opt.param_groups[:] = [g for g in opt.param_groups if g["params"]]
            opt.add_param_group({"params": learned, "lr": find_controller(base).config.learned_scales_lr,
                                 "weight_decay": 0.0, "mfqat_learned_scales": True})
        return opt

    def fixed_eval_format(self, ctl: MFQATController) -> Optional[str]:
        """The format ``eval_loss`` is measured in (None: full precision)."""
        if self.eval_format != "auto":
            return self.eval_format
        return ctl.config.anchor_format or max(ctl.config.formats, key=lambda f: get_format(f).bits)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """The Trainer's loop in the fixed format, then once per ``eval_formats`` (``{prefix}_{fmt}_*``)."""
        base = self.accelerator.unwrap_model(self.model)
        ctl = find_controller(base)
        fixed = self.fixed_eval_format(ctl)
        try:
            set_format(base, fixed)
            out = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
            for fmt in self.eval_formats:
                set_format(base, fmt)
                sub = super().evaluation_loop(dataloader, f"{description} ({fmt})", prediction_loss_only, ignore_keys,
                                              f"{metric_key_prefix}_{fmt}")
                out.metrics.update({k: v for k, v in sub.metrics.items() if not k.endswith("preparation_time")})
                loss = sub.metrics.get(f"{metric_key_prefix}_{fmt}_loss")
                if loss is not None:
                    out.metrics[f"{metric_key_prefix}_{fmt}_ppl"] = math.exp(min(loss, 50))
        finally:
            ctl.set_step(base, self.state.global_step, max(self.state.max_steps, 1))
        out.metrics[f"{metric_key_prefix}_mfqat_bits"] = get_format(fixed).bits if fixed else 32
        return out

    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """Save as the Trainer does, plus an anchor in ``output_dir/mfqat_anchor`` (checkpoints get
        theirs from :class:`MFQATCallback`). On a PEFT model the Trainer's own save is the adapters
        only (PEFT's format); the anchor holds them merged into a copy of the base."""
        super().save_model(output_dir, _internal_call)
        fmt = self.mfqat_callback.anchor_fmt(find_controller(self.model))
        if _internal_call or fmt is None or not self.args.should_save:
            return
        base = self.accelerator.unwrap_model(self.model)
        ctl = find_controller(base)
        # a PEFT model: the Trainer saved only the adapters; the anchor holds them merged into a copy of
        # the base (as the checkpoints' anchors do), so it is the model that was trained
        save_anchor(merged_copy(base), os.path.join(output_dir or self.args.output_dir, "mfqat_anchor"), fmt,
                    tokenizer=self.mfqat_callback.tokenizer or self.processing_class, step=self.state.global_step,
                    schedule=ctl.config.to_dict(), overwrite=True)

    def training_step(self, model, inputs, num_items_in_batch=None):
        ctl = find_controller(model)
        formats = ctl.step_formats(self.state.global_step, max(self.state.max_steps, 1))
        if len(formats) == 1:
            return super().training_step(model, inputs, num_items_in_batch)
        base = self.accelerator.unwrap_model(model)
        weights = normalized_weights(formats, ctl.config.weight_of)
        alpha, total = ctl.config.distill_weight, 0.0
        for i, fmt in enumerate(formats):
            set_format(base, fmt)
            self._mfqat.update(weight=weights[fmt], distill=alpha if i else 0.0, keep=alpha > 0 and i == 0)
            last = i == len(formats) - 1
            with contextlib.nullcontext() if last else self.accelerator.no_sync(model):
                total = total + super().training_step(model, inputs, num_items_in_batch)
        self._mfqat.update(weight=1.0, distill=0.0, teacher=None, keep=False)
        return total

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        st = self._mfqat
        if st["distill"] and st["teacher"] is not None:
            loss = (1 - st["distill"]) * loss + st["distill"] * token_kl(outputs.logits, st["teacher"])
        if st["keep"]:
            st["teacher"] = outputs.logits.detach()
        loss = loss * st["weight"]
        return (loss, outputs) if return_outputs else loss
