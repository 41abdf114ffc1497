"""GLM-4-MoE: Qwen3-style attention (optional q/k norms, partial rotary), a first dense layer, then
MoE layers with a sigmoid router (``mlp.gate.weight`` and its ``e_score_correction_bias``), fused routed
experts and plain shared experts (``mlp.shared_experts.*``, ordinary Linears).

The routed experts are trained and exported as mlx-lm's ``mlp.switch_mlp`` code for code, the router
stays in bfloat16 and its correction bias in float32 (mlx-lm's cast_predicate). mlx-lm requires
``rope_scaling`` (no default) and ``partial_rotary_factor``, which transformers 5 nests in
``rope_parameters``."""
from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family


def _glm4_moe_config(cfg: dict) -> dict:
    cfg.setdefault("rope_scaling", None)
    cfg.setdefault("partial_rotary_factor", (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5))
    return cfg


FAMILY = Family(name="glm4_moe", model_types=("glm4_moe",), experts=FUSED_EXPERTS, keep_high=(ROUTER,),
                keep_float32=(r"e_score_correction_bias$",), config_fixes=(_glm4_moe_config,), tested=True,
                awq_groups=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),))
