"""Gemma 2: Llama's names, ``(1 + w)`` RMSNorms before and after both the attention and the MLP,
attention and final logit soft-capping, and alternating sliding-window / global attention layers.

AWQ folds into the ``(1 + w)`` norms as ``w' = (1 + w) / s - 1``: input_layernorm -> q/k/v and
pre_feedforward_layernorm -> gate/up (post_attention_layernorm and post_feedforward_layernorm
normalise the outputs of o_proj and down_proj and feed no Linear).

mlx-lm's gemma2 attends to the whole context in every layer (it has no sliding window), so an export
computes what transformers computes only up to ``sliding_window`` tokens. The export says so in its
report and as a warning (:func:`caveats`); the check's 64-token prompt catches a window much shorter
than that (when the difference exceeds the logit tolerance: tested at 8 tokens)."""
from typing import List

from mfqat.models.family import Family


def caveats(cfg: dict) -> List[str]:
    """What an export of this config cannot reproduce in mlx-lm (empty when nothing)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or []
    if window and (not types or "sliding_attention" in types):
        return [f"gemma2: mlx-lm's gemma2 has no sliding window; its outputs equal transformers' only for "
                f"contexts up to sliding_window = {window} tokens"]
    return []


FAMILY = Family(name="gemma2", model_types=("gemma2",), tested=True, norm_offset=1.0, caveats=caveats,
                awq_groups=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                            ("mlp.up_proj", ("mlp.down_proj",)), ("self_attn.v_proj", ("self_attn.o_proj",))))
