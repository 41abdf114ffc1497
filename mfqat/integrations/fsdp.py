"""Deprecated: moved to :mod:`mfqat.train.fsdp` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.train import fsdp

moved(__name__, fsdp)
