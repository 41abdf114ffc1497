"""MF-QAT: modules, prepare(), format schedules."""
from .config import QATConfig
from .modules import MFQATEmbedding, MFQATLinear
from .prepare import MFQATController, prepare, qat_modules, set_format, unprepare
from .schedules import (CyclicSchedule, FixedSchedule, ProgressiveSchedule, RandomSchedule, Schedule,
                        make_schedule)

__all__ = ["QATConfig", "MFQATLinear", "MFQATEmbedding", "MFQATController", "prepare", "unprepare",
           "set_format", "qat_modules", "Schedule", "ProgressiveSchedule", "CyclicSchedule",
           "RandomSchedule", "FixedSchedule", "make_schedule"]
