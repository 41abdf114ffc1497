"""MX-QLoRA: LoRA adapters on a frozen mfqat anchor held as packed MX codes + E8M0 scales.

The anchor's target matrices stay in memory as its packed codes (1 byte/weight for MXINT8, half
for MXINT4) and E8M0 scales; each forward slices them to the active format (Slice-and-Scale) and
dequantizes them, the backward recomputes them (no dequantized weight is kept for autograd).
Training cycles the base format over the anchor's formats (or sums the losses of all of them:
``joint``), so *one* adapter serves every format of the anchor.

The adapters are written in PEFT's format, so in PyTorch they load on any
``load_anchor(anchor, fmt)`` with ``peft.PeftModel.from_pretrained`` - the same weights, bit for
bit, as the MX-QLoRA base in ``fmt`` (both are ``slice_and_scale(...).dequantize()``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from mfqat.anchor.checkpoint import Anchor, read_anchor
from mfqat.anchor.load import load_anchor
from mfqat.storage.manifest import AnchorError
from mfqat.formats import canonical_name, check_sliceable
from mfqat.storage.io import atomic_directory
from mfqat.quant.mxtensor import MXTensor
from mfqat.quant.slice import slice_and_scale


class MXFrozenLinear(nn.Module):
    """A frozen Linear whose weight is an anchor's packed MX codes + E8M0 scales (no bias).

    ``fmt`` selects the format the forward uses (the anchor's own, or one Slice-and-Scale reaches).
    """

    def __init__(self, q: MXTensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        self.anchor_format, self.block_size = q.fmt.name, q.block_size
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", q.pack(), persistent=False)
        self.register_buffer("scales", q.scales, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.fmt = self.anchor_format

    def weight_in(self, fmt: Optional[str], dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in ``fmt`` (None: the anchor's format), as load_anchor builds it."""
        q = MXTensor.unpack(self.packed, self.scales, self.anchor_format, self.block_size,
                            (self.out_features, self.in_features))
        if fmt is not None and fmt != self.anchor_format:
            q = slice_and_scale(q, fmt)
        return q.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _MXMatmul.apply(x, self)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"anchor={self.anchor_format}, fmt={self.fmt}")


class _MXMatmul(torch.autograd.Function):
    """y = x W^T with W dequantized in forward and again in backward (never saved)."""

    @staticmethod
    def forward(ctx, x, layer):  # type: ignore[override]
        ctx.layer, ctx.fmt = layer, layer.fmt
        return F.linear(x, layer.weight_in(layer.fmt, x.dtype))

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad @ ctx.layer.weight_in(ctx.fmt, grad.dtype), None


class LoRALinear(nn.Module):
    """base(x) + scaling * B(A(dropout(x))), with PEFT's parameter names (lora_A / lora_B)."""

    def __init__(self, base: MXFrozenLinear, rank: int, alpha: float, dropout: float = 0.0):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=5 ** 0.5)  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scaling


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _empty_model(a: Anchor) -> nn.Module:
    """The anchor's Hugging Face model with every parameter on the meta device (buffers such as
    rotary frequencies are real): nothing is allocated for the weights until they are filled."""
    import transformers
    from accelerate import init_empty_weights
    from transformers import CONFIG_MAPPING

    from mfqat.models import family_for

    if not isinstance(a.config, dict) or a.config.get("model_type") not in CONFIG_MAPPING:
        raise AnchorError(f"{a.path}: config.json is missing or has no known model_type")
    config = CONFIG_MAPPING[a.config["model_type"]].from_dict(a.config)
    auto = getattr(transformers, family_for(a.config["model_type"]).hf_auto_class)  # a VL release: the whole model
    with init_empty_weights():
        return auto.from_config(config, dtype=torch.float32)


def mx_qlora_model(anchor: str | Path, rank: int = 8, alpha: float = 16.0, dropout: float = 0.0,
                   targets: Iterable[str] = ("all-linear",)) -> nn.Module:
    """The anchor's model with every targeted quantized Linear replaced by a frozen MX layer plus a
    LoRA adapter; all other parameters frozen. ``targets``: module names (last path component), or
    ``all-linear`` (every quantized Linear, whatever the family). ``model.mx_qlora`` records the settings.

    No full-precision copy of a target weight is ever made: the model is built on the meta device,
    the targets become packed MX layers straight from the anchor's codes, and only the other
    tensors (embeddings, norms, an untied lm_head, non-target Linears dequantized) are
    materialized in float32, as ``load_anchor`` holds them.
    """
    a = read_anchor(anchor)
    model = _empty_model(a)
    targets = list(targets)
    adapted: List[str] = []
    for name, m in list(model.named_modules()):
        key = f"{name}.weight"
        if type(m) is nn.Linear and key in a.quantized:  # every quantized Linear runs in the base format
            bias = a.plain.pop(f"{name}.bias", None) if m.bias is not None else None
            base = MXFrozenLinear(a.quantized.pop(key), None if bias is None else bias.float())
            if targets == ["all-linear"] or name.rsplit(".", 1)[-1] in targets:
                _set(model, name, LoRALinear(base, rank, alpha, dropout))
                adapted.append(name)
            else:
                _set(model, name, base)
    if not adapted:
        raise ValueError(f"{anchor}: targets {targets} match no quantized Linear of the anchor; "
                         f"quantized tensors: {list(a.meta['tensors'])[:4]}...")
    rest = {k: v.float() if v.is_floating_point() else v for k, v in a.plain.items()}
    rest.update({k: q.dequantize(torch.float32) for k, q in a.quantized.items()})  # quantized, not a Linear
    _, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left or unexpected:
        raise AnchorError(f"{anchor}: weights do not match config.json: missing {left[:5]}, "
                          f"unexpected {unexpected[:5]}")
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    model.eval()
    model.mx_qlora = {"anchor": str(anchor), "anchor_format": a.format, "rank": rank, "alpha": alpha,
                      "dropout": dropout, "targets": sorted({n.rsplit('.', 1)[-1] for n in adapted})}
    return model


def mx_layers(model: nn.Module) -> Iterator[MXFrozenLinear]:
    """Every frozen MX base layer of an MX-QLoRA model."""
    return (m for m in model.modules() if isinstance(m, MXFrozenLinear))


def set_base_format(model: nn.Module, fmt: Optional[str]) -> None:
    """Run every MX base layer in ``fmt`` (None: the anchor's format); checks Slice-and-Scale reaches it."""
    for m in mx_layers(model):
        name = m.anchor_format if fmt is None else canonical_name(fmt)
        check_sliceable(m.anchor_format, name, "MX-QLoRA base")
        m.fmt = name


def lora_parameters(model: nn.Module) -> List[nn.Parameter]:
    """The adapters' parameters (the only trainable ones)."""
    return [p for n, p in model.named_parameters() if ".lora_" in n]


def adapter_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Adapter tensors under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
    return {f"base_model.model.{n}": p.detach().contiguous() for n, p in model.named_parameters() if ".lora_" in n}


def save_mx_adapter(model: nn.Module, path: str | Path) -> Path:
    """Write the adapters in PEFT's format (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    s = model.mx_qlora
    cfg = LoraConfig(r=s["rank"], lora_alpha=s["alpha"], lora_dropout=s["dropout"], target_modules=s["targets"],
                     task_type="CAUSAL_LM", base_model_name_or_path=s["anchor"])
    with atomic_directory(path, overwrite=True, kind="peft-adapter") as tmp:
        cfg.save_pretrained(str(tmp))
        save_file(adapter_state_dict(model), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return Path(path)


def load_with_adapter(anchor: str | Path, adapter: str | Path, fmt: Optional[str] = None) -> nn.Module:
    """``load_anchor(anchor, fmt)`` with the PEFT adapter applied (peft.PeftModel), ready for eval."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_anchor(anchor, fmt), str(adapter)).eval()
