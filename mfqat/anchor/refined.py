"""Deprecated: moved to :mod:`mfqat.anchor.learned_scales` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.anchor import learned_scales

moved(__name__, learned_scales)
