"""DeepSeek-V3: multi-head latent attention (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``,
``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``), dense first layers, then MoE layers with
a sigmoid router (``mlp.gate.weight``, ``e_score_correction_bias``), fused routed experts and plain
shared experts.

Routed experts are trained and exported as mlx-lm's ``mlp.switch_mlp`` code for code; the router stays
in bfloat16 and its bias in float32. ``kv_b_proj`` stays in bfloat16: mlx-lm's sanitize splits it into
per-head matrices and, when it is quantized, re-quantizes them with its own rule (mx.quantize), which
would not keep mfqat's codes. AWQ: input_layernorm -> q_a_proj / kv_a_proj_with_mqa,
q_a_layernorm -> q_b_proj (kv_a_layernorm normalises only part of kv_a's output: not folded)."""
from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family

KV_B = (r"\.self_attn\.kv_b_proj\.weight$",
        "MLA kv_b_proj: mlx-lm splits it per head and re-quantizes it with its own rule; kept in bfloat16")

# q_proj when q_lora_rank is None, else q_a_proj -> q_b_proj; kv_b_proj stays high but keeps its role.
MLA_INPUTS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")

FAMILY = Family(name="deepseek_v3", model_types=("deepseek_v3",), experts=FUSED_EXPERTS, keep_high=(ROUTER, KV_B),
                keep_float32=(r"e_score_correction_bias$",), tested=True, attention_inputs=MLA_INPUTS,
                mlx_anchor_refusal="mlx-lm splits kv_b_proj into per-head embed_q / unembed_out matrices",
                awq_groups=(("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
                            ("self_attn.q_a_layernorm", ("self_attn.q_b_proj",))))
