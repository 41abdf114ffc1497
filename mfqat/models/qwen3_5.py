"""Qwen3.5 (``qwen3_5_text``, ``qwen3_5_moe_text``): hybrid decoders where Gated DeltaNet layers
(``linear_attn``: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_a``, ``in_proj_b``, ``conv1d``, ``A_log``,
``dt_bias``, ``norm``, ``out_proj``) alternate with gated full attention, ``(1 + w)`` RMSNorms, and for
the MoE variant a router, fused experts, a shared expert and its gate.

Trained and quantized: every Linear of the blocks and the fused experts. Kept high precision:
``in_proj_a`` / ``in_proj_b`` (one value per value head and token: the decay and the write strength),
the router and the shared expert's gate (mlx-lm's own predicate keeps both at 8 bits; here bfloat16),
``A_log`` in float32 (mlx-lm's cast_predicate), the convolution and norms in bfloat16.

For mlx-lm: the model type loses ``_text``, every name is prefixed ``language_model.`` (its sanitize then
moves conv1d's axes and adds 1 to the ``(1 + w)`` norms itself), and the layer pattern is given as
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
from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family, full_attention_interval

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
COMMON = dict(mlx_renames=((r"^model\.", "language_model.model."), (r"^lm_head\.", "language_model.lm_head.")),
              keep_float32=(r"\.A_log$",), config_fixes=(_qwen3_5_config,), norm_offset=1.0, awq_groups=AWQ,
              mlx_anchor_refusal="mlx-lm's sanitize adds 1 to its norms and moves conv1d's axes",
              tested=True)

FAMILY = Family(name="qwen3_5", model_types=("qwen3_5_text",), keep_high=(LINEAR_ATTN_GATES, CONV), **COMMON)
MOE_FAMILY = Family(name="qwen3_5_moe", model_types=("qwen3_5_moe_text",), experts=FUSED_EXPERTS,
                    keep_high=(LINEAR_ATTN_GATES, CONV, ROUTER, SHARED_EXPERT_GATE), **COMMON)


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
          config_fixes=(_vl_config,), towers=(VISION,), hf_auto_class="AutoModelForImageTextToText")
VL_FAMILY = Family(name="qwen3_5 (vision-language release)", model_types=("qwen3_5",),
                   keep_high=(LINEAR_ATTN_GATES, CONV), **VL)
VL_MOE_FAMILY = Family(name="qwen3_5_moe (vision-language release)", model_types=("qwen3_5_moe",), experts=FUSED_EXPERTS,
                       keep_high=(LINEAR_ATTN_GATES, CONV, ROUTER, SHARED_EXPERT_GATE), **VL)
