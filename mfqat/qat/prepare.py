"""prepare / unprepare / set_format: swap targeted modules for MF-QAT modules and drive formats."""
from __future__ import annotations

import re
import warnings
from typing import Dict, Iterator, List, Optional, Tuple

from torch import nn

from mfqat.formats import canonical_name
from mfqat.models import Family, family_of
from mfqat.quant.scale_rules import resolve_scale_rules
from mfqat.qat.config import QATConfig
from mfqat.qat.experts import MFQATExperts, prepare_experts
from mfqat.qat.learned_scales import make_learned_scales
from mfqat.qat.modules import MFQATEmbedding, MFQATLinear, MFQATMixin
from mfqat.qat.observers import make_observer
from mfqat.qat.schedules import Schedule, ScheduleClock


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def qat_modules(model: nn.Module) -> Iterator[Tuple[str, MFQATMixin]]:
    """(name, module) for every MF-QAT module in the model (PEFT-wrapped ones included)."""
    for name, m in model.named_modules():
        if isinstance(m, MFQATMixin):
            yield name, m


class MFQATController(ScheduleClock):
    """Holds each prepared module's schedule and sets the active format per step."""

    def scheduled(self, model: nn.Module) -> Iterator[Tuple[str, MFQATMixin]]:
        """(name as prepare() saw it, module) for every MF-QAT module, PEFT-wrapped ones included."""
        for name, m in qat_modules(model):
            yield _strip_peft(name), m


def _strip_peft(name: str) -> str:
    """Module names as prepare() saw them, also after PEFT wrapping (base_model.model..., base_layer)."""
    name = re.sub(r"^base_model\.model\.", "", name)
    return name.replace(".base_layer", "")


def _refuse_prepared(model: nn.Module) -> None:
    """Raise when ``model`` already holds MF-QAT modules (preparing twice would match nothing)."""
    found = [name for name, _ in qat_modules(model)]
    if found or hasattr(model, "mfqat_controller"):
        raise ValueError(
            f"mfqat.prepare: {type(model).__name__} is already prepared ({len(found)} MF-QAT modules, "
            f"e.g. {found[:1]}); use mfqat.set_format / model.mfqat_controller to change formats, or "
            "mfqat.unprepare(model) before preparing it again with another QATConfig"
        )


def _refuse_bnb(model: nn.Module) -> None:
    """Raise when the model's layers are bitsandbytes-quantized (Linear4bit / Linear8bitLt are no
    nn.Linear to MF-QAT: the targets would match nothing, which used to be the only message)."""
    found = [(name, type(m).__name__) for name, m in model.named_modules()
             if type(m).__module__.split(".")[0] == "bitsandbytes"]
    if found:
        raise ValueError(
            f"mfqat.prepare: {type(model).__name__} is already quantized by bitsandbytes ({len(found)} "
            f"{found[0][1]} layers, e.g. {found[0][0]}); MF-QAT trains full-precision weights: load the model "
            "without quantization_config and prepare that, or train LoRA adapters on the bitsandbytes base "
            "without MF-QAT (mfqat train --base nf4 --lora-rank R --no-qat)"
        )


def _refuse_peft(model: nn.Module) -> None:
    """Raise when PEFT adapters were applied before prepare (their lora_A/lora_B are nn.Linear and
    would be fake-quantized, and the base layers, wrapped by PEFT, would not)."""
    lora = [name for name, _ in model.named_modules() if "lora_" in name.rsplit(".", 1)[-1]]
    if lora or hasattr(model, "peft_config"):
        raise ValueError(
            f"mfqat.prepare: {type(model).__name__} already holds PEFT adapters (e.g. {lora[:1]}); call "
            "mfqat.prepare(model, config) first and peft.get_peft_model(model, lora_config) after it, so the "
            "base layers are MF-QAT layers and the adapters stay full precision"
        )


def prepare(model: nn.Module, config: Optional[QATConfig] = None) -> nn.Module:
    """Swap targeted nn.Linear (and optionally nn.Embedding) modules for MF-QAT modules, in place.

    Layers whose in_features is not a multiple of the block size are skipped with a warning
    that names them (padding would change the layer's math and its state_dict). Raises
    ValueError when the targets match no layer, instead of silently training full precision.
    The controller is stored as ``model.mfqat_controller``; the format starts at the
    schedule's step 0. Preparing an already prepared model is a ValueError that says so, and so
    is a model that already holds PEFT adapters (apply PEFT after prepare); ``lora_*`` layers are
    never quantized.
    """
    config = config or QATConfig()
    _refuse_prepared(model)
    _refuse_bnb(model)
    _refuse_peft(model)
    schedules: Dict[str, Schedule] = {}
    skipped: List[str] = []
    family = family_of(model)
    _freeze_towers(model, family, config)
    for name, m in list(model.named_modules()):
        if family.tower(name) and not config.train_vision:
            continue
        fused = _expert_params(family, name, m)
        if fused:
            if config.selects(name) and not config.excludes(name):
                _prepare_experts(m, name, fused, config, skipped, schedules)
            continue
        is_linear = type(m) is nn.Linear
        is_emb = type(m) is nn.Embedding and config.quantize_embeddings
        if not (is_linear or is_emb) or config.excludes(name) or ".lora_" in f".{name}":
            continue
        if is_linear and (not config.selects(name) or family.kept_high(f"{name}.weight")):
            continue
        width = m.in_features if is_linear else m.embedding_dim
        if width % config.group_multiple():
            skipped.append(f"{name} ({width} not a multiple of {config.group_multiple()})")
            continue
        act = config.activation_format if config.quantize_activations else None
        anchor = config.anchor_format if config.through_anchor else None
        new = (MFQATLinear.from_linear(m, config.block_size, config.scale_rule, config.mask_saturated, act, anchor)
               if is_linear else
               MFQATEmbedding.from_embedding(m, config.block_size, config.scale_rule, config.mask_saturated, anchor))
        new.affine_group_size = config.affine_group_size
        new.scale_rules = resolve_scale_rules(config.scale_rule, config.scale_rules)
        if config.learn_scales:
            new.learned_scales = make_learned_scales({"weight": new.weight}, config.affine_formats(),
                                                     config.affine_group_size)
        if is_linear:
            new.keep_quantized_weights = config.keep_quantized_weights
        if is_linear and config.activation_observer:
            new.act_observer = make_observer(config.activation_observer, width, config.observer_window,
                                             m.weight.device)
        _set_submodule(model, name, new)
        schedules[name] = config.schedule_for(name)
    _wrap_tied_output(model, config, schedules)
    if skipped:
        warnings.warn("mfqat.prepare skipped layers (kept full precision): " + ", ".join(skipped))
    _warn_uncovered(model, family, config)
    if not schedules:
        raise ValueError(
            f"mfqat.prepare: targets {config.targets!r} matched no nn.Linear in "
            f"{type(model).__name__}; nothing would be quantized. Check QATConfig.targets"
        )
    controller = MFQATController(config, schedules)
    object.__setattr__(model, "mfqat_controller", controller)
    controller.set_step(model, 0, 1)
    return model


def _freeze_towers(model: nn.Module, family: Family, config: QATConfig) -> None:
    """Leave the family's towers (a vision encoder) as they are: frozen, full precision (unless
    ``config.train_vision``)."""
    if config.train_vision:
        return
    for name, p in model.named_parameters():
        if family.tower(name):
            p.requires_grad_(False)


def _expert_params(family: Family, name: str, module: nn.Module) -> List[str]:
    """The fused 3-D expert parameters of ``module`` that ``family`` quantizes (by full name)."""
    return [p for p, v in module.named_parameters(recurse=False)
            if v.dim() == 3 and family.expert_param(f"{name}.{p}") is not None]


def _prepare_experts(module: nn.Module, name: str, params: List[str], config: QATConfig, skipped: List[str],
                     schedules: Dict[str, Schedule]) -> None:
    """Fused experts: fake-quantized per expert along their last axis (mfqat.qat.experts)."""
    narrow = [f"{name}.{p} ({getattr(module, p).shape[-1]} not a multiple of {config.group_multiple()})"
              for p in params if getattr(module, p).shape[-1] % config.group_multiple()]
    if narrow:
        skipped.extend(narrow)
        return
    anchor = config.anchor_format if config.through_anchor else None
    prepare_experts(module, params, config.block_size, config.scale_rule, config.mask_saturated, anchor)
    rules = resolve_scale_rules(config.scale_rule, config.scale_rules)
    for w in [module, *module.mfqat_weights.values()]:
        w.affine_group_size, w.scale_rules = config.affine_group_size, rules
    if config.learn_scales:
        module.learned_scales = make_learned_scales({p: module._parameters[p] for p in params}, config.affine_formats(),
                                                    config.affine_group_size)
    schedules[name] = config.schedule_for(name)


def _warn_uncovered(model: nn.Module, family: Family, config: QATConfig) -> None:
    """Name every matrix of the targeted blocks that stays full precision without a reason: a 3-D
    parameter no family rule quantizes (fused experts of a family mfqat has no file for), never silently."""
    covered = {n for name, m in qat_modules(model) for n in m.target_names(name)}
    left = [f"{n} {tuple(p.shape)}" for n, p in model.named_parameters()
            if p.dim() >= 3 and n not in covered and config.selects(n.rpartition(".")[0])
            and not family.kept_high(n) and not family.tower(n) and ".learned_scales." not in n]
    if left:
        warnings.warn(f"mfqat.prepare: {family.name} has no rule for {len(left)} weight(s) that stay full "
                      f"precision: {', '.join(left[:4])}{' ...' if len(left) > 4 else ''} (mfqat/models/ lists "
                      "the families whose experts are trained)")


def _wrap_tied_output(model: nn.Module, config: QATConfig, schedules: Dict[str, Schedule]) -> None:
    """An output projection tied to a fake-quantized embedding sees the same quantized table in
    training as the anchor (which stores the shared tensor once, quantized) gives it in deployment."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(out) is not nn.Linear:
        return
    for name, m in model.named_modules():
        if isinstance(m, MFQATEmbedding) and m.weight is out.weight:
            head = next(n for n, x in model.named_modules() if x is out)
            new = MFQATLinear.from_linear(out, m.block_size, m.scale_rule, m.mask_saturated, None, m.anchor_format)
            new.affine_group_size = m.affine_group_size
            new.scale_rules = m.scale_rules
            if "learned_scales" in m._modules:  # the one tensor, one set of learned scales: the embedding's,
                new.__dict__["_scales_owner"] = m  # read through it (a shared submodule would be a tied tensor to HF)
            new.keep_quantized_weights = config.keep_quantized_weights
            _set_submodule(model, head, new)
            schedules[head] = schedules[name]
            return


def set_format(model: nn.Module, fmt: Optional[str]) -> None:
    """Pin every MF-QAT module to one format (None = full precision), e.g. for evaluation."""
    name = None if fmt is None else canonical_name(fmt)
    for _, m in qat_modules(model):
        m.fmt = name


def unprepare(model: nn.Module) -> nn.Module:
    """Replace MF-QAT modules by plain nn.Linear / nn.Embedding sharing the same parameters."""
    for name, m in list(qat_modules(model)):
        if isinstance(m, MFQATExperts):
            m.to_plain()
            continue
        plain = m.to_linear() if isinstance(m, MFQATLinear) else m.to_embedding()  # type: ignore[union-attr]
        _set_submodule(model, name, plain)
    if hasattr(model, "mfqat_controller"):
        object.__delattr__(model, "mfqat_controller")
    return model
