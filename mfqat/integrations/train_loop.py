"""Deprecated: moved to :mod:`mfqat.train.loop` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.train import loop

moved(__name__, loop)
