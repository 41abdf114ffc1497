"""OUT/summary.json of every training command (`mfqat train`, `mfqat mx-qlora`, `mfqat mlx-train`):
one writer, one set of key names, one closing line.

Every summary starts with ``steps`` (the run's last step), ``train_seconds`` (this invocation's
training time), ``seconds_per_step`` (``train_seconds`` / the steps this invocation ran: a resumed run
counts from where it resumed), ``final_loss`` and ``losses`` (this invocation's per-step losses);
each command adds its own keys after them (``eval``, ``peak_memory_mib``, what it saved).
"""
from __future__ import annotations

import json
from typing import List, Optional

from mfqat.eval.report import format_table
from mfqat.storage.io import RunFolder

# Old key -> its current name. A summary asked for an old key (``old_keys``) holds both, the same
# value, until the next release (`mfqat mx-qlora` wrote only ``s_per_step`` up to 0.1.0).
RENAMED = {"s_per_step": "seconds_per_step"}


def run_summary(steps: int, train_seconds: float, losses: List[float], old_keys: tuple = (), **extra) -> dict:
    """The shared head of a training summary (module docstring), then ``extra`` in order, then any
    ``old_keys`` (names from :data:`RENAMED`) with their new key's value."""
    summary = {"steps": steps, "train_seconds": train_seconds,
               "seconds_per_step": train_seconds / max(1, len(losses)),
               "final_loss": losses[-1] if losses else None, "losses": losses, **extra}
    for old in old_keys:
        summary[old] = summary[RENAMED[old]]
    return summary


def write_summary(run: RunFolder, summary: dict, where: str, memory: Optional[str] = None) -> None:
    """Write OUT/summary.json, then print the ``eval`` rows as a table and the run's closing line
    (steps, time, s/step, final loss, ``memory`` (default: the peak from ``peak_memory_mib``), ``where``)."""
    run.write_text("summary.json", json.dumps(summary, indent=2))
    print(format_table(summary.get("eval", []), ["format", "bits/weight", "perplexity"]))
    if memory is None:
        memory = f"peak memory={summary['peak_memory_mib']:.0f} MiB"
    print(f"steps={summary['steps']} time={summary['train_seconds']:.1f}s ({summary['seconds_per_step']:.2f} s/step) "
          f"final loss={summary['final_loss']} {memory} {where}")
