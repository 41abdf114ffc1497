"""Deprecated: moved to :mod:`mfqat.export.mlx_sizes` (this path is removed in the next release)."""
from mfqat._moved import moved
from mfqat.export import mlx_sizes

moved(__name__, mlx_sizes)
