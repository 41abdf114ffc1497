"""What mfqat must know about a model family, in one dataclass; one file per family fills it in.

A :class:`Family` answers, for every parameter name of the in-memory transformers model:

- is it a quantization target? ``nn.Linear`` weights in the decoder blocks always are (as today);
  fused 3-D expert parameters are when the family lists them (:class:`ExpertParam`);
- does it stay in high precision, and why (routers, gates: ``keep_high``)?
- what is it called in mlx-lm (``mlx_renames``, and an expert parameter's split into
  ``switch_mlp`` projections), and which config keys must mlx-lm be given (``mlx_config``)?
- is it part of a tower besides the language model (``towers``: the vision encoder of a
  vision-language release)? Towers are frozen and kept in full precision by training unless
  ``QATConfig.train_vision``, stored whole in the anchor, and left out of an mlx-lm export (mlx-lm's
  model is the text model), with the reason in the export's report;
- which transformers Auto class builds the whole checkpoint (``hf_auto_class``: a vision-language
  release is an ``AutoModelForImageTextToText``; ``AutoModelForCausalLM`` would drop its vision tower).

Expert layout (transformers 5): ``gate_up_proj`` is ``[E, 2I, H]`` (gate rows first, then up) and
``down_proj`` ``[E, H, I]``: out x in per expert, in_features last, so MX blocks along the last axis
are the blocks of each expert's Linear, and splitting rows keeps every code. mlx-lm's
``switch_mlp.{gate,up,down}_proj`` hold ``[E, out, in]`` too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExpertParam:
    """A fused 3-D expert parameter that is a quantization target.

    ``hf`` ends the parameter's full name (``...mlp.experts.gate_up_proj``); ``mlx`` gives the mlx-lm
    weight names that replace that ending, the rows (axis -2) split equally among them in order
    (gate_up -> gate, up)."""

    hf: str
    mlx: Tuple[str, ...]

    @property
    def pattern(self) -> str:
        return re.escape(self.hf) + "$"


@dataclass(frozen=True)
class PlainRule:
    """A plain (unquantized) tensor that mlx-lm stores in another form than transformers, when its own
    ``sanitize`` would not convert it (Qwen3-Next's sanitize converts only checkpoints with per-expert
    names). ``to_mlx`` maps the float32 transformers value to what is written (before the bfloat16
    cast); ``to_hf`` maps a written value back, so the export check's PyTorch reference runs on exactly
    the written numbers: ``to_hf(bf16(to_mlx(w)))``."""

    pattern: str
    to_mlx: Callable[["torch.Tensor"], "torch.Tensor"]
    to_hf: Callable[["torch.Tensor"], "torch.Tensor"]
    why: str


ROLES = ("attention_inputs", "attention_outputs", "mlp_inputs", "mlp_outputs")


def _endings(names: Tuple[str, ...]) -> str:
    """A regex matching a name holding one of the module-name endings ``names`` (``.q_proj.weight``)."""
    return r"\.(" + "|".join(re.escape(n) for n in names) + r")(\.|$)"


def _copy_rope(cfg: dict) -> dict:
    """transformers 5 keeps rope settings in ``rope_parameters``; mlx-lm reads top-level keys."""
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
    if isinstance(rope, dict) and "partial_rotary_factor" in rope:
        cfg.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
        cfg["rope_scaling"] = dict(rope)
    return cfg


def full_attention_interval(cfg: dict) -> dict:
    """mlx-lm builds hybrid (linear + full attention) stacks from ``full_attention_interval``; transformers
    5 writes ``layer_types``. A pattern that is not one full-attention layer every N is refused."""
    types = cfg.get("layer_types") or []
    if "full_attention" in types:
        every = types.index("full_attention") + 1
        want = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(len(types))]
        if types != want:
            raise ValueError(f"{cfg['model_type']}: mlx-lm builds the layers from full_attention_interval; this model's "
                             f"layer_types {types} are not one full-attention layer every {every}")
        cfg["full_attention_interval"] = every
    return cfg


@dataclass(frozen=True)
class Family:
    """One model family's rules (see the module docstring). ``tested``: a test runs this family end to
    end (prepare -> train -> anchor -> slice -> MLX export -> mlx_lm.load); the README's support table
    lists only what a test runs."""

    name: str
    model_types: Tuple[str, ...]
    experts: Tuple[ExpertParam, ...] = ()
    keep_high: Tuple[Tuple[str, str], ...] = ()  # (regex on the weight name, why it stays high precision)
    mlx_renames: Tuple[Tuple[str, str], ...] = ()  # (regex, replacement) on every tensor name, in order
    hf_renames: Tuple[Tuple[str, str], ...] = ()  # the inverse of mlx_renames (MLX names back to transformers')
    plain_rules: Tuple[PlainRule, ...] = ()  # plain tensors written in mlx-lm's runtime form (norm + 1, conv axes)
    keep_float32: Tuple[str, ...] = ()  # regexes of plain tensors written in float32, not bfloat16 (mlx-lm's cast_predicate)
    config_fixes: Tuple[Callable[[dict], dict], ...] = ()  # extra mlx-lm config rewrites after the rope ones
    caveats: Optional[Callable[[dict], List[str]]] = None  # config -> what mlx-lm's port computes differently
    export_refusal: Optional[str] = None  # why mlx-lm cannot load this family (export refused before writing)
    mlx_anchor_refusal: Optional[str] = None  # why an MLX model of this family cannot be written back as an anchor
    # AWQ: (producer, consumers) module names inside a decoder layer. The consumers' input channels are
    # scaled up by s and the producer's outputs down by s; a norm computing x * (norm_offset + w) folds
    # 1/s as w' = (norm_offset + w) / s - norm_offset. Empty: AWQ is refused for the family, with why.
    awq_groups: Tuple[Tuple[str, Tuple[str, ...]], ...] = ()
    norm_offset: float = 0.0
    awq_refusal: str = "mfqat has no AWQ norm -> linear groups for it"
    towers: Tuple[Tuple[str, str], ...] = ()  # (regex on names, why): non-language parts (vision tower), see above
    # The ``seed`` recipe's table for this family (name, base bits, tied -> bits, None: bfloat16) instead of the
    # generic one, and the kept-high tensors (regexes: routers) that table quantizes after all.
    seed_table: Optional[Callable[[str, int, bool], Optional[int]]] = None
    seed_high: Tuple[str, ...] = ()
    gguf_arch: str = ""  # gguf-py's architecture name when it is not the model_type (imatrix GGUF names)
    gguf_renames: Tuple[Tuple[str, str], ...] = ()  # module names as gguf-py's tensor-name map knows them
    hf_auto_class: str = "AutoModelForCausalLM"  # transformers Auto class that builds the whole checkpoint
    # Roles of a decoder block's projections, by the endings of their module names (Llama's unless a family
    # says otherwise): what the export recipes give more or fewer bits, and what LoRA adapts by default.
    attention_inputs: Tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    attention_outputs: Tuple[str, ...] = ("o_proj",)
    mlp_inputs: Tuple[str, ...] = ("gate_proj", "up_proj")
    mlp_outputs: Tuple[str, ...] = ("down_proj",)
    tested: bool = False
    notes: str = ""

    def has_role(self, name: str, role: str) -> bool:
        """Whether the tensor or module ``name`` is one of the family's ``role`` projections (:data:`ROLES`:
        ``attention_inputs``, ``attention_outputs``, ``mlp_inputs``, ``mlp_outputs``): a module name ending,
        followed by ``.`` (``.weight``) or the end (a fused expert parameter)."""
        if role not in ROLES:
            raise ValueError(f"unknown projection role {role!r}; choose one of {', '.join(ROLES)}")
        names = getattr(self, role)
        return bool(names) and bool(re.search(_endings(names), name))

    @property
    def lora_targets(self) -> Tuple[str, ...]:
        """The module names LoRA adapts in a decoder block of this family: its attention and MLP projections
        (what peft's ``all-linear`` finds there; Llama: q/k/v/o/gate/up/down)."""
        names = self.attention_inputs + self.attention_outputs + self.mlp_inputs + self.mlp_outputs
        return tuple(dict.fromkeys(n.rsplit(".", 1)[-1] for n in names))

    def tower(self, name: str) -> Optional[str]:
        """Why the tensor or module ``name`` belongs to a tower that is not the language model (the vision
        encoder: frozen, full precision, dropped on an mlx-lm export), or None."""
        return next((why for pat, why in self.towers if re.search(pat, name)), None)

    def seed_quantizes(self, name: str) -> bool:
        """Whether the family's ``seed`` table quantizes the weight ``name`` although it is kept high elsewhere
        (``seed_high``: Qwen3.5's routers and shared-expert gates at 8 bits, as mlx-lm's quant_predicate)."""
        return any(re.search(p, name) for p in self.seed_high)

    def expert_param(self, name: str) -> Optional[ExpertParam]:
        """The expert rule matching the parameter ``name``, or None."""
        return next((e for e in self.experts if re.search(e.pattern, name)), None)

    def kept_high(self, name: str) -> Optional[str]:
        """Why the weight ``name`` stays in high precision (router, gate, ...), or None."""
        return next((why for pat, why in self.keep_high if re.search(pat, name)), None)

    def mlx_pieces(self, name: str, rows: int) -> List[Tuple[str, int, int]]:
        """[(mlx-lm weight name, first row, end row)] of the tensor ``name`` with ``rows`` rows on axis -2:
        one piece (all rows) for an ordinary tensor, equal row blocks for a split expert parameter."""
        rule = self.expert_param(name)
        if rule is None:
            return [(self.mlx_name(name), 0, rows)]
        if rows % len(rule.mlx):
            raise ValueError(f"{name}: {rows} rows do not split into {len(rule.mlx)} equal parts "
                             f"({', '.join(rule.mlx)})")
        step = rows // len(rule.mlx)
        return [(self.mlx_name(re.sub(rule.pattern, piece, name)), i * step, (i + 1) * step)
                for i, piece in enumerate(rule.mlx)]

    def float32_on_export(self, name: str) -> bool:
        """Whether the plain tensor ``name`` is written in float32 (a routing bias), not bfloat16."""
        return any(re.search(p, name) for p in self.keep_float32)

    def plain_rule(self, name: str) -> Optional[PlainRule]:
        """The rule converting the plain tensor ``name`` for mlx-lm, or None (written as it is)."""
        return next((r for r in self.plain_rules if re.search(r.pattern, name)), None)

    def mlx_value(self, name: str, value: "torch.Tensor") -> "torch.Tensor":
        """The plain tensor ``name`` (float32) in the form mlx-lm runs it (unchanged without a rule)."""
        rule = self.plain_rule(name)
        return value if rule is None else rule.to_mlx(value)

    def hf_value(self, name: str, value: "torch.Tensor") -> "torch.Tensor":
        """The inverse of :meth:`mlx_value`: a written value back in transformers' form."""
        rule = self.plain_rule(name)
        return value if rule is None else rule.to_hf(value)

    def mlx_name(self, name: str) -> str:
        """``name`` as mlx-lm calls it (before its own sanitize)."""
        for pat, repl in self.mlx_renames:
            name = re.sub(pat, repl, name)
        return name

    def hf_name(self, mlx_name: str) -> str:
        """A transformers (in-memory) name for an mlx-lm weight name: a ``switch_mlp`` piece gives its fused
        expert parameter (:meth:`hf_state_dict` joins the pieces)."""
        for pat, repl in self.hf_renames:
            mlx_name = re.sub(pat, repl, mlx_name)
        for rule in self.experts:
            for piece in rule.mlx:
                if mlx_name.endswith(piece):
                    return mlx_name[: -len(piece)] + rule.hf
        return mlx_name

    def hf_state_dict(self, weights: Dict[str, "torch.Tensor"]) -> Dict[str, "torch.Tensor"]:
        """An MLX model's weights under transformers' names, ``switch_mlp`` pieces joined back into the
        fused expert parameters (rows in the order of ``ExpertParam.mlx``)."""
        import torch

        out: Dict[str, "torch.Tensor"] = {}
        parts: Dict[str, Dict[int, "torch.Tensor"]] = {}
        for name, value in weights.items():
            hf = self.hf_name(name)
            rule = self.expert_param(hf)
            if rule is None or hf == name:
                out[hf] = value
                continue
            index = next(i for i, piece in enumerate(rule.mlx) if name.endswith(piece))
            parts.setdefault(hf, {})[index] = value
        for hf, pieces in parts.items():
            rule = self.expert_param(hf)
            if sorted(pieces) != list(range(len(rule.mlx))):
                raise ValueError(f"{hf}: the MLX weights hold {len(pieces)} of its {len(rule.mlx)} pieces {rule.mlx}")
            out[hf] = torch.cat([pieces[i] for i in range(len(rule.mlx))], dim=-2)
        return out

    def gguf_module(self, name: str) -> str:
        """The module ``name`` as gguf-py's tensor-name map knows it (``model.language_model.layers.0.x`` ->
        ``model.layers.0.x`` for a vision-language release)."""
        for pat, repl in self.gguf_renames:
            name = re.sub(pat, repl, name)
        return name

    def export_caveats(self, config: dict) -> List[str]:
        """What mlx-lm's port of this model computes differently from transformers (reported on export)."""
        return list(self.caveats(config)) if self.caveats else []

    def mlx_config(self, config: dict) -> dict:
        """The HF config as mlx-lm reads it: rope keys copied out of ``rope_parameters``, then this
        family's own fixes (a copy; ``config`` is not changed)."""
        cfg = _copy_rope(dict(config))
        for fix in self.config_fixes:
            cfg = fix(cfg)
        return cfg


LLAMA_AWQ = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
)
ROUTER = (r"\.(mlp|block_sparse_moe)\.gate\.weight$", "MoE router: a few values per token choose the experts; kept in bfloat16")
FUSED_EXPERTS = (
    ExpertParam(".experts.gate_up_proj", (".switch_mlp.gate_proj.weight", ".switch_mlp.up_proj.weight")),
    ExpertParam(".experts.down_proj", (".switch_mlp.down_proj.weight",)),
)
