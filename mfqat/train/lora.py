"""LoRA / QLoRA for `mfqat train` through peft, and PEFT models meeting MF-QAT anchors.

* ``--lora-rank R`` adds peft LoRA adapters (``--lora-alpha``, ``--lora-dropout``, ``--lora-targets``)
  and trains only them; the adapters are saved in PEFT's format (``OUT/adapter``).
* ``--base nf4|int8`` loads the frozen base through bitsandbytes (``BitsAndBytesConfig``: NF4 with
  double quantization and bf16 compute, or LLM.int8 with its outlier threshold), then
  ``prepare_model_for_kbit_training`` (with gradient checkpointing) - the QLoRA recipe. bitsandbytes
  0.50 runs all of it on CPU too.
* With MF-QAT (an fp base and a QAT config), ``mfqat.prepare`` runs first and LoRA wraps the MF-QAT
  layers; anchors are written from a merged *copy* (:func:`merged_copy`), so training keeps its
  unmerged adapters and master weights bit for bit (merge/unmerge in place would round them).
"""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from mfqat.formats import get_format
from mfqat.storage.io import atomic_directory

from mfqat.train.args import BASES, LORA_TARGETS as DEFAULT_TARGETS  # noqa: E402,F401 (the flags live with the parser)


def check_lora_args(args, qat: bool) -> None:
    """Refuse flag combinations that would silently do something else."""
    if args.lora_rank < 0:
        raise SystemExit(f"mfqat train: --lora-rank must be >= 0, got {args.lora_rank}")
    if args.base != "fp" and not args.lora_rank:
        raise SystemExit(f"mfqat train: --base {args.base} freezes a bitsandbytes base; add --lora-rank R "
                         "(only adapters can train on it)")
    if args.base != "fp" and qat:
        raise SystemExit(f"mfqat train: --base {args.base} (a bitsandbytes base) and MF-QAT do not combine; "
                         "add --no-qat (QLoRA baseline) or use --base fp")


def bnb_config(base: str):
    """transformers ``BitsAndBytesConfig`` of ``--base``."""
    from transformers import BitsAndBytesConfig

    if base == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
    if base == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0)
    raise ValueError(f"--base {base!r}: choose one of {', '.join(BASES)}")


def load_bnb_base(model: nn.Module, base: str) -> nn.Module:
    """Reload ``model`` (an fp HF model) through bitsandbytes' ``BitsAndBytesConfig``, frozen and
    ready for k-bit training (``prepare_model_for_kbit_training``, gradient checkpointing)."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="mfqat-qlora-") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        q = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=bnb_config(base), device_map=device)
    q.name_or_path = q.config._name_or_path = getattr(model, "name_or_path", "")  # not the temp folder
    return prepare_model_for_kbit_training(q, use_gradient_checkpointing=True,
                                           gradient_checkpointing_kwargs={"use_reentrant": False})


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: str) -> nn.Module:
    """peft LoRA adapters on ``targets`` (comma list of module names, or ``all-linear``: every Linear but
    the output layer, peft's rule); only the adapters train."""
    from peft import LoraConfig, get_peft_model

    names = [t.strip() for t in targets.split(",") if t.strip()]
    target_modules = "all-linear" if names == ["all-linear"] else names  # peft's own family-independent rule
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                     task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, cfg)
    except ValueError as e:
        raise SystemExit(f"mfqat train: --lora-targets {targets!r}: {e}") from None


def is_peft(model: nn.Module) -> bool:
    """True for a peft-wrapped model (or one holding LoRA layers)."""
    return hasattr(model, "peft_config") or any("lora_" in n for n, _ in model.named_modules())


def merged_copy(model: nn.Module) -> nn.Module:
    """A copy of a PEFT model with its adapters merged into the base weights and removed (the input
    is untouched), ready for ``save_anchor``; non-PEFT models are returned as they are.

    The copy costs one more model in memory while the anchor is written; merging in place and
    unmerging afterwards would not, but it rounds the master weights (W + BA - BA != W).
    """
    if not is_peft(model):
        return model
    if not hasattr(model, "merge_and_unload"):
        raise ValueError("the model holds LoRA layers but is not a peft model; merge them first")
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        raise ValueError("the base is a bitsandbytes model (--base nf4/int8): anchors need an fp or MF-QAT "
                         "base; save the adapters instead (model.save_pretrained)")
    return copy.deepcopy(model).merge_and_unload()


def save_adapter(model: nn.Module, path: Path, tokenizer=None) -> Path:
    """The adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), atomically."""
    with atomic_directory(path, overwrite=True, kind="peft-adapter") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(path)


def resume_kwargs(model: nn.Module, folder) -> dict:
    """Keyword arguments of ``Accelerator.load_state`` for resuming ``model`` from checkpoint ``folder``.

    ``{}`` (strict loading) except on a bitsandbytes 4-bit base (``--base nf4``): its state dict holds,
    beside each packed frozen weight, the quantization state (``.absmax``, ``.quant_map``,
    ``.nested_absmax``, ...) that ``load_state_dict`` does not take back. There the checkpoint must hold
    exactly the model's state-dict keys (ValueError naming the first difference), and loading is
    non-strict so that only that save-only state is skipped.
    """
    if not getattr(model, "is_loaded_in_4bit", False):
        return {}
    from safetensors import safe_open

    path = Path(folder) / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        saved = set(f.keys())
    want = set(model.state_dict())
    for missing, where in ((sorted(want - saved), "lacks"), (sorted(saved - want), "holds an unknown")):
        if missing:
            raise ValueError(f"--resume {folder}: {path.name} {where} tensor {missing[0]} (and {len(missing) - 1} "
                             "more): a checkpoint of another model or base; resume with the run that wrote it")
    return {"strict": False}


def trainable_summary(model: nn.Module) -> dict:
    """{trainable, total} parameter counts (bnb 4-bit params count their packed bytes x 2)."""
    total = trainable = 0
    for p in model.parameters():
        n = p.numel() * (2 if p.dtype == torch.uint8 else 1)
        total += n
        trainable += n if p.requires_grad else 0
    return {"trainable_params": trainable, "total_params": total}


def base_bits_per_weight(base: str, master_bits: float = 32.0) -> float:
    """Storage of the frozen base per weight: ``master_bits`` (fp: 32 for float32 master weights, 16 for
    bfloat16), NF4 + double quant (4.127), LLM.int8 (8, plus one float32 scale per row, which this figure
    leaves out)."""
    return {"fp": float(master_bits), "nf4": get_format("nf4_dq").bits_per_weight(64), "int8": 8.0}[base]


def maybe_lora(model: nn.Module, args, qat: bool) -> Optional[nn.Module]:
    """Apply ``--base`` / ``--lora-*`` to a loaded (and possibly MF-QAT-prepared) model; None when
    LoRA is off."""
    check_lora_args(args, qat)
    if not args.lora_rank:
        return None
    if args.base != "fp":
        model = load_bnb_base(model, args.base)
    return apply_lora(model, args.lora_rank, args.lora_alpha, args.lora_dropout, args.lora_targets)
