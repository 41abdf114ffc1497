"""Mixtral: Mistral attention, a top-k router and fused experts, held by transformers 5 under
``mlp.*`` (``mlp.gate``, ``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) where
checkpoints and mlx-lm say ``block_sparse_moe``.

Experts are trained and quantized per expert and exported as mlx-lm's
``block_sparse_moe.switch_mlp.{gate,up,down}_proj`` code for code; the router stays in bfloat16."""
from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family

# AWQ on the attention only: the router and experts share post_attention_layernorm, and scaling the
# experts' fused inputs is not done yet.
AWQ = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
       ("self_attn.v_proj", ("self_attn.o_proj",)))

FAMILY = Family(name="mixtral", model_types=("mixtral",), experts=FUSED_EXPERTS, keep_high=(ROUTER,), awq_groups=AWQ,
                mlx_renames=((r"\.mlp\.", ".block_sparse_moe."),), hf_renames=((r"\.block_sparse_moe\.", ".mlp."),),
                tested=True)
