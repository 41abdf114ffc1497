"""Static activation observers: a per-channel min/max over a sliding window of training steps.

``window_minmax`` (``QATConfig.activation_observer``) fake-quantizes a Linear's input x (shape
``[..., C]``, C = in_features) to symmetric int8 per input channel c, from the range observed
over the last ``W = QATConfig.observer_window`` training forwards (not the current one)::

    a_c = max over the window of max(-min_c, max_c)         (float32)
    s_c = a_c / 127            (s_c = 1 where a_c == 0, then every x clips to 0)
    q   = round_half_even(clamp(x, -a_c, a_c) / s_c) * s_c  (float32, cast back to x's dtype)

Gradient: straight-through inside [-a_c, a_c], zero for clipped elements (as torchao's fake
quant). Clip rate: the fraction of elements with |x| > a_c, counted since the last reset
(:func:`clip_rates`). A training forward quantizes with the window as it stands, then pushes
its own per-channel min/max (the oldest entry drops out once W are held); an eval forward
does not update the window. With an empty window (no training forward yet) the batch's own
range is used, unrecorded. Under the joint schedule every format's forward is one entry.

The window is a non-persistent buffer: it is NOT in the state_dict (checkpoints and exports are
unchanged); it moves with ``.to(device)`` and refills within W steps after a resume.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import nn

from mfqat.qat.config_checks import OBSERVERS
QMAX = 127.0


def int8_channel_fake_quant(x: torch.Tensor, amax: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(fake-quantized x, number of clipped elements) for a per-channel range ``amax`` (shape [C])."""
    xf = x.float()
    amax = amax.float()
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    xc = torch.clamp(xf, -amax, amax)
    q = torch.round(xc / scale) * scale
    clipped = (xf.detach().abs() > amax).sum()
    return (xc + (q - xc).detach()).to(x.dtype), clipped


class WindowMinMaxObserver(nn.Module):
    """Per-channel min/max of the last ``window`` training inputs, and the int8 fake quant they define."""

    def __init__(self, channels: int, window: int = 64, device=None):
        super().__init__()
        if window < 1:
            raise ValueError(f"WindowMinMaxObserver: window must be >= 1, got {window}")
        self.channels, self.window = channels, window
        self.register_buffer("mins", torch.zeros(window, channels, device=device), persistent=False)
        self.register_buffer("maxs", torch.zeros(window, channels, device=device), persistent=False)
        self.register_buffer("clipped", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.filled = 0  # entries held (<= window)
        self.pos = 0  # next slot to write

    def range(self) -> torch.Tensor:
        """a_c = max |x_c| over the window (shape [C], float32); zeros when empty."""
        n = self.filled
        return torch.maximum(-self.mins[:n].amin(0), self.maxs[:n].amax(0)) if n else self.mins[0] * 0

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:
        """Push the per-channel min/max of ``x`` (all leading dims reduced) into the window."""
        if x.shape[-1] != self.channels:
            raise ValueError(f"WindowMinMaxObserver: input has {x.shape[-1]} channels, expected {self.channels}")
        x2 = x.detach().reshape(-1, self.channels).float()
        self.mins[self.pos] = x2.amin(0)
        self.maxs[self.pos] = x2.amax(0)
        self.pos = (self.pos + 1) % self.window
        self.filled = min(self.filled + 1, self.window)

    def reset(self) -> None:
        """Empty the window and the clip counters."""
        self.filled = self.pos = 0
        self.clipped.zero_()
        self.seen.zero_()

    def clip_rate(self, reset: bool = False) -> float:
        """Fraction of elements clipped since the last reset (0.0 when nothing was quantized)."""
        seen = int(self.seen.item())
        rate = int(self.clipped.item()) / seen if seen else 0.0
        if reset:
            self.clipped.zero_()
            self.seen.zero_()
        return rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.filled:
            amax = self.range()
        else:
            with torch.no_grad():
                x2 = x.detach().reshape(-1, x.shape[-1]).float()
                amax = torch.maximum(-x2.amin(0), x2.amax(0))
        out, clipped = int8_channel_fake_quant(x, amax)
        with torch.no_grad():
            self.clipped += clipped
            self.seen += x.numel()
        if self.training:
            self.observe(x)
        return out

    def extra_repr(self) -> str:
        return f"channels={self.channels}, window={self.window}, filled={self.filled}"


def make_observer(kind: str, channels: int, window: int, device=None) -> nn.Module:
    """The observer named by ``QATConfig.activation_observer``."""
    if kind != "window_minmax":
        raise ValueError(f"unknown activation observer '{kind}'; choose one of {OBSERVERS}")
    return WindowMinMaxObserver(channels, window, device)


def clip_rates(model: nn.Module, reset: bool = False) -> Dict[str, float]:
    """{Linear name: fraction of its input elements clipped by its observer since the last reset}."""
    rates: Dict[str, float] = {}
    for name, m in model.named_modules():
        if isinstance(m, WindowMinMaxObserver):
            rates[name.rsplit(".act_observer", 1)[0]] = m.clip_rate(reset)
    return rates


def mean_clip_rate(model: nn.Module, reset: bool = False) -> float:
    """The mean of :func:`clip_rates` over layers (0.0 when the model has no observers)."""
    rates = clip_rates(model, reset)
    return sum(rates.values()) / len(rates) if rates else 0.0
