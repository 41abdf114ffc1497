"""Anchor checkpoints: save one MXINT8 / MXFP8 model, load it in any lower format.

Owns: ``checkpoint`` (save_anchor / read_anchor, Slice-and-Scale of what was read), ``load`` (load_anchor), ``config`` (the anchor's config.json),
``meta`` (validation of mfqat.json and of every tensor read), ``tensors`` (what a model gives an
anchor), ``search`` and ``importance`` (the output-aware scale search when an anchor is lowered),
``learned_scales`` and ``learned_scales_store`` (the learned scales an anchor keeps, and adding them to one;
``refined`` and ``refined_store`` are their deprecated old paths).

May import: formats, progress, quant, storage, models, qat. Never export, eval, data, mlx or cli.
"""
from mfqat.anchor.checkpoint import Anchor, anchor_model, read_anchor, read_meta, save_anchor
from mfqat.anchor.load import load_anchor

__all__ = ["Anchor", "anchor_model", "load_anchor", "read_anchor", "read_meta", "save_anchor"]
