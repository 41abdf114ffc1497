"""Where things are in a model, by module and tensor name, for every family: the decoder blocks, the
decoder layer a name belongs to, and the output head (``lm_head``) a tied checkpoint leaves out.

Every other layer asks here instead of writing ``layers\\.\\d+`` or ``"lm_head"`` itself. torch is
imported only by :func:`decoder_layers` (the rest is name rules).
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from torch import nn

# A module inside a decoder block: ``layers.N`` (Llama, Qwen, Gemma, GPT-NeoX's ``gpt_neox.layers``...),
# ``h.N`` (GPT-2 style) or ``blocks.N`` anywhere in its name (QATConfig's default targets).
DECODER_BLOCK = r"(^|\.)(layers|h|blocks)\.\d+(\.|$)"
# The decoder layer index in a tensor name (transformers and mlx-lm both write ``...layers.N....``).
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# A block module as Llama-style transformers and mlx-lm models name it: ``model.layers.N.<path>``.
_BLOCK_MODULE = re.compile(r"^(model\.layers\.\d+)\.(.+)$")
OUTPUT_HEAD = "lm_head"
_OUTPUT_HEAD = re.compile(r"(^|\.)lm_head(\.|$)")


def in_decoder_block(name: str) -> bool:
    """Whether the module or tensor ``name`` lies inside a decoder block (:data:`DECODER_BLOCK`)."""
    return re.search(DECODER_BLOCK, name) is not None


def layer_index(name: str) -> Optional[int]:
    """The decoder layer ``N`` of a tensor named ``...layers.N....`` (transformers' or mlx-lm's), or None."""
    m = _LAYER_INDEX.search(name)
    return int(m.group(1)) if m else None


def block_module(name: str) -> Optional[Tuple[str, str]]:
    """(block, path inside it) of a module named ``model.layers.N.<path>`` (``model.layers.3.self_attn.q_proj``
    -> (``model.layers.3``, ``self_attn.q_proj``)), the names mlx-lm's adapters use; None for any other name."""
    m = _BLOCK_MODULE.match(name)
    return (m.group(1), m.group(2)) if m else None


def decoder_layers(model: "nn.Module") -> Tuple[str, Optional["nn.ModuleList"]]:
    """(qualified name, list) of the model's decoder layers: its shallowest non-empty ``nn.ModuleList`` named
    ``layers`` (``model.layers``; ``gpt_neox.layers``; a vision-language release's
    ``model.language_model.layers``); ("", None) when it has none."""
    from torch import nn

    found = [(name.count("."), name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers" and len(m)]
    if not found:
        return "", None
    _, name, layers = min(found, key=lambda t: t[:2])
    return name, layers


def is_output_head(name: str) -> bool:
    """Whether the module or tensor ``name`` is the output head (``lm_head``, ``lm_head.weight``; a release's
    ``language_model.lm_head``). GPT-NeoX's ``embed_out`` is ``lm_head`` in memory."""
    return _OUTPUT_HEAD.search(name) is not None


def is_embedding(name: str) -> bool:
    """Whether the tensor ``name`` is an embedding table by its name (``embed_tokens``; GPT-NeoX's
    ``embed_in``, and its output head as written on disk, ``embed_out``)."""
    return "embed" in name


def tied_away(name: str, tied: bool) -> bool:
    """Whether a checkpoint leaves the tensor ``name`` out because the output head is the input embedding
    (``tie_word_embeddings``: ``lm_head.weight`` is not stored, transformers ties it on load)."""
    return bool(tied) and name == f"{OUTPUT_HEAD}.weight"
