"""Phi-3: fused ``self_attn.qkv_proj`` and ``mlp.gate_up_proj`` Linears, each trained and quantized
as one Linear. AWQ: input_layernorm -> qkv_proj and post_attention_layernorm -> gate_up_proj (the
up -> down and v -> o groups would scale a slice of a fused Linear's rows: not done)."""
from mfqat.models.family import Family

FAMILY = Family(name="phi3", model_types=("phi3",), tested=True, attention_inputs=("qkv_proj",), mlp_inputs=("gate_up_proj",),
                awq_groups=(("input_layernorm", ("self_attn.qkv_proj",)),
                            ("post_attention_layernorm", ("mlp.gate_up_proj",))))
