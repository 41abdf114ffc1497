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
refused. AWQ groups: input_layernorm -> in_proj_qkv, in_proj_z, in_proj_a, in_proj_b (linear layers; the
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
