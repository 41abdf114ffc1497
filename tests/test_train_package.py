"""mfqat/train: the old import paths under mfqat.integrations still work (one release, with a
DeprecationWarning)."""
import importlib
import sys

import pytest

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
