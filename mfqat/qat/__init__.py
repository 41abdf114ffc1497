"""MF-QAT: modules, prepare(), format schedules."""
from .config import QATConfig
from .importance_state import forget_searched_exponents, sync_importance
from .joint import joint_backward
from .modules import MFQATEmbedding, MFQATLinear
from .observers import WindowMinMaxObserver, clip_rates, mean_clip_rate
from .prepare import MFQATController, prepare, qat_modules, set_format, unprepare
from .schedules import (CyclicSchedule, FixedSchedule, JointSchedule, ProgressiveSchedule, RandomSchedule,
                        Schedule, make_schedule)

__all__ = ["QATConfig", "MFQATLinear", "MFQATEmbedding", "MFQATController", "prepare", "unprepare",
           "set_format", "qat_modules", "Schedule", "ProgressiveSchedule", "CyclicSchedule",
           "RandomSchedule", "FixedSchedule", "JointSchedule", "make_schedule", "joint_backward",
           "WindowMinMaxObserver", "clip_rates", "mean_clip_rate", "sync_importance",
           "forget_searched_exponents"]
