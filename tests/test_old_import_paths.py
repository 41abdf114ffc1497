"""Modules renamed for what they hold (issue 46) keep their old import paths one release: the old name
is the new module itself (never a second copy) and importing it warns, naming the new path; names renamed
inside them (the learned scales, once "refined") keep working the same way."""
import importlib
import re
import sys

import pytest

MOVED = {"mfqat.qlora": "mfqat.mxqlora", "mfqat.qlora.model": "mfqat.mxqlora.model",
         "mfqat.qlora.train": "mfqat.mxqlora.train", "mfqat.qlora.mlx_adapter": "mfqat.mxqlora.mlx_adapter",
         "mfqat.export.storage": "mfqat.export.mlx_sizes", "mfqat.anchor.refined": "mfqat.anchor.learned_scales",
         "mfqat.anchor.refined_store": "mfqat.anchor.learned_scales_store"}


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


def test_an_old_function_name_from_an_old_path_is_the_new_function_and_warns(monkeypatch):
    from mfqat.anchor import learned_scales, learned_scales_store
    monkeypatch.delitem(sys.modules, "mfqat.anchor.refined", raising=False)
    with pytest.warns(DeprecationWarning, match=r"mfqat\.anchor\.learned_scales\.read_refined is now "
                                                r"mfqat\.anchor\.learned_scales\.read_learned_scales"):
        from mfqat.anchor.refined import read_refined
    assert read_refined is learned_scales.read_learned_scales
    with pytest.warns(DeprecationWarning, match="add_refined is now"):
        assert learned_scales_store.add_refined is learned_scales_store.add_learned_scales
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        learned_scales.nope


def test_the_old_refined_attributes_read_and_set_the_learned_scales(anchor):
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.export.recipes import Plan
    a, plan = read_anchor(anchor), Plan()
    for obj, cls in ((a, "Anchor"), (plan, "Plan")):
        with pytest.warns(DeprecationWarning, match=rf"{cls}\.refined is now {cls}\.learned_scales"):
            assert obj.refined is obj.learned_scales
        with pytest.warns(DeprecationWarning):
            obj.refined = {"x": 1}
        assert obj.learned_scales == {"x": 1}
