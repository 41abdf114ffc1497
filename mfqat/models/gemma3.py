"""Gemma 3 (text): Llama's names, ``(1 + w)`` RMSNorms, sliding and full attention layers.

AWQ folds into the ``(1 + w)`` norms as ``w' = (1 + w) / s - 1``: input_layernorm -> q/k/v and
pre_feedforward_layernorm -> gate/up (post_attention_layernorm and post_feedforward_layernorm
normalise the outputs of o_proj and down_proj and feed no Linear).

mlx-lm's gemma3_text reads ``rope_theta`` (global layers), ``rope_local_base_freq`` (sliding layers)
and ``sliding_window_pattern``, where transformers 5 writes ``rope_parameters`` per layer type and
``layer_types``; without them it uses defaults that can index past the model's layers."""
from mfqat.models.family import Family


def _gemma3_config(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    if "rope_theta" in full:
        cfg["rope_theta"] = full["rope_theta"]
    if "rope_theta" in local:
        cfg["rope_local_base_freq"] = local["rope_theta"]
    types = cfg.get("layer_types") or []
    if "full_attention" in types:
        cfg["sliding_window_pattern"] = types.index("full_attention") + 1
    return cfg


FAMILY = Family(name="gemma3", model_types=("gemma3_text",), config_fixes=(_gemma3_config,), tested=True,
                norm_offset=1.0,
                awq_groups=(("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            ("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
                            ("mlp.up_proj", ("mlp.down_proj",)), ("self_attn.v_proj", ("self_attn.o_proj",))))
