"""QATConfig: what to quantize, in which formats, on which schedule (loadable from YAML)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import yaml

import math

from mfqat.quant.derive import DERIVED_GROUP_SIZE, check_reachable
from mfqat.formats import AFFINE_GROUP_SIZES, MX_BLOCK_SIZES, canonical_name, get_format
from mfqat.models.layout import DECODER_BLOCK
from mfqat.quant.reference import SCALE_RULES
from mfqat.quant.scale_rules import SEARCH_ANCHORS, SEARCH_RULE, check_scale_rules
from mfqat.qat.config_checks import (AFFINE_NAMES, _check_mx_format, _check_mx_formats, _check_observer, _check_qat_formats,
                            _check_regexes, _check_type, _fail, _matches, _patterns)
from mfqat.qat.schedules import SCHEDULES, JointSchedule, Schedule, make_schedule

DEFAULT_TARGETS = DECODER_BLOCK  # every Linear inside a decoder block (mfqat.models.layout)
CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"  # the YAML recipes shipped in the package


def shipped_configs() -> List[str]:
    """Names of the YAML recipes shipped with mfqat (``mxint_joint``, ``mxint_468_cyclic``, ...)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


def resolve_config(name_or_path: Union[str, Path]) -> Path:
    """The YAML file of ``--qat-config``: an existing path, else the bare name of a shipped recipe
    (``mxint_joint`` or ``mxint_joint.yaml``); FileNotFoundError listing the shipped ones otherwise."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.parent == Path("."):
        shipped = CONFIGS_DIR / (path.name if path.suffix in (".yaml", ".yml") else f"{path.name}.yaml")
        if shipped.is_file():
            return shipped
    raise FileNotFoundError(f"QAT config '{name_or_path}': no such file, and not a shipped recipe; "
                            f"shipped: {', '.join(shipped_configs())} (in {CONFIGS_DIR})")


@dataclass
class QATConfig:
    """MF-QAT configuration.

    Attributes:
        formats: the formats the schedule visits. Default: mxint8, mxint6, mxint4 on the joint
            schedule (the best measured recipe, configs/mxint_joint.yaml); the MF-QAT paper's
            progressive mxint2 -> 4 -> 6 -> 8 is configs/mxint_2468.yaml.
        schedule: joint | progressive | cyclic | random | fixed. ``joint`` trains several formats
            in every optimizer step: loss = sum_f w_f * L_f / sum_f w_f over the step's formats
            (all, or the sandwich of ``joint_sample``), one backward per format so peak memory
            stays that of one pass.
        block_size: MX block size along in_features.
        targets: regex (or list of regexes) on module names; default: every Linear in the
            decoder blocks. Add ``lm_head`` to quantize the output projection too.
        exclude: regex (or list) of names never quantized.
        quantize_embeddings: also fake-quantize nn.Embedding weights (blocks along hidden).
        quantize_activations / activation_format: MX fake-quant of Linear inputs (reduction axis).
        activation_observer: None (default) | "window_minmax": static fake quant of each Linear's
            input x to symmetric int8 per input channel c from the range seen over the last
            ``observer_window`` training forwards: a_c = max_window max(-min_c, max_c),
            q = round_half_even(clamp(x, -a_c, a_c) / (a_c / 127)) * (a_c / 127); clipped
            elements get no gradient; ``mfqat.clip_rates(model)`` gives each layer's clip rate
            (mfqat/qat/observers.py). Applied while a weight format is active, as activation_format;
            exclusive with quantize_activations. The window is not in the state_dict.
        observer_window: the window length in training forwards (joint: one per format).
        scale_rule: floor (OCP) or ceil: how an MX block's shared exponent is chosen, floor =
            floor(log2 amax) - emax (the block maximum may saturate), ceil = the smallest exponent at
            which nothing saturates. With floor (the default) each format takes its measured default
            (mfqat.quant.scale_rules.DEFAULT_SCALE_RULE, floor where none is listed); ceil applies ceil
            to every format.
        scale_rules: {format: floor | ceil | search} overriding the rule per format (both roundings
            of train-through-anchor follow it; the anchor records it and Slice-and-Scale on load uses
            it). ``search`` (mxint6..mxint3 through an MXINT8 anchor, mxfp6/mxfp4 through an
            MXFP8 E4M3 anchor): each block's exponent
            e_b = argmin_{e in s0-1, s0, s0+1} sum_j I_j (A_j - qdq_e(A)_j)^2 over the anchor's
            values A, with I_j = mean x_j^2, the Linear's squared input per column averaged over
            the training forwards in the anchor format; ``save_anchor`` stores I, so load and
            export lower exactly as training did (mfqat.quant.scale_search).
        seed: for the random schedule.
        repeats: ramps of the progressive schedule.
        layer_formats: {regex: [formats]} per-layer format sets (same schedule kind).
        mask_saturated: zero the STE gradient of saturated elements.
        loss_weights: {format: w_f} for the joint objective (missing formats weigh 1.0).
        joint_sample: None = every format each step; k = the highest + the lowest + k others
            drawn per step (seeded, identical on every rank).
        distill_weight: alpha in L_f = (1 - alpha) * CE_f + alpha * KL(p_anchor || p_f) for every
            joint format below the highest; the teacher is the same step's highest-format branch
            (its logits, detached: no extra forward).
        anchor_format: the anchor that deployment slices from; default mxint8 for an MXINT format
            set, mxfp8_e4m3 for MXFP.
        through_anchor: the forward of format f uses exactly what Slice-and-Scale of the anchor
            gives, W_f = dequantize(slice_and_scale(quantize(W, anchor_format), f)) (equal, by the
            Slice-and-Scale contract, to qdq_f(qdq_anchor(W))), straight-through gradient.
            Default: on for MF-QAT, off for ``fixed`` (the dedicated single-format baseline).
        anchor_warmup_steps: the first N optimizer steps train the anchor format only.
        affine_group_size: group of the derived affine formats (``affine2``..``affine8`` in
            ``formats``): MLX's own layout, a bfloat16 scale and bias per group, derived from the
            anchor as W_k = dequantize(mx.quantize(bf16(qdq_anchor(W)), group, k)) (mfqat.quant.derive);
            64 is mlx_lm.convert's default (4.5 bits/weight at k = 4).
        learn_scales: also train each affine width's bfloat16 scale and bias per group with the weights
            (LSQ-style; mfqat/qat/learned_scales.py): with (a, c) per group, 0 at the start, and the
            derived codes q, scale s0 and bias b0 of qdq_anchor(W),
            W_k = q * bf16(s0 (1 + a)) + bf16(b0 + s0 c), gradients straight through the roundings.
            save_anchor stores the learned values as the anchor's widths (format version 4), so
            load_anchor / export-mlx reproduce W_k bit for bit. Needs an affine format in ``formats``
            and training through the anchor.
        learned_scales_lr: the learning rate of those (a, c) (their own optimizer group, no weight
            decay; ``mfqat.qat.learned_scales.param_groups``): relative steps of the scale, so ~1e-3 whatever the model's lr.
        keep_quantized_weights: keep each Linear's fake-quantized weight from the forward for its
            backward instead of recomputing it there (same gradients, bit for bit). Trade: one extra
            weight copy per Linear in flight (per joint format pass, one copy of the quantized weights
            until that pass's backward; in the output's dtype, bf16 under bf16 autocast) against one
            fewer fake-quant per weight per format. Default off: a step keeps plain training's memory.
            Fused MoE experts and mask_saturated already keep it (their autograd saves it).
        train_vision: a vision-language release's vision tower (the model family's ``towers``, e.g.
            Qwen3.5's ``model.visual``): False (default) leaves it as it is, frozen (``requires_grad``
            off) and in full precision; True makes its targeted Linears MF-QAT layers, trained and stored
            quantized in the anchor like the language model's.
    """

    formats: List[str] = field(default_factory=lambda: ["mxint8", "mxint6", "mxint4"])
    schedule: str = "joint"
    block_size: int = 32
    targets: Union[str, List[str]] = DEFAULT_TARGETS
    exclude: Union[str, List[str], None] = None
    quantize_embeddings: bool = False
    quantize_activations: bool = False
    activation_format: Optional[str] = None
    activation_observer: Optional[str] = None
    observer_window: int = 64
    scale_rule: str = "floor"
    scale_rules: Dict[str, str] = field(default_factory=dict)
    seed: int = 0
    repeats: int = 1
    layer_formats: Dict[str, List[str]] = field(default_factory=dict)
    mask_saturated: bool = False
    loss_weights: Dict[str, float] = field(default_factory=dict)
    joint_sample: Optional[int] = None
    distill_weight: float = 0.0
    anchor_format: Optional[str] = None
    through_anchor: Optional[bool] = None
    anchor_warmup_steps: int = 0
    affine_group_size: int = DERIVED_GROUP_SIZE
    learn_scales: bool = False
    learned_scales_lr: float = 1e-3
    keep_quantized_weights: bool = False
    train_vision: bool = False

    def __post_init__(self) -> None:
        self.validate()
        self.formats = [canonical_name(f) for f in self.formats]
        self._init_joint_fields()
        if self.quantize_activations and not self.activation_format:
            self.activation_format = "mxfp8_e4m3"
        self.layer_formats = {k: [canonical_name(f) for f in v] for k, v in self.layer_formats.items()}
        self.make_schedule()  # validates the formats early

    def _init_joint_fields(self) -> None:
        """Resolve and check the joint / through-anchor fields (defaults depend on the formats)."""
        self.loss_weights = {canonical_name(k): float(v) for k, v in self.loss_weights.items()}
        for k, v in self.loss_weights.items():
            if k not in self.formats or not v >= 0:
                raise ValueError(f"QATConfig.loss_weights: '{k}': {v} must be a weight >= 0 of one of {self.formats}")
        if not 0.0 <= float(self.distill_weight) <= 1.0:
            raise ValueError(f"QATConfig.distill_weight must be in [0, 1], got {self.distill_weight}")
        if int(self.anchor_warmup_steps) < 0:
            raise ValueError(f"QATConfig.anchor_warmup_steps must be >= 0, got {self.anchor_warmup_steps}")
        if self.schedule == "joint" and self.layer_formats:
            raise ValueError("QATConfig: schedule 'joint' takes one global format set; layer_formats is not supported with it")
        families = {get_format(f).family for f in self.formats} - {"affine", "nvfp4"}  # the derived ones
        per_layer = {get_format(f).family for v in self.layer_formats.values() for f in v} - {"affine", "nvfp4"}
        if per_layer and len(families | per_layer) > 1:  # no anchor holds two families (issue 33)
            raise ValueError(f"QATConfig.layer_formats: mixes the {' and '.join(sorted(families | per_layer))} "
                             "families across layers; an anchor holds one family (Slice-and-Scale stays inside one), "
                             "so this recipe could be trained but never anchored: train one family")
        if self.anchor_format is None and len(families) <= 1:  # only derived formats: MXINT8 (nvfp4: MXFP8)
            nv = any(get_format(f).family == "nvfp4" for f in self.formats)
            self.anchor_format = "mxfp8_e4m3" if families == {"mxfp"} or (nv and not families) else "mxint8"
        if self.anchor_format is not None:
            self.anchor_format = canonical_name(self.anchor_format)
        if self.through_anchor is None:
            self.through_anchor = self.schedule != "fixed" and self.anchor_format is not None
        if self.through_anchor:
            if self.anchor_format is None:
                raise ValueError(f"QATConfig.through_anchor needs one format family, got {self.formats}; "
                                 f"set through_anchor: false or anchor_format")
            for f in self.formats + [f for v in self.layer_formats.values() for f in v]:
                check_reachable(self.anchor_format, f, name=f"QATConfig.formats ({f})")
        self._check_learn_scales()
        searched = sorted(f for f, r in self.scale_rules.items() if r == SEARCH_RULE)
        if searched and self.mask_saturated:
            raise ValueError(f"QATConfig.scale_rules: 'search' for {searched} has a plain straight-through "
                             "gradient; mask_saturated is not supported with it (set mask_saturated: false)")
        if searched and not (self.through_anchor and self.anchor_format in SEARCH_ANCHORS
                             and all(get_format(f).family == get_format(self.anchor_format).family for f in searched)):
            raise ValueError(f"QATConfig.scale_rules: 'search' for {searched} needs training through an 8-bit anchor "
                             f"of their family ({' or '.join(SEARCH_ANCHORS)}, through_anchor true); got "
                             f"anchor_format {self.anchor_format}, through_anchor {self.through_anchor}")

    def _check_learn_scales(self) -> None:
        """learn_scales trains affine widths through the anchor (their codes come from qdq_anchor(W))."""
        if not self.learn_scales:
            return
        if not self.affine_formats():
            raise ValueError(f"QATConfig.learn_scales: the formats {self.formats} hold no affine width "
                             "(affine2..affine8) whose scales could be learned; add one (e.g. formats: [mxint8, "
                             "affine4]) or set learn_scales: false")
        if not self.through_anchor:
            raise ValueError("QATConfig.learn_scales needs through_anchor (the learned scales act on the anchor's "
                             "derived codes, as load_anchor and export-mlx derive them); set through_anchor: true")

    def affine_formats(self) -> List[str]:
        """The affine widths the config trains (``formats`` and ``layer_formats``), each once."""
        seen: List[str] = []
        for f in self.formats + [f for v in self.layer_formats.values() for f in v]:
            if get_format(f).family == "affine" and f not in seen:
                seen.append(f)
        return seen

    def group_multiple(self) -> int:
        """What a layer's width must be a multiple of: the MX block size, and the group of each derived
        format trained (the affine group size; 16 for nvfp4)."""
        m = self.block_size
        families = {get_format(f).family for f in self.formats}
        for group in ([self.affine_group_size] if "affine" in families else []) + ([16] if "nvfp4" in families else []):
            m = m * group // math.gcd(m, group)
        return m

    def weight_of(self, fmt: str) -> float:
        """The joint-loss weight of ``fmt`` (1.0 unless ``loss_weights`` says otherwise)."""
        return self.loss_weights.get(fmt, 1.0)

    def layer_format_at(self, schedule: Schedule, step: int, total_steps: int) -> str:
        """One layer's format at ``step``: the anchor format during ``anchor_warmup_steps``, else
        its schedule's (shared by the PyTorch and MLX controllers)."""
        if step < self.anchor_warmup_steps and self.anchor_format is not None:
            return self.anchor_format
        return schedule.format_at(step, total_steps)

    def step_formats(self, step: int, total_steps: int) -> List[str]:
        """The formats one optimizer step trains, highest first: the anchor format alone during
        ``anchor_warmup_steps``, the joint schedule's set, else the one scheduled format."""
        if step < self.anchor_warmup_steps and self.anchor_format is not None:
            return [self.anchor_format]
        sched = self.make_schedule()
        if isinstance(sched, JointSchedule):
            return sched.formats_at(step)
        return [sched.format_at(step, total_steps)]

    def validate(self) -> None:
        """Check every field's type and value; raise TypeError / ValueError naming the field.

        Called by ``__post_init__`` before the fields are normalised, so bad values fail at
        construction instead of inside prepare() or at the first forward. New fields: add a check here.
        """
        _check_type("block_size", self.block_size, (int,), "an int")
        if self.block_size not in MX_BLOCK_SIZES:
            _fail("block_size", f"{self.block_size} is not an MX block size; choose one of {list(MX_BLOCK_SIZES)}")
        _check_qat_formats("formats", self.formats, self.block_size)
        _check_type("affine_group_size", self.affine_group_size, (int,), "an int")
        if self.affine_group_size not in AFFINE_GROUP_SIZES:
            _fail("affine_group_size", f"{self.affine_group_size} is not an MLX group size; choose one of "
                                       f"{list(AFFINE_GROUP_SIZES)}")
        _check_type("schedule", self.schedule, (str,), "a schedule name")
        if self.schedule not in SCHEDULES:
            _fail("schedule", f"unknown schedule '{self.schedule}'; choose one of {SCHEDULES}")
        if self.schedule == "fixed" and len(self.formats) != 1:
            _fail("formats", f"the fixed schedule takes exactly one format, got {list(self.formats)}")
        _check_regexes("targets", self.targets)
        _check_regexes("exclude", self.exclude, optional=True)
        for flag in ("quantize_embeddings", "quantize_activations", "mask_saturated", "keep_quantized_weights"):
            _check_type(flag, getattr(self, flag), (bool,), "true or false")
        if self.activation_format is not None:
            _check_mx_format("activation_format", self.activation_format, self.block_size)
        _check_observer(self.activation_observer, self.observer_window, self.quantize_activations)
        _check_type("scale_rule", self.scale_rule, (str,), "a scale rule name")
        if self.scale_rule not in SCALE_RULES:
            _fail("scale_rule", f"unknown scale rule '{self.scale_rule}'; choose one of {SCALE_RULES}")
        try:
            self.scale_rules = check_scale_rules(self.scale_rules)
        except ValueError as e:
            _fail("scale_rules", str(e).removeprefix("scale_rules: "))
        _check_type("seed", self.seed, (int,), "an int")
        _check_type("repeats", self.repeats, (int,), "an int")
        if self.repeats < 1:
            _fail("repeats", f"must be >= 1, got {self.repeats}")
        _check_type("layer_formats", self.layer_formats, (dict,), "a mapping {regex: [formats]}")
        for pattern, fmts in self.layer_formats.items():
            _check_regexes("layer_formats", pattern)
            _check_mx_formats(f"layer_formats[{pattern!r}]", fmts, self.block_size)
        _check_type("loss_weights", self.loss_weights, (dict,), "a mapping {format: weight}")
        if self.joint_sample is not None:
            _check_type("joint_sample", self.joint_sample, (int,), "an int or null")
        _check_type("distill_weight", self.distill_weight, (int, float), "a number in [0, 1]")
        if self.through_anchor is not None:
            _check_type("through_anchor", self.through_anchor, (bool,), "true, false or null")
        _check_type("anchor_warmup_steps", self.anchor_warmup_steps, (int,), "an int")
        _check_type("learn_scales", self.learn_scales, (bool,), "true or false")
        _check_type("train_vision", self.train_vision, (bool,), "true or false")
        _check_type("learned_scales_lr", self.learned_scales_lr, (int, float), "a positive number")
        if not self.learned_scales_lr > 0:
            _fail("learned_scales_lr", f"must be positive, got {self.learned_scales_lr}")
        if self.anchor_format is not None:
            _check_mx_format("anchor_format", self.anchor_format, self.block_size)

    def excludes(self, name: str) -> bool:
        """True when the module ``name`` matches ``exclude``."""
        return _matches(name, _patterns(self.exclude))

    def selects(self, name: str) -> bool:
        """True when the module ``name`` is targeted and not excluded (shared by PyTorch and MLX)."""
        return _matches(name, _patterns(self.targets)) and not self.excludes(name)

    def schedule_for(self, name: str) -> Schedule:
        """The schedule of module ``name``: its ``layer_formats`` entry if one matches, else the global one."""
        fmts = next((v for k, v in self.layer_formats.items() if re.search(k, name)), None)
        return self.make_schedule(fmts)

    def make_schedule(self, formats: Optional[List[str]] = None) -> Schedule:
        """The schedule object for the global (or a per-layer) format list."""
        return make_schedule(self.schedule, formats or self.formats, self.seed, self.repeats, self.joint_sample)

    @classmethod
    def read_yaml(cls, path: Union[str, Path]) -> dict:
        """The QATConfig fields of a YAML file, or of a shipped recipe named by its bare name
        (:func:`resolve_config`), as a dict (unknown keys are an error)."""
        file = resolve_config(path)
        try:  # safe_load: a python tag (!!python/object/apply, ...) is an error, never run
            data = yaml.safe_load(file.read_bytes().decode("utf-8")) or {}
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a YAML QATConfig file (not UTF-8 text)") from None
        except yaml.YAMLError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: not a YAML QATConfig file mfqat reads ({first}; only plain YAML: no "
                             "python tags)") from None
        if isinstance(data, dict) and "qat" in data:
            data = data["qat"]
        if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
            raise ValueError(f"{path}: expected a YAML mapping of QATConfig fields (e.g. formats: [mxint8, mxint4]), "
                             f"got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown QATConfig keys {sorted(unknown)}; known: {sorted(known)}")
        return data

    @classmethod
    def from_yaml(cls, path: Union[str, Path], **overrides) -> "QATConfig":
        """Load a config file, then apply ``overrides`` (fields left to defaults are derived after)."""
        return cls(**{**cls.read_yaml(path), **overrides})

    def to_dict(self) -> dict:
        """Plain dict (for mfqat.json and logs)."""
        return dataclasses.asdict(self)
