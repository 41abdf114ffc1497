"""``mfqat export-mlx`` refines affine plans by default (issue 49): steps by model size, the cost announced
first, ``--no-refine`` for the derived scales, MX plans and widths the anchor already stores exported as
they are."""
import json
import shutil

import pytest

pytest.importorskip("mlx_lm")

import mfqat  # noqa: E402
from .conftest import one_line_exit_2  # noqa: E402
from mfqat.anchor.checkpoint import read_anchor  # noqa: E402
from mfqat.cli import main  # noqa: E402
from mfqat.export import build_plan  # noqa: E402
from mfqat.export.refine import NOTHING_TO_LEARN, ONLY_WHEN_ASKED, STEPS_BY_SIZE, RefineConfig, default_steps, plan_refine  # noqa: E402


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(d.glob("*.safetensors"))}


def _report(d) -> dict:
    return json.loads((d / "mfqat_export.json").read_text())


@pytest.fixture(scope="module")
def default_export(anchor, tmp_path_factory):
    """``export-mlx ANCHOR --recipe uniform:affine4`` with no refine flag, and its stderr."""
    d = tmp_path_factory.mktemp("default") / "mlx"
    main(["export-mlx", str(anchor), "--out", str(d), "--recipe", "uniform:affine4"])
    return d


def test_an_affine_export_is_refined_by_default_with_steps_by_model_size(default_export, anchor):
    r = _report(default_export)["refine"]
    assert r["steps"] == 64 and r["steps_from"].startswith("model size") and r["kept"]
    assert r["estimated_seconds"] > 0 and r["validation_kl_after"] < r["validation_kl_before"]
    plain = mfqat.export.to_mlx(anchor, default_export.parent / "plain", recipe="uniform:affine4")
    assert plain["stored_bytes"] == _report(default_export)["stored_bytes"]  # same bytes ...
    assert _files(default_export) != _files(default_export.parent / "plain")  # ... other scales and biases


def test_no_refine_writes_the_derived_scales(anchor, tmp_path, capsys):
    main(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--recipe", "uniform:affine4", "--no-refine"])
    assert "refine" not in _report(tmp_path / "x")
    assert "refine" not in capsys.readouterr().err
    mfqat.export.to_mlx(anchor, tmp_path / "api", recipe="uniform:affine4")  # the API's default: no refine
    assert _files(tmp_path / "x") == _files(tmp_path / "api")


def test_the_refine_is_announced_with_its_cost_before_it_runs(anchor, tmp_path, capsys):
    main(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--recipe", "uniform:affine4", "--refine-steps", "2"])
    cap = capsys.readouterr()
    line = next(x for x in cap.err.splitlines() if x.startswith("refine: "))
    assert "2 steps of 4 x 128 tokens" in line and "min here" in line and "--no-refine skips it" in line
    assert cap.err.index(line) < cap.err.index("refine scales/biases")  # before the progress bar
    assert "2 steps" in cap.out and "estimated" in cap.out  # the summary line
    assert _report(tmp_path / "x")["refine"]["steps_from"] == "given"


def test_an_mx_plan_is_exported_unrefined_by_default_and_the_anchors_own_format_refused_with_refine(
        anchor, tmp_path, capsys):
    main(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--recipe", "uniform:mxint4"])
    assert _report(tmp_path / "x")["refine"] == {"skipped": ONLY_WHEN_ASKED}
    assert "refine: skipped: MX block exponents are learned only with --refine" in \
        capsys.readouterr().out
    mfqat.export.to_mlx(anchor, tmp_path / "api", recipe="uniform:mxint4")
    assert _files(tmp_path / "x") == _files(tmp_path / "api")
    main(["export-mlx", str(anchor), "--out", str(tmp_path / "z"), "--recipe", "uniform:mxint8"])
    assert _report(tmp_path / "z")["refine"] == {"skipped": NOTHING_TO_LEARN}
    capsys.readouterr()
    one_line_exit_2(["export-mlx", str(anchor), "--out", str(tmp_path / "y"), "--recipe", "uniform:mxint8",
                     "--refine"], capsys, "nothing to learn): choose a lower format")  # up front, before any work
    assert not (tmp_path / "y").exists()


def test_widths_the_anchor_stores_are_used_not_learned_again(anchor, tmp_path, capsys):
    a = tmp_path / "a"
    shutil.copytree(anchor, a)
    main(["refine", str(a), "--formats", "affine4", "--steps", "2", "--lr", "3e-3"])
    main(["export-mlx", str(a), "--out", str(tmp_path / "x"), "--recipe", "uniform:affine4"])
    rep = _report(tmp_path / "x")
    assert rep["refine"]["skipped"].startswith("the anchor stores learned scales for affine4")
    assert rep["anchor_refined"] == ["affine4"]
    plan = build_plan(read_anchor(a), "uniform:affine3")  # a width the anchor does not store is learned
    assert len(plan_refine(read_anchor(a), plan, RefineConfig(optional=True))["names"]) == len(plan.formats)


def test_refine_flags_that_contradict_each_other_are_refused(anchor, tmp_path, capsys):
    one_line_exit_2(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--no-refine", "--refine-steps", "3"],
                    capsys, "--refine-steps 3 with --no-refine")
    with pytest.raises(SystemExit) as e:
        main(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--refine", "--no-refine"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_default_steps_shrink_with_the_model_and_count_every_parameter(anchor, tok):
    assert [default_steps(n) for n in (135e6, 0.3e9, 0.5e9, 1.2e9, 3e9, 4e9, 8e9, 70e9)] == [64, 64, 32, 16, 16, 16, 8, 8]
    assert [s for _, s in STEPS_BY_SIZE] == sorted((s for _, s in STEPS_BY_SIZE), reverse=True)
    from mfqat.data.sources import tiny_llama

    model = tiny_llama(vocab_size=len(tok), tie=True)  # the anchor's model: tied head counted once
    a = read_anchor(anchor)
    planned = plan_refine(a, build_plan(a, "uniform:affine4"), RefineConfig(optional=True))
    assert planned["parameters"] == sum(p.numel() for p in model.parameters())
