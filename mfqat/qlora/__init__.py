"""Deprecated: moved to :mod:`mfqat.mxqlora` (this path and its submodules' paths, ``mfqat.qlora.model``,
``.train``, ``.mlx_adapter``, are removed in the next release)."""
from mfqat import mxqlora
from mfqat._moved import moved

moved(__name__, mxqlora)
