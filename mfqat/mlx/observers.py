"""The ``window_minmax`` activation observer on MLX: the same rule, window and clip count as
:mod:`mfqat.qat.observers` (see there for the formula); bit-exact with it for the same window.

The window lives in underscore attributes, which MLX keeps out of ``parameters()`` (so no
optimizer, checkpoint or LoRA code sees it); entries are ``mx.stop_gradient``-ed and evaluated.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn

QMAX = 127.0


def int8_channel_fake_quant(x: mx.array, amax: mx.array) -> Tuple[mx.array, mx.array]:
    """(fake-quantized x, number of clipped elements) for a per-channel range ``amax`` (shape [C])."""
    xf = x.astype(mx.float32)
    amax = amax.astype(mx.float32)
    scale = mx.where(amax > 0, amax / QMAX, mx.ones_like(amax))
    xc = mx.clip(xf, -amax, amax)
    q = mx.round(xc / scale) * scale
    clipped = (mx.abs(mx.stop_gradient(xf)) > amax).sum()
    return (xc + mx.stop_gradient(q - xc)).astype(x.dtype), clipped


class WindowMinMaxObserver(nn.Module):
    """Per-channel min/max of the last ``window`` training inputs (the PyTorch observer's semantics)."""

    def __init__(self, channels: int, window: int = 64):
        super().__init__()
        if window < 1:
            raise ValueError(f"WindowMinMaxObserver: window must be >= 1, got {window}")
        self.channels, self.window = channels, window
        self._mins: List[mx.array] = []  # oldest first, at most `window` entries of shape [C]
        self._maxs: List[mx.array] = []
        self._clipped, self._seen = 0, 0

    def range(self) -> mx.array:
        """a_c = max |x_c| over the window (float32, shape [C])."""
        return mx.maximum(-mx.stack(self._mins).min(0), mx.stack(self._maxs).max(0))

    def observe(self, x: mx.array) -> None:
        """Push the per-channel min/max of ``x`` into the window (the oldest drops out when full)."""
        if x.shape[-1] != self.channels:
            raise ValueError(f"WindowMinMaxObserver: input has {x.shape[-1]} channels, expected {self.channels}")
        x2 = mx.stop_gradient(x).reshape(-1, self.channels).astype(mx.float32)
        lo, hi = x2.min(0), x2.max(0)
        mx.eval(lo, hi)
        self._mins, self._maxs = (self._mins + [lo])[-self.window:], (self._maxs + [hi])[-self.window:]

    def load_window(self, mins: List[mx.array], maxs: List[mx.array]) -> None:
        """Set the window (oldest first), e.g. from the PyTorch observer's state."""
        self._mins = [m.astype(mx.float32) for m in mins][-self.window:]
        self._maxs = [m.astype(mx.float32) for m in maxs][-self.window:]

    def clip_rate(self, reset: bool = False) -> float:
        """Fraction of elements clipped since the last reset (0.0 when nothing was quantized)."""
        rate = self._clipped / self._seen if self._seen else 0.0
        if reset:
            self._clipped, self._seen = 0, 0
        return rate

    def __call__(self, x: mx.array) -> mx.array:
        if self._mins:
            amax = self.range()
        else:
            x2 = mx.stop_gradient(x).reshape(-1, x.shape[-1]).astype(mx.float32)
            amax = mx.maximum(-x2.min(0), x2.max(0))
        out, clipped = int8_channel_fake_quant(x, amax)
        self._clipped += int(clipped.item())
        self._seen += x.size
        if self.training:
            self.observe(x)
        return out


def clip_rates(model: nn.Module, reset: bool = False) -> Dict[str, float]:
    """{layer name: fraction of its input elements clipped by its observer since the last reset}."""
    return {name.rsplit(".act_observer", 1)[0]: m.clip_rate(reset)
            for name, m in model.named_modules() if isinstance(m, WindowMinMaxObserver)}
