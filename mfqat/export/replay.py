"""A forward pass replayed from one decoder layer on: the ``auto:`` sensitivity pass's fast path.

A probe lowers one tensor. Every decoder layer before the first one that uses that tensor sees the
same input as in the reference (anchor-format) model, so its output is the one recorded in the
reference pass. :class:`LayerReplay` records those outputs once and, for a probe starting in layer
``l``, swaps layers ``0..l-1`` for their recorded outputs: the model's own forward still builds the
embeddings, masks and positions, and runs layers ``l..`` and the head on exactly the inputs the full
forward would give them (same kernels, same inputs: the same logits, bit for bit on one machine).

Which layer a tensor starts in: the decoder layers are where mfqat.models.decoder_layers finds them
(every family mfqat supports); a tensor under ``<that>.<i>.`` starts
in layer ``i``; the output embedding (``lm_head``) after the last layer; anything else (or a model
without such a list) replays nothing: a full forward. A tensor held by several modules (tied
embeddings: the input embedding and ``lm_head``) starts at the earliest of them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch
from torch import nn

from mfqat.models import decoder_layers


def start_layers(model: nn.Module, names: List[str]) -> Dict[str, int]:
    """{tensor name: the first decoder layer a probe of it changes} (0: a full forward; the number
    of layers: only the head changes)."""
    prefix, layers = decoder_layers(model)
    n = len(layers) if layers is not None else 0
    aliases: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = next((f"{q}.weight" for q, m in model.named_modules() if out_emb is not None and m is out_emb), None)

    def layer_of(name: str) -> int:  # of one alias: the module that holds it under this name
        if layers is not None and name.startswith(prefix + "."):
            index = name[len(prefix) + 1:].split(".", 1)[0]
            if index.isdigit():
                return int(index)
        return n if name == head else 0

    return {name: min(layer_of(a) for a in aliases[id(params[name])]) for name in names}


class LayerReplay:
    """Records every decoder layer's output in a reference forward, then replays them."""

    def __init__(self, model: nn.Module):
        self.model = model
        _, layers = decoder_layers(model)
        self.layers: List[nn.Module] = list(layers) if layers is not None else []
        self.outputs: List[object] = []

    def record(self, **inputs) -> torch.Tensor:
        """The reference forward's logits, keeping every layer's output."""
        self.outputs = [None] * len(self.layers)

        def keep(i: int):
            def hook(_module, _args, output):
                self.outputs[i] = _copy(output)  # a later layer may change its input in place
            return hook

        handles = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(self.layers)]
        try:
            logits = self.model(**inputs).logits
        finally:
            for h in handles:
                h.remove()
        return logits

    def logits_from(self, start: int, **inputs) -> torch.Tensor:
        """The logits of a forward whose layers ``0..start-1`` return their recorded outputs."""
        with self._replayed(start):
            return self.model(**inputs).logits

    @contextmanager
    def _replayed(self, start: int) -> Iterator[None]:
        patched = self.layers[:start]
        saved = [layer.__dict__.get("forward") for layer in patched]  # an instance forward (hooks) stays
        for layer, output in zip(patched, self.outputs):
            layer.forward = _returning(output)
        try:
            yield
        finally:
            for layer, forward in zip(patched, saved):
                if forward is None:
                    del layer.forward
                else:
                    layer.forward = forward


def _returning(output: object):
    def forward(*_args, **_kwargs):
        return _copy(output)  # the recorded output stays as recorded whatever the next layer does
    return forward


def _copy(output: object) -> object:
    """A layer's output (a tensor, or a tuple/list holding tensors) with its tensors cloned."""
    if isinstance(output, torch.Tensor):
        return output.clone()
    if type(output) in (tuple, list):
        return type(output)(_copy(o) for o in output)
    return output  # anything else (a ModelOutput, None) as it is
