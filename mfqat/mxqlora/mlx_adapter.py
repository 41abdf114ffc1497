"""A PEFT LoRA adapter (``mfqat mx-qlora``, ``mfqat train --lora-rank``) as an mlx-lm adapter folder.

    peft_to_mlx("runs/mxqlora/adapter", "runs/mxqlora/mlx_adapter")
    # mlx_lm.load("runs/mlx4", adapter_path="runs/mxqlora/mlx_adapter"), or
    # mlx_lm.generate --model runs/mlx4 --adapter-path runs/mxqlora/mlx_adapter

mlx-lm's LoRA layer computes ``linear(x) + scale * ((dropout(x) @ lora_a) @ lora_b)`` with
``lora_a`` of shape (in, rank) and ``lora_b`` (rank, out); PEFT computes
``base(x) + scaling * lora_B(lora_A(dropout(x)))`` with ``lora_A.weight`` (rank, in) and
``lora_B.weight`` (out, rank), ``scaling = lora_alpha / r``. So ``lora_a = lora_A.weight.T``,
``lora_b = lora_B.weight.T`` and ``scale = lora_alpha / r``: the same function, up to the order
of float32 summation. The folder is what ``mfqat mlx-train --lora-rank`` writes
(adapters.safetensors + adapter_config.json with ``lora_parameters.keys``), and mlx-lm applies it
to an MLX export of the same anchor in any format (``mfqat export-mlx --recipe uniform:mxint4``).
Only the Linear layers inside the decoder blocks (``model.layers.N.*``) convert; anything else
is refused with the tensor's name.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict

import torch
from safetensors.torch import load_file, save_file

from mfqat.models import block_module
from mfqat.storage.io import PathLike, atomic_directory

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
MLX_WEIGHTS = "adapters.safetensors"
_KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")  # the module: a decoder block's (block_module)
# PEFT options mlx-lm's plain LoRA layer cannot express, with the value that is safe
_UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "rank_pattern": {},
                "alpha_pattern": {}, "modules_to_save": None, "bias": "none", "lora_bias": False,
                "use_qalora": False, "layer_replication": None, "target_parameters": None}


def _read_config(src: Path) -> dict:
    """adapter_config.json of a PEFT LoRA adapter, checked for what mlx-lm can run."""
    path = src / PEFT_CONFIG
    if not path.is_file() or not (src / PEFT_WEIGHTS).is_file():
        raise FileNotFoundError(f"{src}: not a PEFT adapter folder (needs {PEFT_CONFIG} and {PEFT_WEIGHTS}; "
                                "save it with peft's save_pretrained or mfqat mx-qlora)")
    cfg = json.loads(path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters convert to mlx-lm")
    for key, ok in _UNSUPPORTED.items():
        if cfg.get(key) is not None and cfg[key] != ok:
            raise ValueError(f"{path}: {key}={cfg[key]!r} has no mlx-lm LoRA equivalent; train with {key}={ok!r}")
    return cfg


def mlx_adapter_tensors(peft: Dict[str, torch.Tensor], where: str = "adapter") -> Dict[str, torch.Tensor]:
    """PEFT adapter tensors -> mlx-lm's names and layout (``model.layers.N.<path>.lora_a``, transposed)."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in peft.items():
        m = _KEY.match(name)
        if m is None or block_module(m.group(1)) is None:
            raise ValueError(f"{where}: tensor {name} is not a LoRA matrix of a Linear inside a decoder block "
                             "(base_model.model.model.layers.N.<module>.lora_A/B.weight); mlx-lm adapters "
                             "convert only those: train with --lora-targets inside the blocks")
        out[f"{m.group(1)}.lora_{m.group(2).lower()}"] = t.detach().t().contiguous()
    for k in out:
        twin = k[:-1] + ("b" if k.endswith("a") else "a")
        if twin not in out:
            raise ValueError(f"{where}: {k} has no matching {twin.rsplit('.', 1)[-1]}; the adapter is incomplete")
    return out


def peft_to_mlx(src: PathLike, dest: PathLike, overwrite: bool = True) -> Path:
    """Convert the PEFT LoRA adapter folder ``src`` into the mlx-lm adapter folder ``dest`` (atomic)."""
    src = Path(src)
    cfg = _read_config(src)
    tensors = mlx_adapter_tensors(load_file(str(src / PEFT_WEIGHTS)), str(src / PEFT_WEIGHTS))
    rank = int(cfg["r"])
    keys = sorted({block_module(k.rsplit(".", 1)[0])[1] for k in tensors})
    config = {"fine_tune_type": "lora",
              "num_layers": -1,  # mlx-lm: every block (one the file lacks adds exactly 0: lora_b = 0)
              "lora_parameters": {"rank": rank, "scale": float(cfg["lora_alpha"]) / rank,
                                  "dropout": float(cfg.get("lora_dropout") or 0.0), "keys": keys},
              "mfqat": {"converted_from": str(src), "base_model": cfg.get("base_model_name_or_path")}}
    with atomic_directory(dest, overwrite=overwrite, kind="peft-adapter") as tmp:
        save_file(tensors, str(tmp / MLX_WEIGHTS), metadata={"format": "mlx"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    return Path(dest)
