"""Qwen3-Next: hybrid decoders where Gated DeltaNet layers (``linear_attn``: a fused ``in_proj_qkvz``, a
fused ``in_proj_ba``, ``conv1d``, ``A_log``, ``dt_bias``, a gated ``norm``, ``out_proj``) alternate with
gated full attention, ``(1 + w)`` RMSNorms, and on every layer a router, fused experts, a shared expert
and its gate.

Trained and quantized: every Linear of the blocks (``in_proj_qkvz``, ``out_proj``, q/k/v/o, the shared
expert) and the fused experts, per expert along in_features. Kept high precision: ``in_proj_ba`` (one
decay and one write strength per value head and token), the router and ``shared_expert_gate`` (mlx-lm's
own predicate keeps both at 8 bits; here bfloat16), the convolution (bfloat16) and ``A_log`` (float32).

For mlx-lm: its ``sanitize`` adds 1 to the ``(1 + w)`` norms and moves conv1d's axes only for a
checkpoint with per-expert names, which cannot carry quantized experts (it stacks only ``.weight``). So the
export writes experts as ``switch_mlp`` and does both conversions itself (:class:`PlainRule`); the
gated DeltaNet ``norm`` is a plain ``w`` norm and is left alone. The layer pattern is given as
``full_attention_interval``. AWQ groups: input_layernorm -> in_proj_qkvz, in_proj_ba (linear layers) and
-> q/k/v (full layers), v -> o; norms fold as ``w' = (1 + w) / s - 1``. The MoE MLP takes no AWQ scale
(the router and experts share post_attention_layernorm, as in qwen3_moe)."""
from mfqat.models.family import FUSED_EXPERTS, ROUTER, Family, PlainRule, full_attention_interval

IN_PROJ_BA = (r"\.linear_attn\.in_proj_ba\.weight$",
              "Gated DeltaNet decay / write-strength projection (one value per head): kept in bfloat16")
SHARED_EXPERT_GATE = (r"\.mlp\.shared_expert_gate\.weight$", "shared-expert gate (one value per token): kept in bfloat16")
CONV = (r"\.linear_attn\.conv1d\.weight$", "Gated DeltaNet depthwise convolution (C x 1 x K): kept in bfloat16")
NORMS = PlainRule(r"(\.input_layernorm|\.post_attention_layernorm|^model\.norm|\.q_norm|\.k_norm)\.weight$",
                  to_mlx=lambda w: w + 1.0, to_hf=lambda w: w - 1.0,
                  why="mlx-lm's RMSNorm multiplies by w; transformers' Qwen3-Next norm by (1 + w)")
CONV_AXES = PlainRule(r"\.linear_attn\.conv1d\.weight$", to_mlx=lambda w: w.transpose(1, 2),
                      to_hf=lambda w: w.transpose(1, 2), why="mlx-lm's Conv1d weight is C x K x 1, PyTorch's C x 1 x K")
AWQ = (("input_layernorm", ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")),
       ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
       ("self_attn.v_proj", ("self_attn.o_proj",)))

FAMILY = Family(name="qwen3_next", model_types=("qwen3_next",), experts=FUSED_EXPERTS,
                keep_high=(IN_PROJ_BA, CONV, ROUTER, SHARED_EXPERT_GATE), plain_rules=(NORMS, CONV_AXES),
                keep_float32=(r"\.A_log$",), config_fixes=(full_attention_interval,), norm_offset=1.0, awq_groups=AWQ,
                mlx_anchor_refusal="the MLX model holds 1 + w in its norms and conv1d as C x K x 1", tested=True,
                attention_inputs=("q_proj", "k_proj", "v_proj", "in_proj_qkvz"), attention_outputs=("o_proj", "out_proj"))
