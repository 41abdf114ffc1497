"""Command-line arguments of `mfqat train` / scripts/train.py (see mfqat.train.loop)."""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

LORA_TARGETS = "all-linear"  # peft's rule: every nn.Linear except the output layer, in any model family
BASES = ("fp", "nf4", "int8")  # LoRA flags (at the end); mfqat.train.lora reads these
MASTER_DTYPES = ("float32", "bfloat16")  # --dtype: the torch dtype names (mfqat.train.setup.master_dtype)

TRAIN_DOC = """MF-QAT fine-tuning of a causal LM with accelerate (single process, DDP or FSDP).

    accelerate launch [--config_file CONFIGS/accelerate/ddp.yaml] -m mfqat train \\
        --qat-config mxint_2468 --steps 120 --out runs/mfqat

CONFIGS is the mfqat/configs folder of the installed package (configs/ in a checkout, where
scripts/train.py runs the same loop).

Defaults: the embedded SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32), Python's pydoc
text, joint MF-QAT over mxint8/6/4 through the MXINT8 anchor (the paper's progressive recipe:
--qat-config mxint_2468).
Ends by saving an anchor (the QAT config's anchor format, or --anchor-format) and printing a
perplexity table.
"""


def build_parser(prog: str = "mfqat train") -> argparse.ArgumentParser:
    """The flags of `mfqat train` (HF Trainer / mlx-lm names are accepted as aliases)."""
    p = argparse.ArgumentParser(prog=prog, description=TRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2-135M-Instruct, "
                   "Q4_1 GGUF dequantized); 'tiny' builds a tiny random Llama")
    p.add_argument("--text", default=None, help="training text: file, folder, or pydoc (default); a .jsonl is read "
                   "as --dataset")
    p.add_argument("--dataset", default=None, help="a .jsonl file (or a folder with train.jsonl [+ valid.jsonl]) of records with a 'text' field, chat 'messages' (rendered with the tokenizer's chat template) or 'prompt'/'completion'")
    p.add_argument("--qat-config", default=None, help="YAML QATConfig file, or the name of a shipped recipe (mxint_joint, "
                   "mxint_468_cyclic, ...: see docs/recipes.md); default: mxint_joint_search (joint mxint8/6/4 with the "
                   "scale search trained in), or QATConfig's defaults with --formats")
    p.add_argument("--formats", default=None, help="comma list overriding the config's formats")
    p.add_argument("--schedule", default=None, help="override the config's schedule")
    p.add_argument("--no-qat", action="store_true", help="plain fine-tuning (the fair baseline)")
    p.add_argument("--distill", type=float, default=0.0, metavar="ALPHA",
                   help="self-distillation: loss = (1-ALPHA)*CE + ALPHA*KL(fp master model || quantized model); "
                        "one extra no-grad forward per step")
    p.add_argument("--loss-weights", default="", metavar="FMT=W,...",
                   help="joint schedule: per-format loss weights (others weigh 1)")
    p.add_argument("--distill-weight", type=float, default=None, metavar="ALPHA",
                   help="joint schedule: formats below the highest learn (1-ALPHA)*CE + ALPHA*KL from its logits")
    p.add_argument("--learn-scales", action="store_true", default=None,
                   help="also learn each affine width's scale and bias per group with the weights (QATConfig."
                        "learn_scales; the anchor stores them); needs an affine format, e.g. --qat-config affine_joint")
    p.add_argument("--learned-scales-lr", type=float, default=None, metavar="LR",
                   help="learning rate of the learned scales (default: the config's learned_scales_lr, 1e-3)")
    p.add_argument("--joint-sample", type=int, default=None, metavar="K",
                   help="joint schedule: train the highest + lowest + K sampled formats per step (default: all)")
    p.add_argument("--train-vision", action="store_true",
                   help="vision-language release (Qwen3.5): also MF-QAT-train the vision tower's Linears (default: "
                        "frozen, full precision; QATConfig.train_vision)")
    p.add_argument("--keep-quantized-weights", action="store_true",
                   help="keep each Linear's fake-quantized weight from the forward for its backward instead of "
                        "recomputing it (same gradients; one fewer fake-quant per weight per format, one extra "
                        "weight copy held per format pass)")
    p.add_argument("--steps", "--max-steps", "--iters", dest="steps", type=int, default=120, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", "--learning-rate", dest="lr", type=float, default=2e-5)
    p.add_argument("--lr-schedule", default="constant", choices=["constant", "cosine"],
                   help="after --warmup-steps of linear warm-up: constant, or cosine decay to 0")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--lr-mult", default="", metavar="FAMILY=X,...",
                   help="per-family learning-rate multipliers, e.g. mxint=1.5,mxfp=1.0 (the family of each "
                        "step's highest format)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--optim", default="adamw", choices=["adamw", "adamw8bit", "paged_adamw8bit"])
    p.add_argument("--grad-compress", default="none", metavar="FMT",
                   help="DDP: all-reduce gradients as MX codes + E8M0 scales (mxfp8, mxint8, mxint4, ...: "
                        "mfqat.train.grad_compress) with error feedback; none = fp32 all-reduce")
    p.add_argument("--no-error-feedback", action="store_true",
                   help="--grad-compress without carrying the quantization residual to the next step")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16", "fp16"])
    p.add_argument("--dtype", default="float32", choices=list(MASTER_DTYPES),
                   help="dtype of the master weights, their gradients and the optimizer state (bfloat16: half "
                        "the memory of float32, but each AdamW update is rounded to bfloat16: a weight moves only "
                        "when its step exceeds half its last bit, 0.2-0.4%% of its magnitude, so a small "
                        "--lr trains less than in float32). The MF-QAT forward computes the same quantized "
                        "weights as from a float32 copy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--output-dir", "--save-path", dest="out", default="runs/mfqat")
    p.add_argument("--overwrite", "--overwrite-output-dir", dest="overwrite", action="store_true",
                   help="replace the outputs of an earlier `mfqat train` run in --out (never a file it did not write)")
    p.add_argument("--anchor-format", default=None,
                   help="format of the saved anchor (default: the QAT config's anchor_format, else mxint8)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint (accelerate state + anchor) every N steps")
    p.add_argument("--resume", default=None, help="checkpoint folder to resume from")
    p.add_argument("--eval-formats", default="", help="comma list evaluated on held-out text at the end")
    p.add_argument("--eval-blocks", type=int, default=16, help="held-out blocks of seq-len tokens")
    p.add_argument("--save-master", action="store_true",
                   help="also write the full-precision master weights as an HF folder OUT/master")
    p.add_argument("--report-to", default="none", metavar="TRACKERS",
                   help="accelerate trackers for the training and eval metrics: comma list (tensorboard, wandb, mlflow, ...), 'all' (every installed one) or 'none'; logs go to OUT")
    p.add_argument("--dump-weights", default=None, help="(tests) write a per-rank weight checksum here")
    add_lora_args(p)
    return p


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA / QLoRA flags of `mfqat train`."""
    g = p.add_argument_group("LoRA / QLoRA (peft, bitsandbytes)")
    g.add_argument("--lora-rank", type=int, default=0, help="train peft LoRA adapters of this rank (0: off)")
    g.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA scaling numerator (scale = alpha / rank)")
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-targets", default=LORA_TARGETS,
                   help="comma list of module names to adapt, or all-linear (default: peft's rule, every Linear "
                        "but the output layer, whatever the family: q/k/v/o/gate/up/down on Llama, qkv_proj/"
                        "gate_up_proj on Phi-3, query_key_value/dense_* on GPT-NeoX; fused MoE experts are "
                        "not Linears and get none)")
    g.add_argument("--base", default="fp", choices=BASES,
                   help="frozen base under LoRA: fp, or bitsandbytes nf4 (double quant, bf16 compute) / "
                        "int8 (LLM.int8, outlier threshold 6)")


# What a checkpoint must share with the run that resumes it (the model, the data and its order, the
# batches per optimizer step, the recipe); recorded in checkpoint-N/mfqat_step.json under "run".
RUN_KEYS = ("model", "text", "dataset", "qat_config", "formats", "schedule", "batch_size", "grad_accum",
            "seq_len", "seed", "lora_rank", "base", "learn_scales", "dtype")


def run_identity(args: argparse.Namespace) -> dict:
    """{flag: value} of :data:`RUN_KEYS` (existing paths made absolute)."""
    def norm(v):
        return str(Path(v).resolve()) if isinstance(v, str) and os.path.exists(v) else v
    return {k: norm(getattr(args, k, None)) for k in RUN_KEYS}


def check_resume(args: argparse.Namespace) -> None:
    """--resume must name a checkpoint folder of this run (ValueError naming --resume and the path);
    cheap: runs before any model loads. Checkpoints written before the run was recorded pass."""
    if not args.resume:
        return
    path = Path(args.resume)
    step_file = path / "mfqat_step.json"
    if not step_file.is_file():  # mfqat.storage.train_checkpoint.verify_checkpoint says what is missing
        return
    saved = json.loads(step_file.read_text()).get("run") or {}
    now = run_identity(args)
    diff = [f"--{k.replace('_', '-')} {saved[k]} there, {now[k]} here" for k in RUN_KEYS if k in saved and saved[k] != now[k]]
    if diff:
        raise ValueError(f"--resume {path}: a checkpoint of another run ({'; '.join(diff)}); resume with the "
                         "settings of the run that wrote it")


def at_least(args, minimums: dict) -> None:
    """Refuse a numeric flag below its minimum ({dest: minimum}; None values are skipped): ValueError
    naming the flag, before any model loads (a negative --steps would save an untrained anchor, a
    --seq-len of 1 has no next token to predict and reports perplexity 1)."""
    for dest, low in minimums.items():
        v = getattr(args, dest, None)
        if v is not None and v < low:
            flag = "--" + dest.replace("_", "-")
            why = " (a block needs a token and the next one to predict)" if dest == "seq_len" else ""
            raise ValueError(f"{flag} must be >= {low}, got {v}{why}")


TRAIN_MINIMUMS = {"steps": 1, "batch_size": 1, "seq_len": 2, "grad_accum": 1, "save_every": 0, "warmup_steps": 0,
                  "eval_blocks": 1, "lora_rank": 0, "joint_sample": 0, "grad_clip": 0, "weight_decay": 0,
                  "distill": 0, "lr": 0}


def check_finite(args) -> None:
    """Every float flag is a finite number (``float('nan')`` passes any ``<`` test, ``inf`` any ``>``)."""
    for dest, v in vars(args).items():
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"--{dest.replace('_', '-')} must be a finite number, got {v}")


def parse_pairs(spec: str, flag: str, keys, what: str, positive: bool = True) -> dict:
    """``KEY=X,...`` -> {KEY: X}: every KEY one of ``keys``, every X a finite number, > 0 (``positive``)
    or >= 0; ValueError naming ``flag`` otherwise."""
    out = {}
    for item in (x.strip() for x in (spec or "").split(",")):
        if not item:
            continue
        key, eq, val = item.partition("=")
        key = key.strip().lower()
        try:
            x = float(val)
        except ValueError:
            x = None
        if not eq or x is None:
            raise ValueError(f"{flag} {item}: write KEY=NUMBER, e.g. {flag} {sorted(keys)[0]}=1.5")
        if key not in keys:
            raise ValueError(f"{flag} {key}: not {what}; choose from {', '.join(sorted(keys))}")
        if not math.isfinite(x) or x < 0 or (positive and x == 0):
            raise ValueError(f"{flag} {key}={val}: must be a finite number {'> 0' if positive else '>= 0'}")
        out[key] = x
    return out


FAMILIES = ("mxint", "mxfp", "affine", "nvfp4")  # the families an MF-QAT run trains


def check_train_args(args) -> None:
    """The checks of `mfqat train`'s own flags that need no file (ValueError names the flag)."""
    check_finite(args)
    at_least(args, TRAIN_MINIMUMS)
    if not args.lr > 0:
        raise ValueError(f"--lr must be > 0, got {args.lr}")
    parse_pairs(args.lr_mult, "--lr-mult", FAMILIES, "a format family")
    if args.distill >= 1:
        raise ValueError(f"--distill must be below 1 (the weight of the KL term), got {args.distill}")
    if args.base != "fp" and not args.lora_rank:
        raise ValueError(f"--base {args.base} freezes a bitsandbytes base; add --lora-rank R (only adapters can "
                         "train on it)")
    if args.base != "fp" and not args.no_qat:
        raise ValueError(f"--base {args.base} (a bitsandbytes base) and MF-QAT do not combine; add --no-qat "
                         "(QLoRA baseline) or use --base fp")
    check_dtype(args)


def check_dtype(args) -> None:
    """--dtype bfloat16 (bf16 master weights) refuses the flags it contradicts (ValueError naming both)."""
    if getattr(args, "dtype", "float32") != "bfloat16":
        return
    if args.mixed_precision == "fp16":
        raise ValueError("--dtype bfloat16 with --mixed-precision fp16: fp16 autocast would compute a bfloat16 "
                         "master in float16 and scale its bfloat16 gradients; use --mixed-precision bf16 or no")
    if args.base != "fp":
        raise ValueError(f"--dtype bfloat16 with --base {args.base}: the bitsandbytes base casts every "
                         "unquantized parameter to float32 (prepare_model_for_kbit_training); drop --dtype or "
                         "use --base fp")


def local_inputs(*paths) -> list:
    """The arguments that name existing files or folders (the inputs an output must not touch)."""
    return [Path(p) for p in paths if isinstance(p, str) and p and os.path.exists(p)]


def train_outputs(args) -> dict:
    """{name: "file" or folder kind} of what a `mfqat train` run writes into --out."""
    outs = {"summary.json": "file", "loss.png": "file"}
    if not args.no_qat:
        outs["anchor"] = "anchor"
    if args.lora_rank:
        outs["adapter"] = "peft-adapter"
    if args.save_master:
        outs["master"] = "hf-model"
    if args.save_every and args.save_every > 0:
        for step in [*range(args.save_every, args.steps + 1, args.save_every), args.steps]:
            outs[f"checkpoint-{step}"] = "train-checkpoint"
    return outs


def check_train_output(args) -> None:
    """--out of `mfqat train` (mfqat.storage.guard.check_run_folder): not over its model or text, an
    existing folder only an earlier train run with --overwrite (or the run a --resume continues)."""
    from mfqat.storage.guard import check_run_folder  # stdlib only

    check_run_folder(Path(args.out), "train", train_outputs(args), args.overwrite,
                     protect=local_inputs(args.model, args.text, args.dataset),
                     resume=Path(args.resume) if args.resume else None)
