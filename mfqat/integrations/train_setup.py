"""Deprecated: moved to :mod:`mfqat.train.setup` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.train import setup

moved(__name__, setup)
