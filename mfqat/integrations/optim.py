"""Deprecated: moved to :mod:`mfqat.train.optim` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.train import optim

moved(__name__, optim)
