"""Modules renamed for what they hold (issue 46) keep their old import paths one release: the old name
is the new module itself (never a second copy) and importing it warns, naming the new path."""
import importlib
import re
import sys

import pytest

MOVED = {"mfqat.qlora": "mfqat.mxqlora", "mfqat.qlora.model": "mfqat.mxqlora.model",
         "mfqat.qlora.train": "mfqat.mxqlora.train", "mfqat.qlora.mlx_adapter": "mfqat.mxqlora.mlx_adapter",
         "mfqat.export.storage": "mfqat.export.mlx_sizes"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_is_the_new_module_and_warns(old, monkeypatch):
    new = importlib.import_module(MOVED[old])
    monkeypatch.delitem(sys.modules, old, raising=False)  # a fresh import, as a user's first one
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} moved to {re.escape(MOVED[old])};"):
        mod = importlib.import_module(old)
    assert mod is new and sys.modules[old] is new  # the same object: classes, patches and private names agree


def test_names_from_an_old_submodule_path_are_the_new_ones_and_the_warning_names_the_importer(monkeypatch):
    from mfqat.mxqlora import model
    for name in ("mfqat.qlora", "mfqat.qlora.model"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.warns(DeprecationWarning) as seen:
        from mfqat.qlora.model import MXFrozenLinear, mx_qlora_model
    assert MXFrozenLinear is model.MXFrozenLinear and mx_qlora_model is model.mx_qlora_model
    assert {w.filename for w in seen if w.category is DeprecationWarning} == {__file__}  # the user's line
