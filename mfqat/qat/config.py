"""QATConfig: what to quantize, in which formats, on which schedule (loadable from YAML)."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Union

import yaml

from ..formats import canonical_name
from .schedules import SCHEDULES, Schedule, make_schedule

DEFAULT_TARGETS = r"(^|\.)(layers|h|blocks)\.\d+(\.|$)"


def _patterns(p: Union[str, List[str], None]) -> List[re.Pattern]:
    if p is None:
        return []
    return [re.compile(x) for x in ([p] if isinstance(p, str) else p)]


def _matches(name: str, pats: List[re.Pattern]) -> bool:
    return any(p.search(name) for p in pats)


@dataclass
class QATConfig:
    """MF-QAT configuration.

    Attributes:
        formats: the formats the schedule visits (e.g. mxint2, mxint4, mxint6, mxint8).
        schedule: progressive | cyclic | random | fixed.
        block_size: MX block size along in_features.
        targets: regex (or list of regexes) on module names; default: every Linear in the
            decoder blocks. Add ``lm_head`` to quantize the output projection too.
        exclude: regex (or list) of names never quantized.
        quantize_embeddings: also fake-quantize nn.Embedding weights (blocks along hidden).
        quantize_activations / activation_format: MX fake-quant of Linear inputs (reduction axis).
        scale_rule: floor (OCP) or ceil.
        seed: for the random schedule.
        repeats: ramps of the progressive schedule.
        layer_formats: {regex: [formats]} per-layer format sets (same schedule kind).
        mask_saturated: zero the STE gradient of saturated elements.
    """

    formats: List[str] = field(default_factory=lambda: ["mxint2", "mxint4", "mxint6", "mxint8"])
    schedule: str = "progressive"
    block_size: int = 32
    targets: Union[str, List[str]] = DEFAULT_TARGETS
    exclude: Union[str, List[str], None] = None
    quantize_embeddings: bool = False
    quantize_activations: bool = False
    activation_format: Optional[str] = None
    scale_rule: str = "floor"
    seed: int = 0
    repeats: int = 1
    layer_formats: Dict[str, List[str]] = field(default_factory=dict)
    mask_saturated: bool = False

    def __post_init__(self) -> None:
        self.formats = [canonical_name(f) for f in self.formats]
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule '{self.schedule}'; choose one of {SCHEDULES}")
        if self.quantize_activations and not self.activation_format:
            self.activation_format = "mxfp8_e4m3"
        self.layer_formats = {k: [canonical_name(f) for f in v] for k, v in self.layer_formats.items()}
        self.make_schedule()  # validates the formats early

    def excludes(self, name: str) -> bool:
        """True when the module ``name`` matches ``exclude``."""
        return _matches(name, _patterns(self.exclude))

    def selects(self, name: str) -> bool:
        """True when the module ``name`` is targeted and not excluded (shared by PyTorch and MLX)."""
        return _matches(name, _patterns(self.targets)) and not self.excludes(name)

    def schedule_for(self, name: str) -> Schedule:
        """The schedule of module ``name``: its ``layer_formats`` entry if one matches, else the global one."""
        fmts = next((v for k, v in self.layer_formats.items() if re.search(k, name)), None)
        return self.make_schedule(fmts)

    def make_schedule(self, formats: Optional[List[str]] = None) -> Schedule:
        """The schedule object for the global (or a per-layer) format list."""
        return make_schedule(self.schedule, formats or self.formats, self.seed, self.repeats)

    @classmethod
    def from_yaml(cls, path: Union[str, Path]) -> "QATConfig":
        """Load a config file (keys as the attributes; unknown keys are an error)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        data = data.get("qat", data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown QATConfig keys {sorted(unknown)}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict:
        """Plain dict (for mfqat.json and logs)."""
        return dataclasses.asdict(self)
