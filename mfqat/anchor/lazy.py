"""An anchor's tensors read when asked for, one at a time (the streaming export reads anchors of any size).

:class:`LazyTensors` and :class:`LazyQuantized` are the ``plain`` and ``quantized`` mappings of an
:class:`~mfqat.anchor.checkpoint.Anchor` read with ``read_anchor(..., lazy=True)``: their keys, shapes and
dtypes come from mfqat.json and the safetensors headers (checked when the anchor is read); a value is read
from its file (``os.pread`` through the descriptor the anchor was hashed from) each time it is asked for,
and not kept. Assigning or popping a key works as on a dict (the value is then held in memory), so code
written for a plain dict still runs; :meth:`Anchor.materialize` turns both into plain dicts. What the scale
search attaches to a quantized tensor (its input importance and ``search`` rules) is kept by name
(:meth:`LazyQuantized.annotate`) and given to the tensor each time it is built.
"""
from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch

from mfqat.storage.tensor_files import TensorFile, TensorInfo


class LazyTensors(MutableMapping):
    """{name: tensor} read from the anchor's files on each access (see the module docstring)."""

    def __init__(self, refs: Dict[str, Tuple[TensorFile, TensorInfo]], stored: Optional[Dict[str, str]] = None):
        self._refs = dict(refs)
        self._stored = dict(stored or {})  # name -> the name its file holds it by, where they differ
        self._held: Dict[str, torch.Tensor] = {}

    def info(self, name: str) -> TensorInfo:
        """Shape and dtype of ``name`` without reading it."""
        if name in self._held:
            v = self._held[name]
            return TensorInfo(v.dtype, tuple(v.shape), 0, v.numel() * v.element_size())
        return self._refs[name][1]

    def shape(self, name: str) -> Tuple[int, ...]:
        """Shape of ``name`` without reading it."""
        return tuple(self.info(name).shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._held:
            return self._held[name]
        f, _ = self._refs[name]
        return f.read(self._stored.get(name, name))

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._refs.pop(name, None)
        self._held[name] = value

    def __delitem__(self, name: str) -> None:
        if name in self._held:
            del self._held[name]
        else:
            del self._refs[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._refs
        yield from self._held

    def __len__(self) -> int:
        return len(self._refs) + len(self._held)

    def __contains__(self, name: object) -> bool:
        return name in self._refs or name in self._held


class LazyQuantized(LazyTensors):
    """{name: MXTensor} built from ``{name}.codes`` / ``{name}.scales`` on each access; ``build(name)``
    reads and unpacks one (the anchor's checks and recorded attributes applied)."""

    def __init__(self, shapes: Dict[str, Tuple[int, ...]], build: Callable[[str], object]):
        super().__init__({})
        self._shapes = dict(shapes)
        self._build = build
        self._notes: Dict[str, Tuple[Optional[torch.Tensor], Dict[str, str]]] = {}

    def annotate(self, name: str, importance: Optional[torch.Tensor], rules: Dict[str, str]) -> None:
        """Give tensor ``name`` the input ``importance`` and add ``rules`` ({format: scale rule}) to its
        ``slice_rules``, now for a held value and on every later build for one read from the files."""
        if name in self._held:
            _note(self._held[name], importance, rules)
        elif name in self._shapes:
            self._notes[name] = (importance, rules)
        else:
            raise KeyError(name)

    def info(self, name: str) -> TensorInfo:
        if name in self._held:
            q = self._held[name]
            return TensorInfo(q.dtype, tuple(q.shape), 0, 0)
        return TensorInfo(torch.float32, self._shapes[name], 0, 0)

    def __getitem__(self, name: str):
        if name in self._held:
            return self._held[name]
        if name not in self._shapes:
            raise KeyError(name)
        q = self._build(name)
        if name in self._notes:
            _note(q, *self._notes[name])
        return q

    def __setitem__(self, name: str, value) -> None:
        self._shapes.pop(name, None)
        self._notes.pop(name, None)  # a value put in carries its own importance and rules
        self._held[name] = value

    def __delitem__(self, name: str) -> None:
        if name in self._held:
            del self._held[name]
        else:
            del self._shapes[name]
            self._notes.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        yield from self._shapes
        yield from self._held

    def __len__(self) -> int:
        return len(self._shapes) + len(self._held)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes or name in self._held


def _note(q, importance: Optional[torch.Tensor], rules: Dict[str, str]) -> None:
    """Set an MXTensor's input importance and add ``rules`` to its slice rules (in place)."""
    q.importance = importance
    q.slice_rules = {**(q.slice_rules or {}), **rules}


def annotate(mapping, name: str, importance: Optional[torch.Tensor], rules: Dict[str, str]) -> None:
    """:meth:`LazyQuantized.annotate` on any anchor's ``quantized`` mapping (a plain dict: the held tensor)."""
    if isinstance(mapping, LazyQuantized):
        mapping.annotate(name, importance, rules)
    else:
        _note(mapping[name], importance, rules)


def tensor_shape(mapping, name: str) -> Tuple[int, ...]:
    """Shape of ``mapping[name]`` without reading it where the mapping is lazy."""
    if isinstance(mapping, LazyTensors):
        return mapping.shape(name)
    return tuple(mapping[name].shape)


def tensor_info(mapping, name: str) -> Optional[TensorInfo]:
    """(dtype, shape) of a plain tensor without reading it where the mapping is lazy."""
    if isinstance(mapping, LazyTensors):
        return mapping.info(name)
    v = mapping[name]
    return TensorInfo(v.dtype, tuple(v.shape), 0, v.numel() * v.element_size())


def tensor_infos(mapping) -> Iterator[TensorInfo]:
    """(dtype, shape) of each tensor of ``mapping`` in its order, none read where the mapping is lazy."""
    return (tensor_info(mapping, k) for k in mapping)
