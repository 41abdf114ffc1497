"""Qwen3-MoE: Qwen3 attention, a top-k router (``mlp.gate``, not an nn.Linear) and fused experts
``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``.

Experts are trained and quantized per expert along H (gate_up) and I (down), and exported as mlx-lm's
``mlp.switch_mlp.{gate,up,down}_proj`` code for code. The router stays in bfloat16 (mlx-lm's own
quant_predicate keeps it at 8 bits; it is E x H values a layer). mlx-lm reads ``num_experts``, which
transformers 5 writes as ``num_local_experts``."""
from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family

# AWQ on the attention only: the router and experts share post_attention_layernorm, and scaling the
# experts' fused inputs is not done yet.
AWQ = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
       ("self_attn.v_proj", ("self_attn.o_proj",)))


def _num_experts(cfg: dict) -> dict:
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    return cfg


FAMILY = Family(name="qwen3_moe", model_types=("qwen3_moe",), experts=FUSED_EXPERTS, keep_high=(ROUTER,), awq_groups=AWQ,
                config_fixes=(_num_experts,), tested=True)
