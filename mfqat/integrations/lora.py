"""Deprecated: moved to :mod:`mfqat.train.lora` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.train import lora

moved(__name__, lora)
