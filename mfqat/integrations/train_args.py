"""Deprecated: moved to :mod:`mfqat.train.args` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.train import args

moved(__name__, args)
