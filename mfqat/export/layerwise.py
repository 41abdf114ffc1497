"""Run a lazily filled model over calibration blocks one decoder layer at a time (``--gptq``'s input moments).

A whole-model forward per batch needs every statistic of every layer held until the last batch is done. Run
layer-major instead: first every batch through the model with its decoder layers replaced by stand-ins that
only record what the model hands each layer (the attention masks and position embeddings of that layer, for that
batch) and pass the hidden state on; then, layer by layer, every batch's hidden state through the real layer, each
output kept as the next layer's input; last, the model's own tail (final norm, output head) on the last layer's
outputs. Between two stages the caller takes what it measured (its hooks) and frees it, so a statistic of one
layer is held at a time, with the calibration hidden states (two copies) beside it.

Each layer computes exactly what it computes inside the whole forward (the same input, the same arguments the
model gave it, the same weights), so the activations are bit for bit those of the whole-model forward
(tests/test_layerwise.py, every family). A layer's weights are read from the source once per stage, not once per
batch. With ``after`` (GPTQ's sequential mode) each layer runs a second time, on the weights the caller has once
it is done with the layer, and the next layer takes those outputs: the inputs the quantized model hands it.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from mfqat.export.lazy_model import LazyModel, Source
from mfqat.models import decoder_layers

Call = Tuple[tuple, dict]  # a layer call's positional and keyword arguments, the hidden state taken out


@dataclass
class Stage:
    """One step of :func:`layer_stages`: ``modules`` are the (qualified name, module) pairs it runs (one decoder
    layer's, or the tail's: everything outside the decoder layers); ``run()`` runs it over every batch."""

    name: str
    modules: List[Tuple[str, nn.Module]]
    run: Callable[[], None]


def _hidden(args: tuple, kwargs: dict) -> Tuple[torch.Tensor, Callable[[torch.Tensor], Call]]:
    """The hidden state a decoder layer was called with, and a function that puts another in its place."""
    if args:
        return args[0], lambda h: ((h,) + tuple(args[1:]), kwargs)
    return kwargs["hidden_states"], lambda h: ((), {**kwargs, "hidden_states": h})


def _output(out) -> torch.Tensor:
    """A decoder layer's hidden-state output (transformers 5 returns the tensor; older layers a tuple)."""
    return out[0] if isinstance(out, (tuple, list)) else out


@contextmanager
def _stand_ins(layers: nn.ModuleList, forwards: Dict[int, Callable]) -> Iterator[None]:
    """Layer ``i``'s forward replaced by ``forwards[i]`` (every layer's when given), put back on exit."""
    saved = {i: layers[i].__dict__.get("forward") for i in forwards}
    try:
        for i, fn in forwards.items():
            layers[i].forward = fn
        yield
    finally:
        for i, fn in saved.items():
            if fn is None:
                del layers[i].forward
            else:
                layers[i].forward = fn


def _cached(source: Source) -> Tuple[Source, Callable[[], None]]:
    """``source`` with each tensor read once until the returned ``clear()``."""
    held: Dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in held:
            held[name] = source(name)
        return held[name]
    return get, held.clear


class _Dropped:
    """An output list that keeps nothing (the first run of a layer whose outputs come from the run on ``after``)."""

    def __setitem__(self, index: int, value: torch.Tensor) -> None:
        pass


def _forward_layer(lazy: LazyModel, layer: nn.Module, calls: List[Call], inputs: List[torch.Tensor],
                   outputs, source: Source, clear: Callable[[], None]) -> None:
    """Every batch's ``inputs[b]`` through ``layer`` (with the arguments the model gave it for that batch) on the
    weights ``source`` gives, into ``outputs[b]``; the weights let go (``clear``) before it returns."""
    try:
        with torch.no_grad(), lazy.running(source):
            for b, (args, kwargs) in enumerate(calls):
                h_args, h_kwargs = _hidden(args, kwargs)[1](inputs[b])
                outputs[b] = _output(layer(*h_args, **h_kwargs))
    finally:
        clear()  # the layer's weights let go before the caller works on what it measured


def layer_stages(lazy: LazyModel, source: Source, calib: torch.Tensor, batch_size: int = 4,
                 progress_desc: Optional[str] = None, after: Optional[Source] = None) -> Iterator[Stage]:
    """The stages of a layer-major forward of ``lazy``'s model over ``calib`` (n x seq token ids, in batches of
    ``batch_size``) on the weights ``source`` gives: one per decoder layer, then the tail. The caller runs each
    (``stage.run()``) before asking for the next, with whatever hooks it wants on ``stage.modules``. ValueError for
    a model without decoder layers.

    ``after``: the weights the model has once the caller is done (GPTQ's sequential mode: the quantized model, asked
    lazily, so it sees what the caller changed during a stage). Given, the embedding (everything before the first
    layer) runs on ``after``, and each layer, once the caller asks for the next stage, runs again on ``after`` from
    the same inputs: stage ``i`` runs layer ``i`` on ``source`` with the inputs layers ``0 .. i-1`` hand it on
    ``after`` (the first run's outputs are dropped as they come, so no more is held than without it)."""
    from mfqat.progress import progress

    model = lazy.model
    prefix, layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers (a 'layers' ModuleList) to run layer by layer")
    batches = [calib[i:i + batch_size] for i in range(0, calib.shape[0], batch_size)]
    calls: List[List[Call]] = [[] for _ in layers]
    hidden: List[torch.Tensor] = []

    def recorder(i: int):
        def forward(*args, **kwargs):
            h, swap = _hidden(args, kwargs)
            if i == 0:
                hidden.append(h)
            elif h is not hidden[-1]:  # the stand-ins hand the same tensor on: something else ran in between
                raise ValueError(f"{type(model).__name__}: the hidden state changes between decoder layers "
                                 f"{i - 1} and {i}; this model cannot be run layer by layer")
            calls[i].append(swap(None))  # the arguments without the hidden state (not held once per layer)
            return h
        return forward

    cached, clear = _cached(source)
    first = _cached(after)[0] if after is not None else cached
    short = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    with torch.no_grad(), _stand_ins(layers, {i: recorder(i) for i in range(len(layers))}):
        for ids in batches:
            with lazy.running(first) as m:
                m(ids, use_cache=False, **short)  # the embedding runs (and the head, on one position if it can)
    clear()
    first = None  # the embedding's tensors let go
    called = [len(c) for c in calls]
    n_called = sum(1 for c in called if c)
    if any(c != len(batches) for c in called[:n_called]) or any(called[n_called:]):
        raise ValueError(f"{type(model).__name__}: its decoder layers are not each called once per forward, in "
                         f"order (calls per layer over {len(batches)} batches: {called}); it cannot be run layer by layer")
    layers = layers[:n_called]  # the layers the model calls (not a config's unused extra ones)
    inside = {id(m) for layer in layers for m in layer.modules()}
    for i in progress(range(len(layers)), desc=progress_desc or "layer by layer", unit="layer", leave=False):
        done: List[bool] = []

        def run(i: int = i, done: list = done) -> None:  # with ``after``, its outputs are those of the run on it
            _forward_layer(lazy, layers[i], calls[i], hidden, hidden if after is None else _Dropped(), cached, clear)
            if after is None:
                calls[i] = []
            done.append(True)
        yield Stage(f"{prefix}.{i}", [(f"{prefix}.{i}.{n}" if n else f"{prefix}.{i}", m)
                                      for n, m in layers[i].named_modules()], run)
        if not done:
            raise RuntimeError(f"layer_stages: stage {prefix}.{i} was not run before the next was asked for")
        clear()
        if after is not None:
            _forward_layer(lazy, layers[i], calls[i], hidden, hidden, *_cached(after))
            calls[i] = []
    tail = [(n, m) for n, m in model.named_modules() if id(m) not in inside and n]

    def run_tail() -> None:
        last = len(layers) - 1
        for b, ids in enumerate(batches):
            def forward(*args, b=b, **kwargs):  # the last layer hands on the kept output; the others pass through
                return hidden[b]
            with torch.no_grad(), _stand_ins(layers, {last: forward}), lazy.running(cached) as m:
                with _stand_ins(layers, {j: (lambda *a, **k: _hidden(a, k)[0]) for j in range(last)}):
                    m(ids, use_cache=False)
        clear()
        hidden.clear()
    yield Stage("tail", tail, run_tail)
