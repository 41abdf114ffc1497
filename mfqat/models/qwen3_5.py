"""Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``): hybrid decoders where Gated DeltaNet layers
(``linear_attn``: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``, ``in_proj_b``, ``conv1d``, ``A_log``,
``dt_bias``, ``norm``, ``out_proj``) alternate with gated full attention, ``(1 + w)`` RMSNorms, and for
the MoE variant a router, fused experts, a shared expert and its gate.

Trained and quantized: every Linear of the blocks and the fused experts. Kept high precision:
``in_proj_a`` / ``in_proj_b`` (one value per value head and token: the decay and the write strength),
the router and the shared expert's gate (mlx-lm's own predicate keeps both at 8 bits; here bfloat16),
``A_log`` in float32 (mlx-lm's cast_predicate), the convolution and norms in bfloat16.

For mlx-lm: the model type loses ``_text``, every name is prefixed ``language_model.``, the ``(1 + w)`` norms
are written as ``1 + w`` and conv1d as C x K x 1 (mlx-lm's sanitize would do both in bfloat16 itself, see
:data:`NORMS`), and the layer pattern is given as
``full_attention_interval`` (mlx-lm does not read ``layer_types``); a pattern that is not periodic is
refused.

The releases (``Qwen/Qwen3.5-*``) are vision-language checkpoints: ``model_type`` ``qwen3_5`` /
``qwen3_5_moe`` (``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``), a
``text_config`` and a ``vision_config``, weights under ``model.language_model.*``, ``model.visual.*`` and
``lm_head.*`` (MoE experts per expert on disk, stacked into the fused parameters by transformers on load).
:data:`VL_FAMILY` / :data:`VL_MOE_FAMILY` build the whole model (``AutoModelForImageTextToText``), train the
language model's targets, leave the vision tower frozen in full precision (a tower, unless
``QATConfig.train_vision``) and keep it in the anchor; mlx-lm's ``qwen3_5`` / ``qwen3_5_moe`` read the
text model only, as ``language_model.model.*`` / ``language_model.lm_head`` with ``text_config`` (where
``full_attention_interval`` and ``tie_word_embeddings`` are written), so the export drops the tower, as
``mlx_lm.convert`` does, and says so. AWQ groups: input_layernorm -> in_proj_qkv, in_proj_z, in_proj_a, in_proj_b (linear layers; the
a/b projections read the same normalised input, so they take the scale too) and -> q/k/v
(full layers), post_attention_layernorm -> gate/up (dense), up -> down, v -> o; norms fold as
``w' = (1 + w) / s - 1``."""
import re
from typing import Optional

from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family, PlainRule, full_attention_interval
from mfqat.models.qwen3_next import CONV_AXES

LINEAR_ATTN_GATES = (r"\.linear_attn\.in_proj_[ab]\.weight$",
                     "Gated DeltaNet decay / write-strength projection (one value per head): kept in bfloat16")
SHARED_EXPERT_GATE = (r"\.mlp\.shared_expert_gate\.weight$", "shared-expert gate (one value per token): kept in bfloat16")


def _qwen3_5_config(cfg: dict) -> dict:
    cfg["model_type"] = cfg["model_type"].removesuffix("_text")
    return full_attention_interval(cfg)


CONV = (r"\.linear_attn\.conv1d\.weight$", "Gated DeltaNet depthwise convolution (C x 1 x K): kept in bfloat16")
# input_layernorm feeds all four input projections of a linear-attention layer: all four take the scale.
AWQ = (("input_layernorm", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                            "linear_attn.in_proj_b")),
       ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
       ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
       ("mlp.up_proj", ("mlp.down_proj",)),
       ("self_attn.v_proj", ("self_attn.o_proj",)))
# The design's Qwen3.5 recipe (Unsloth's Dynamic 2.0 rules as ported to MLX), the ``seed`` recipe here:
# base 4 -> down 5, embed 6, lm_head 8, attention 6; base 2 -> down 3, embed 4, lm_head 5, attention 4
# (base 3, interpolated: 4, 5, 6, 5); routers 8 bits; self_attn.o_proj and linear_attn.out_proj bfloat16.
ATTENTION = (r"\.(self_attn\.(q_proj|k_proj|v_proj)|linear_attn\.(in_proj_qkv|in_proj_z))\.weight$")
OUTPUTS = r"\.(self_attn\.o_proj|linear_attn\.out_proj)\.weight$"
ROUTERS = (ROUTER[0], SHARED_EXPERT_GATE[0])


def seed_table(name: str, base: int, tied: bool) -> Optional[int]:
    """Bits of the tensor ``name`` in the design's Qwen3.5 table at ``base`` bits (None: bfloat16); a tied
    embedding is the lm_head's table."""
    lm_head = 8 if base >= 4 else base + 3
    if re.search(OUTPUTS, name):
        return None
    if any(re.search(p, name) for p in ROUTERS):
        return 8
    if "lm_head" in name or ("embed" in name and tied):
        return lm_head
    if "embed" in name:
        return min(base + 2, 8)
    if re.search(ATTENTION, name):
        return min(base + 2, 8)
    if re.search(r"\.down_proj(\.weight)?$", name):
        return min(base + 1, 8)
    return base


# mlx-lm's sanitize adds 1 to these norms in the checkpoint's dtype (bfloat16: 1 + w rounds to 1 for |w| < 2^-9,
# which the export check's float32 reference would not see) whenever conv1d comes in PyTorch's axes. The export
# does both itself: the norms as bfloat16(1 + w), conv1d as C x K x 1, so sanitize leaves them and the check's
# reference holds exactly the written numbers (as for Qwen3-Next).
NORMS = PlainRule(r"(\.input_layernorm|\.post_attention_layernorm|^model\.norm|^model\.language_model\.norm|\.q_norm|"
                  r"\.k_norm)\.weight$", to_mlx=lambda w: w + 1.0, to_hf=lambda w: w - 1.0,
                  why="mlx-lm's RMSNorm multiplies by w; transformers' Qwen3.5 norm by (1 + w)")
COMMON = dict(mlx_renames=((r"^model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head.")),
              keep_float32=(r"\.A_log$",), config_fixes=(_qwen3_5_config,), norm_offset=1.0, awq_groups=AWQ,
              plain_rules=(NORMS, CONV_AXES),
              mlx_anchor_refusal="the MLX model holds 1 + w in its norms and conv1d as C x K x 1",
              seed_table=seed_table, seed_high=ROUTERS, tested=True,
              attention_inputs=("q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z"),
              attention_outputs=("o_proj", "out_proj"))

FAMILY = Family(name="qwen3_5", model_types=("qwen3_5_text",), keep_high=(LINEAR_ATTN_GATES, CONV), gguf_arch="qwen35",
                **COMMON)
MOE_FAMILY = Family(name="qwen3_5_moe", model_types=("qwen3_5_moe_text",), experts=FUSED_EXPERTS,
                    keep_high=(LINEAR_ATTN_GATES, CONV, ROUTER, SHARED_EXPERT_GATE), gguf_arch="qwen35moe", **COMMON)


VISION = (r"^model\.visual(\.|$)", "vision tower (model.visual): mlx-lm's qwen3_5 / qwen3_5_moe are the text model "
          "and drop it, as mlx_lm.convert does; the anchor keeps it (full precision unless QATConfig.train_vision)")


def _vl_config(cfg: dict) -> dict:
    """mlx-lm's qwen3_5 / qwen3_5_moe build the text model from ``text_config`` alone: the layer pattern and
    the tying go there (the top-level ``tie_word_embeddings`` is what transformers ties by)."""
    text = dict(cfg.get("text_config") or {})
    text.setdefault("model_type", f"{cfg['model_type']}_text")
    text = full_attention_interval(text)
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    cfg["text_config"] = text
    return cfg


VL = dict(COMMON, mlx_renames=((r"^model\.language_model\.", "language_model.model."),
                               (r"^lm_head\.", "language_model.lm_head.")),
          hf_renames=((r"^language_model\.model\.", "model.language_model."), (r"^language_model\.lm_head\.", "lm_head.")),
          config_fixes=(_vl_config,), towers=(VISION,), hf_auto_class="AutoModelForImageTextToText",
          gguf_renames=((r"^model\.language_model\.", "model."),))
VL_FAMILY = Family(name="qwen3_5 (vision-language release)", model_types=("qwen3_5",),
                   keep_high=(LINEAR_ATTN_GATES, CONV), gguf_arch="qwen35", **VL)
VL_MOE_FAMILY = Family(name="qwen3_5_moe (vision-language release)", model_types=("qwen3_5_moe",), experts=FUSED_EXPERTS,
                       keep_high=(LINEAR_ATTN_GATES, CONV, ROUTER, SHARED_EXPERT_GATE), gguf_arch="qwen35moe", **VL)
