"""The lazily filled model (mfqat.export.lazy_model: --refine's teacher and student, the auto: sensitivity
pass) computes the logits of the model loaded whole, bit for bit, for every family mfqat supports - also
where a layer reads a child's weights without calling it (Qwen3.5 / Qwen3-Next's Gated DeltaNet hands
``conv1d.weight`` to a kernel: before the fix those weights stayed on the meta device and the logits were
garbage, different on every call)."""
import pytest
import torch

import mfqat
from mfqat.anchor.checkpoint import anchor_model
from mfqat.export.lazy_model import LazyModel, anchor_source
from mfqat.models.catalog import SUPPORTED, build


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_lazy_logits_equal_the_loaded_models_in_every_family(name, tmp_path):
    model_type, extra = SUPPORTED[name]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8")
    anchor = mfqat.read_anchor(path, lazy=True)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = anchor_model(mfqat.read_anchor(path))(input_ids=ids, use_cache=False).logits
        lazy = LazyModel(anchor)
        first, again = lazy.logits(anchor_source(anchor), ids), lazy.logits(anchor_source(anchor), ids)
    assert torch.equal(first, want), f"{name}: max diff {(first - want).abs().max().item()}"
    assert torch.equal(again, want)
    checkpointed = LazyModel(anchor).logits(anchor_source(anchor), ids)  # autograd on: layers checkpointed
    assert torch.equal(checkpointed.detach(), want)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_the_refine_students_lean_embedding_and_head_run_every_family(name, tmp_path, monkeypatch):
    """mfqat.export.lean_matrices in every family (tied ones forced lean): the student's logits equal those of the
    whole matrices bit for bit, and a backward through them gives the same gradients (to rounding where tied)."""
    from mfqat.export import lean_matrices
    from mfqat.export.lean_matrices import LeanMatrices
    from mfqat.export.recipes import build_plan
    from mfqat.export.refine import _lean_markers, _learner, _student_source

    monkeypatch.setattr(lean_matrices, "LEAN_MATRIX_BYTES", 0)
    model_type, extra = SUPPORTED[name]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8")
    anchor = mfqat.read_anchor(path, lazy=True)
    plan = build_plan(anchor, "uniform:affine4", derived_group=32)  # the tiny models' widths
    groups = {n: _learner(anchor, plan, n) for n in plan.formats}
    lazy = LazyModel(anchor)
    markers = _lean_markers(lazy, groups)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for lean in ({}, markers):
        source = _student_source(anchor, plan, groups, anchor_source(anchor), lean)
        with LeanMatrices({id(m): groups[n] for n, m in lean.items()}):
            logits = lazy.logits(source, ids)
        logits.float().square().mean().backward()
        results.append((logits.detach(), {n: (g.a.grad.clone(), g.c.grad.clone()) for n, g in groups.items()
                                          if g.a.grad is not None}))
        for g in groups.values():
            g.a.grad = g.c.grad = None
    (whole, whole_grads), (lean_logits, lean_grads) = results
    assert markers, f"{name}: no lean embedding or head"
    assert torch.equal(lean_logits, whole), f"{name}: max diff {(lean_logits - whole).abs().max().item()}"
    assert sorted(lean_grads) == sorted(whole_grads)
    for n, (a, c) in whole_grads.items():
        torch.testing.assert_close(lean_grads[n][0], a, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(lean_grads[n][1], c, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_lazy_importance_equals_the_held_models_in_every_family(name, tmp_path):
    """--scale-search's importance measured module by module (mfqat.export.scale_search.lazy_importance, what
    export-mlx, eval and convert use) is the whole float32 model's (held_importance), bit for bit, and the marks it
    leaves on a lazily read anchor reach every tensor it builds afterwards."""
    from mfqat.anchor.search import held_importance, search_scales
    from mfqat.export.scale_search import lazy_importance

    model_type, extra = SUPPORTED[name]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8")
    calib = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    want = held_importance(mfqat.read_anchor(path), calib, batch_size=2)
    anchor = mfqat.read_anchor(path, lazy=True)
    got = lazy_importance(anchor, calib, batch_size=2)
    assert sorted(got) == sorted(want) and want, name
    for k in want:
        assert torch.equal(got[k], want[k]), f"{name}: {k}"
    marked = search_scales(anchor, calib, "mxint4", batch_size=2, measure=lazy_importance)["tensors"]
    notes = [n for n in anchor.quantized if anchor.quantized[n].importance is not None]
    assert marked == len(notes) > 0
    for n in notes:
        q = anchor.quantized[n]  # built again from the files: the marks are given to it again
        assert q.slice_rules["mxint4"] == "search" and torch.equal(q.importance, want[n[: -len(".weight")]])
