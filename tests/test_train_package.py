"""mfqat/train: the old import paths under mfqat.integrations still work (one release, with a
DeprecationWarning), and the run-summary writer every training command shares."""
import importlib
import json
import sys

import pytest

from mfqat.storage.io import RunFolder
from mfqat.train.summary import run_summary, write_summary

MOVED = {"train_loop": "loop", "train_args": "args", "train_setup": "setup", "optim": "optim", "fsdp": "fsdp",
         "grad_compress": "grad_compress", "lora": "lora"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_is_the_new_module_and_warns(old, monkeypatch):
    name = f"mfqat.integrations.{old}"
    monkeypatch.delitem(sys.modules, name, raising=False)  # a fresh import, as a user's first one
    new = importlib.import_module(f"mfqat.train.{MOVED[old]}")
    with pytest.warns(DeprecationWarning, match=rf"{name} moved to mfqat\.train\.{MOVED[old]}"):
        mod = importlib.import_module(name)
    assert mod is new and sys.modules[name] is new  # the same object: patches and private names reach it


def test_from_an_old_path_imports_the_new_functions(monkeypatch):
    monkeypatch.delitem(sys.modules, "mfqat.integrations.train_loop", raising=False)
    with pytest.warns(DeprecationWarning):
        from mfqat.integrations.train_loop import _forever, main
    from mfqat.train import loop
    assert main is loop.main and _forever is loop._forever


def test_seconds_per_step_counts_the_steps_this_invocation_ran():
    s = run_summary(10, 6.0, [3.0, 2.5, 2.0], start_step=7)  # a run resumed at step 7 of 10
    assert s["seconds_per_step"] == 2.0 and s["final_loss"] == 2.0 and s["steps"] == 10
    assert list(s)[:5] == ["steps", "train_seconds", "seconds_per_step", "final_loss", "losses"]
    assert run_summary(0, 0.5, [])["seconds_per_step"] == 0.5 and run_summary(0, 0.5, [])["final_loss"] is None


def test_an_old_key_holds_its_new_keys_value():
    s = run_summary(2, 3.0, [1.0, 1.0], old_keys=("s_per_step",))
    assert s["s_per_step"] == s["seconds_per_step"] == 1.5


def test_write_summary_writes_the_file_and_the_closing_line(tmp_path, capsys):
    run = RunFolder(tmp_path / "o", "train").start()
    s = run_summary(4, 2.0, [1.5, 1.25], peak_memory_mib=123.4,
                    eval=[{"format": "mxint4", "bits/weight": 4.25, "perplexity": 9.5}])
    write_summary(run, s, "out=X")
    assert json.loads((tmp_path / "o" / "summary.json").read_text()) == s
    out = capsys.readouterr().out
    assert "mxint4" in out and "steps=4 time=2.0s (1.00 s/step) final loss=1.25 peak memory=123 MiB out=X" in out
