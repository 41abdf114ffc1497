"""A Hugging Face model whose weights are put in module by module as it runs (``--refine`` at any size).

:class:`LazyModel` builds an anchor's model with every parameter on the meta device (buffers such as rotary
frequencies real: nothing of the weights' size is allocated) and, as each module's forward starts, puts in
that module's tensors from a *source* (a callable ``name -> tensor``: the anchor's values for a teacher, the
learned weights for a student), taking them out again when it ends. A forward without autograd then holds
one module's weights at a time.

With autograd, every decoder layer (mfqat.models.decoder_layers) runs under non-reentrant
``torch.utils.checkpoint``: autograd keeps the layer's input instead of the weights and activations its
backward needs, and recomputes them (the source asked again, the same operations on the same values)
when the backward reaches the layer. Non-reentrant checkpointing records the same autograd graph as a
plain forward and only refills the saved tensors, so the gradients are the same, bit for bit, as those of
the model loaded whole (tests/test_refine_memory.py compares them).

A tensor held by several modules (tied embeddings: the input embedding and ``lm_head``) is asked of the
source once per forward and shared, as a state dict with tied weights would give it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mfqat.anchor.checkpoint import Anchor, AnchorError, model_class
from mfqat.anchor.dequantized import format_value
from mfqat.models import decoder_layers, family_for

Source = Callable[[str], torch.Tensor]


def empty_anchor_model(anchor: Anchor, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The anchor's Hugging Face model (the class anchor_model builds, in ``dtype``) with every parameter on the
    meta device and its buffers real, in eval mode, no parameter requiring grad."""
    from accelerate import init_empty_weights

    auto, config = model_class(anchor)
    with init_empty_weights():
        model = auto.from_config(config, dtype=dtype)
    model.tie_weights()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _slots(model: nn.Module, anchor: Anchor) -> Dict[nn.Module, List[Tuple[str, str, str]]]:
    """{module: [(kind, attribute, tensor name)]}: each parameter (or buffer) the anchor holds, under the name
    the anchor holds it by (a tied alias maps to the stored tensor). AnchorError naming a parameter the anchor
    does not hold (on the meta device, a forward would compute garbage from it without an error), but a
    dropped vision tower's (drop_towers), which a text forward never runs."""
    held = set(anchor.quantized) | set(anchor.plain)
    tied = anchor.meta.get("tied", {})
    aliases: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    out: Dict[nn.Module, List[Tuple[str, str, str]]] = {}
    missing = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(module, kind).items():
                full = f"{prefix}.{attr}" if prefix else attr
                names = aliases.get(id(t), [full]) if t is not None else []
                stored = next((n for n in names + [tied.get(n) for n in names] if n in held), None)
                if stored is not None:
                    out.setdefault(module, []).append((kind, attr, stored))
                elif kind == "_parameters" and t is not None:
                    missing.append(full)
    family = family_for(anchor.config["model_type"])
    missing = [k for k in missing if not (family.tower(k) and not any(map(family.tower, held)))]
    if missing:
        raise AnchorError(f"{anchor.path}: weights do not match config.json: missing {missing[:5]}")
    return out


class _DirectUse:
    """The weights of a module whose parent reads them without calling the module (Qwen3.5's Gated DeltaNet hands
    ``conv1d.weight`` to a kernel): transformers marks such parents with ``force_accelerate_hooks``, which calls
    the child's accelerate hook (``_hf_hook``: ``pre_forward`` / ``post_forward``) around the parent's forward;
    this one puts the weights in and takes them out as the module's own hooks do."""

    def __init__(self, put_in, take_out):
        self.put_in, self.take_out = put_in, take_out

    def pre_forward(self, module: nn.Module, *args, **kwargs):
        self.put_in(module, args)
        return args, kwargs

    def post_forward(self, module: nn.Module, output):
        self.take_out(module, (), output)
        return output


class LazyModel:
    """An anchor's model run on weights a source puts in per module (see the module docstring)."""

    def __init__(self, anchor: Anchor, checkpoint_layers: bool = True, dtype: torch.dtype = torch.float32):
        self.model = empty_anchor_model(anchor, dtype)
        self.slots = _slots(self.model, anchor)
        uses: Dict[str, int] = {}
        for entries in self.slots.values():
            for _, _, name in entries:
                uses[name] = uses.get(name, 0) + 1
        self.shared = {n for n, k in uses.items() if k > 1}
        self.source: Optional[Source] = None
        self._cache: Dict[str, torch.Tensor] = {}
        for module, entries in self.slots.items():
            put_in = self._put_in(entries)
            module.register_forward_pre_hook(put_in)
            meta = [(kind, attr, getattr(module, kind)[attr]) for kind, attr, _ in entries]
            take_out = self._take_out(meta)
            module.register_forward_hook(take_out, always_call=True)
            module._hf_hook = _DirectUse(put_in, take_out)
        prefix, layers = decoder_layers(self.model)
        inside = [n for n in self.shared if prefix and n.startswith(prefix + ".")]
        self.checkpointed = bool(checkpoint_layers and layers is not None and not inside)
        if self.checkpointed:  # a tensor shared across layers would be put in once but recomputed twice
            for layer in layers:
                layer.forward = self._checkpointed(layer.forward)

    def _value(self, name: str) -> torch.Tensor:
        """``name`` from the source (a shared tensor: once per forward)."""
        if name not in self.shared:
            return self.source(name)
        if name not in self._cache:
            self._cache[name] = self.source(name)
        return self._cache[name]

    def _put_in(self, entries):
        def hook(module: nn.Module, _args) -> None:
            for kind, attr, name in entries:
                getattr(module, kind)[attr] = self._value(name)
        return hook

    @staticmethod
    def _take_out(meta):
        def hook(module: nn.Module, _args, _output) -> None:
            for kind, attr, placeholder in meta:  # the meta tensors the model was built with
                getattr(module, kind)[attr] = placeholder
        return hook

    def _checkpointed(self, forward: Callable) -> Callable:
        """``forward`` under non-reentrant checkpointing while autograd records (as is under no_grad); its
        recomputation in backward asks the source this forward asked."""
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            source = self.source

            def again(*a, **k):
                before, self.source = self.source, source
                try:
                    return forward(*a, **k)
                finally:
                    self.source = before
            return checkpoint(again, *args, use_reentrant=False, **kwargs)
        return run

    @contextmanager
    def running(self, source: Source) -> Iterator[nn.Module]:
        """The model, for forwards on the weights ``source`` gives (a shared tensor asked once per forward run
        inside this block: open one block per forward whose source differs)."""
        self.source, self._cache = source, {}
        try:
            yield self.model
        finally:
            self.source, self._cache = None, {}

    def logits(self, source: Source, ids: torch.Tensor) -> torch.Tensor:
        """The model's logits for token ids ``ids`` (batch x seq) on the weights ``source`` gives."""
        with self.running(source) as model:
            return model(ids, use_cache=False).logits


def anchor_source(anchor: Anchor, fmt: Optional[str] = None, dtype: torch.dtype = torch.float32) -> Source:
    """name -> the anchor's tensor in ``fmt`` (None: its own format) as a model of ``dtype`` holds it (float32: what
    anchor_model(anchor) holds; mfqat.anchor.dequantized.format_value), read when asked."""
    return lambda name: format_value(anchor, name, fmt, dtype)
