"""Deprecated: moved to :mod:`mfqat.train.grad_compress` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.train import grad_compress

moved(__name__, grad_compress)
