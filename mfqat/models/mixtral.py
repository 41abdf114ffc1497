"""Mixtral: Mistral attention, a top-k router and fused experts, held by transformers 5 under
``mlp.*`` (``mlp.gate``, ``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) where
checkpoints and mlx-lm say ``block_sparse_moe``.

Experts are trained and quantized per expert and exported as mlx-lm's
``block_sparse_moe.switch_mlp.{gate,up,down}_proj`` code for code; the router stays in bfloat16."""
from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family

FAMILY = Family(name="mixtral", model_types=("mixtral",), experts=FUSED_EXPERTS, keep_high=(ROUTER,),
                mlx_renames=((r"\.mlp\.", ".block_sparse_moe."),), tested=True)
