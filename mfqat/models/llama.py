"""Dense decoders with Llama's names: every Linear of the decoder blocks is a target, norms and
embeddings stay aside, nothing is renamed for mlx-lm (its sanitize drops rotary buffers and a tied
lm_head itself). Config: the rope keys transformers 5 nests in ``rope_parameters`` are copied out
(mlx-lm's qwen2 would otherwise use its own rope_theta default of 1e6, granite refuses to load).
AWQ: input_layernorm -> q/k/v, post_attention_layernorm -> gate/up, up -> down, v -> o."""
from mfqat.models.family import LLAMA_AWQ, Family

FAMILY = Family(name="llama", model_types=("llama", "mistral", "qwen2", "qwen3", "granite"),
                awq_groups=LLAMA_AWQ, tested=True)
