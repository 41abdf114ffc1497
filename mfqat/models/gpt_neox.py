"""GPT-NeoX (Pythia): ``gpt_neox.layers.N`` blocks with fused ``attention.query_key_value``, LayerNorms
with biases, a parallel residual, and an untied output layer that transformers 5 calls ``lm_head`` in
memory and ``embed_out`` on disk (mlx-lm: ``embed_out``).

mlx-lm reads ``rotary_emb_base`` and ``rotary_pct`` (transformers 5: ``rope_parameters``) and builds the
MLP 4 x hidden wide whatever the config says, so a model with another width is refused. Its GELU is
the tanh approximation where transformers uses the exact one: logits differ by about 2e-5 of their
largest value (tiny model), inside the export check's tolerance."""
from mfqat.models.family import Family


def _neox_config(cfg: dict) -> dict:
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rotary_emb_base", rope.get("rope_theta", cfg.get("rope_theta", 10000)))
    cfg.setdefault("rotary_pct", rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    if cfg.get("intermediate_size") not in (None, 4 * cfg["hidden_size"]):
        raise ValueError(f"gpt_neox: mlx-lm builds the MLP 4 x hidden_size = {4 * cfg['hidden_size']} wide, this "
                         f"model has intermediate_size {cfg['intermediate_size']}; mlx_lm.load would refuse it")
    return cfg


FAMILY = Family(name="gpt_neox", model_types=("gpt_neox",), mlx_renames=((r"^lm_head\.", "embed_out."),),
                hf_renames=((r"^(model\.)?embed_out\.", "lm_head."), (r"^model\.h\.", "gpt_neox.layers."),
                            (r"^model\.", "gpt_neox.")),  # mlx-lm's sanitized names back to transformers'
                config_fixes=(_neox_config,), tested=True, attention_inputs=("query_key_value",),
                attention_outputs=("attention.dense",), mlp_inputs=("dense_h_to_4h",), mlp_outputs=("dense_4h_to_h",),
                awq_refusal="its parallel residual and GELU MLP have no exact norm -> linear fold in mfqat yet")
