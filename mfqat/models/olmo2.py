"""OLMo 2: Llama's names, but its norms come *after* attention and the MLP (post-norm): q/k/v and
gate/up read the raw residual, so AWQ has no norm to fold their scales into. AWQ keeps the two
Linear -> Linear groups (up -> down, v -> o)."""
from mfqat.models.family import Family

FAMILY = Family(name="olmo2", model_types=("olmo2",), tested=True,
                awq_groups=(("mlp.up_proj", ("mlp.down_proj",)), ("self_attn.v_proj", ("self_attn.o_proj",))))
