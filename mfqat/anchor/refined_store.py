"""Deprecated: moved to :mod:`mfqat.anchor.learned_scales_store` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.anchor import learned_scales_store

moved(__name__, learned_scales_store)
