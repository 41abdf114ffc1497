"""``load_anchor``: an anchor on disk as a ready PyTorch model in any format it serves.

Composes :mod:`mfqat.anchor.checkpoint` (read, Slice-and-Scale) with :mod:`mfqat.anchor.search`
(the optional output-aware scale search on calibration text); kept apart so that neither of those
imports the other's caller.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from mfqat.anchor.checkpoint import anchor_model, read_anchor
from mfqat.anchor.search import search_scales
from mfqat.quant.derive import DERIVED_GROUP_SIZE
from mfqat.storage.io import PathLike


def load_anchor(path: PathLike, fmt: Optional[str] = None, device: Union[str, torch.device] = "cpu",
                dtype: torch.dtype = torch.float32, group_size: int = DERIVED_GROUP_SIZE,
                calib: Optional[torch.Tensor] = None) -> nn.Module:
    """A ready Hugging Face model whose quantized weights hold ``fmt`` values (Slice-and-Scale).

    ``fmt=None`` gives the anchor's own format. Any format of the anchor's family at or below
    its bits can be asked for, and the derived affine formats (``affine4``: MLX's layout in groups
    of ``group_size``, mfqat.quant.derive); others raise AnchorError / ValueError with the reason.
    ``calib``: token ids (blocks x seq_len, e.g. ``mfqat.data.sources.calibration_blocks(tok, text)``) of
    calibration text; lowers ``fmt`` with the output-aware per-block scale search where it measured
    better (mxint6..mxint3, mfqat.anchor.search), as ``export-mlx --scale-search`` does; other
    formats warn and keep their rule. ``model.mfqat_scale_search`` reports what was searched.
    """
    anchor = read_anchor(path)
    report = None
    if calib is not None:
        report = search_scales(anchor, calib, fmt or anchor.format, _stacklevel=3)
    model = anchor_model(anchor, fmt, device, dtype, group_size, _stacklevel=3)
    model.mfqat_scale_search = report  # what the search did (None: not asked)
    return model
