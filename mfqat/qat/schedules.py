"""Format schedules: which format the MF-QAT modules use at a given training step.

Plain Python, no torch: the MLX runtime shares this module (docs/architecture.md).
"""
from __future__ import annotations

import random
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from mfqat.formats import canonical_name, get_format
SCHEDULES = ("joint", "progressive", "cyclic", "random", "fixed")


class Schedule:
    """Base class: ``format_at(step, total_steps)`` names the format for a step."""

    def __init__(self, formats: Sequence[str]):
        if not formats:
            raise ValueError("a schedule needs at least one format")
        self.formats: List[str] = [canonical_name(f) for f in formats]
        for f in self.formats:
            if not (get_format(f).is_mx or get_format(f).family in ("affine", "nvfp4")):
                raise ValueError(f"MF-QAT schedules take MX formats and the derived ones (affine, nvfp4); '{f}' is neither")

    def format_at(self, step: int, total_steps: int) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.formats})"


class ProgressiveSchedule(Schedule):
    """The MF-QAT paper's order: formats sorted low to high bits, equal shares of the steps.

    ``repeats=N`` runs the ramp N times (each ramp takes total_steps / N steps).
    """

    def __init__(self, formats: Sequence[str], repeats: int = 1):
        super().__init__(formats)
        self.formats.sort(key=lambda f: (get_format(f).bits, f))
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.repeats = repeats

    def format_at(self, step: int, total_steps: int) -> str:
        total = max(int(total_steps), 1)
        ramp = max(total / self.repeats, 1e-9)
        pos = (min(max(step, 0), total - 1) % ramp) / ramp
        return self.formats[min(int(pos * len(self.formats)), len(self.formats) - 1)]


class CyclicSchedule(Schedule):
    """Round robin: one format per step, in the given order."""

    def format_at(self, step: int, total_steps: int) -> str:
        return self.formats[step % len(self.formats)]


class RandomSchedule(Schedule):
    """A seeded, reproducible random format per step (the same on every rank)."""

    def __init__(self, formats: Sequence[str], seed: int = 0):
        super().__init__(formats)
        self.seed = seed

    def format_at(self, step: int, total_steps: int) -> str:
        return random.Random(self.seed * 1_000_003 + step).choice(self.formats)


class FixedSchedule(Schedule):
    """Single-format QAT (the baseline)."""

    def format_at(self, step: int, total_steps: int) -> str:
        return self.formats[0]


class JointSchedule(Schedule):
    """Several formats in every optimizer step (Matryoshka / AdaBits style).

    ``formats_at(step)`` names the formats whose losses one step sums: all of them, or with
    ``sample=k`` a "sandwich" of the highest (anchor) format, the lowest format and ``k``
    others drawn without replacement (seeded by step, so identical on every rank).
    ``format_at`` gives the highest format: what the model runs between steps.
    """

    def __init__(self, formats: Sequence[str], seed: int = 0, sample: Optional[int] = None):
        super().__init__(formats)
        self.formats.sort(key=lambda f: (-get_format(f).bits, f))
        if sample is not None and sample < 0:
            raise ValueError(f"joint_sample must be >= 0 (formats drawn besides the highest and lowest), got {sample}")
        self.seed, self.sample = seed, sample

    def formats_at(self, step: int) -> List[str]:
        """The formats trained at ``step``, highest bits first."""
        if self.sample is None or len(self.formats) <= 2 + self.sample:
            return list(self.formats)
        middle = self.formats[1:-1]
        picked = set(random.Random(self.seed * 1_000_003 + step).sample(middle, self.sample))
        return [self.formats[0]] + [f for f in middle if f in picked] + [self.formats[-1]]

    def format_at(self, step: int, total_steps: int) -> str:
        return self.formats[0]


def make_schedule(kind: str, formats: Sequence[str], seed: int = 0, repeats: int = 1,
                  sample: Optional[int] = None) -> Schedule:
    """Build a schedule by name."""
    if kind == "joint":
        return JointSchedule(formats, seed, sample)
    if kind == "progressive":
        return ProgressiveSchedule(formats, repeats)
    if kind == "cyclic":
        return CyclicSchedule(formats)
    if kind == "random":
        return RandomSchedule(formats, seed)
    if kind == "fixed":
        if len(formats) != 1:
            raise ValueError(f"the fixed schedule takes exactly one format, got {list(formats)}")
        return FixedSchedule(formats)
    raise ValueError(f"unknown schedule '{kind}'; choose one of {SCHEDULES}")


class ScheduleClock:
    """Each prepared module's schedule and the step training is at; sets every module's active format per
    step. The PyTorch controller (mfqat.qat.prepare.MFQATController) and the MLX one
    (mfqat.mlx.qat.MLXController) differ only in how they find their modules (:meth:`scheduled`)."""

    def __init__(self, config: Any, schedules: Dict[str, Schedule]):  # a mfqat.qat.config.QATConfig
        self.config = config
        self.schedules = schedules
        self.step, self.total_steps = 0, 1

    def scheduled(self, model: Any) -> Iterator[Tuple[str, Any]]:
        """(schedule name, module) for every prepared module of ``model``."""
        raise NotImplementedError

    def set_step(self, model: Any, step: int, total_steps: int) -> str:
        """Set every module's format for ``step``; return the global schedule's format."""
        self.step, self.total_steps = step, total_steps
        for name, m in self.scheduled(model):
            sched = self.schedules.get(name)
            if sched is not None:
                m.fmt = self.config.layer_format_at(sched, step, total_steps)
        return self.current_format()

    def step_formats(self, step: int, total_steps: int) -> List[str]:
        """The formats one optimizer step trains (``QATConfig.step_formats``)."""
        return self.config.step_formats(step, total_steps)

    def current_format(self) -> str:
        """The global schedule's format at the current step (the highest of a joint step)."""
        return self.config.step_formats(self.step, self.total_steps)[0]
