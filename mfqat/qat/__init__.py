"""MF-QAT: modules, prepare(), format schedules."""
from mfqat.qat.config import QATConfig
from mfqat.qat.importance_state import forget_searched_exponents, sync_importance
from mfqat.qat.joint import joint_backward
from mfqat.qat.modules import MFQATEmbedding, MFQATLinear
from mfqat.qat.observers import WindowMinMaxObserver, clip_rates, mean_clip_rate
from mfqat.qat.prepare import MFQATController, prepare, qat_modules, set_format, unprepare
from mfqat.qat.schedules import (CyclicSchedule, FixedSchedule, JointSchedule, ProgressiveSchedule, RandomSchedule,
                        Schedule, make_schedule)

__all__ = ["QATConfig", "MFQATLinear", "MFQATEmbedding", "MFQATController", "prepare", "unprepare",
           "set_format", "qat_modules", "Schedule", "ProgressiveSchedule", "CyclicSchedule",
           "RandomSchedule", "FixedSchedule", "JointSchedule", "make_schedule", "joint_backward",
           "WindowMinMaxObserver", "clip_rates", "mean_clip_rate", "sync_importance",
           "forget_searched_exponents"]
