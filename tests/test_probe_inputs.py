"""The hostile-input probe battery (scripts/dev/probe_inputs.py) in its fast form: every bad input that the
command line refuses before any training ends in one line with a non-zero status, and no user file is
changed or deleted (issue 47). The full battery (training checkpoints, one process per input) stays a
script: `python scripts/dev/probe_inputs.py`."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _probe_module():
    spec = importlib.util.spec_from_file_location("probe_inputs", ROOT / "scripts" / "dev" / "probe_inputs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_fast_probe_battery_refuses_every_input_and_loses_nothing():
    rows, bad, lost = _probe_module().run_probes(fast=True)
    failed = [r for r in rows if r[2].endswith("<-- FAIL")]
    assert not failed and not bad, failed
    assert not lost, lost
    assert len(rows) >= 40
    assert all(r[1] in ("2", "-") for r in rows), [r for r in rows if r[1] not in ("2", "-")]
