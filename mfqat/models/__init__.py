"""Model families: which parameters are quantized, which stay high precision, and the names mlx-lm uses.

One file per family holds its rules (:class:`~mfqat.models.family.Family`: what is quantized, kept high,
renamed, and the roles of its projections); ``layout`` says where the decoder blocks and the output head
are. Every other layer asks here instead of matching Llama's names itself. A model type with no file gets the dense rules
(:data:`DENSE`): its decoder-block Linears are quantized, and ``prepare`` / ``save_anchor`` warn by name
about any other large weight (for example fused 3-D experts) that they leave in full precision.

May import: nothing of mfqat (a leaf: plain data and name rules).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from mfqat.models import deepseek_v3, gemma2, gemma3, glm4_moe, gpt_neox, llama, mixtral, olmo2, phi3, qwen3_5, qwen3_moe, qwen3_next
from mfqat.models.family import ROLES, ExpertParam, Family, PlainRule
from mfqat.models.layout import (DECODER_BLOCK, block_module, decoder_layers, in_decoder_block, is_embedding,
                                 is_output_head, layer_index, tied_away)

FAMILIES: List[Family] = [llama.FAMILY, olmo2.FAMILY, phi3.FAMILY, gemma2.FAMILY, gemma3.FAMILY, gpt_neox.FAMILY, qwen3_moe.FAMILY,
                          mixtral.FAMILY, glm4_moe.FAMILY, deepseek_v3.FAMILY, qwen3_5.FAMILY, qwen3_5.MOE_FAMILY,
                          qwen3_5.VL_FAMILY, qwen3_5.VL_MOE_FAMILY, qwen3_next.FAMILY]


def _every(role: str, *extra: str) -> Tuple[str, ...]:
    return tuple(dict.fromkeys([n for f in FAMILIES for n in getattr(f, role)] + list(extra)))


# A type with no file may use any family's projection names: its roles are all of them (and ``w2``, the MLP
# output of checkpoints with Mixtral's original per-expert names).
DENSE = Family(name="dense (no family file)", model_types=(), attention_inputs=_every("attention_inputs"),
               attention_outputs=_every("attention_outputs"), mlp_inputs=_every("mlp_inputs"),
               mlp_outputs=_every("mlp_outputs", "w2"))
_BY_TYPE: Dict[str, Family] = {t: f for f in FAMILIES for t in f.model_types}


def family_for(model_type: Optional[str]) -> Family:
    """The family of a config's ``model_type`` (the dense rules when mfqat has no file for it). mlx-lm's
    name of a text model whose transformers type ends in ``_text`` (``qwen3_5`` for ``qwen3_5_text``, as an
    export's config.json says) finds the same family, unless the type itself is a release's (``qwen3_5``:
    the vision-language checkpoint, whose tensor rules are the text family's under its own names)."""
    return _BY_TYPE.get(model_type or "") or _BY_TYPE.get(f"{model_type}_text", DENSE)


def family_of(model) -> Family:
    """The family of a transformers model (``model.config.model_type``), or of an object without a config."""
    config = getattr(model, "config", None)
    return family_for(getattr(config, "model_type", None))


__all__ = ["ExpertParam", "Family", "PlainRule", "ROLES", "FAMILIES", "DENSE", "family_for", "family_of", "DECODER_BLOCK",
           "block_module", "decoder_layers", "in_decoder_block", "is_embedding", "is_output_head", "layer_index", "tied_away"]
