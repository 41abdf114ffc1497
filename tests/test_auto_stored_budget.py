"""``auto:BPW`` budgets the stored bytes: the written export's stored bits/weight (every byte of its safetensors
files, norms and headers included, over the model's parameters: mlx_sizes.stored_size) never exceed BPW, and a
budget below the smallest plan is refused naming the recipe and the smallest stored budget, which is achievable."""
import json
import re

import pytest

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.export import sensitivity
from mfqat.export.mlx_export import to_mlx
from mfqat.export.mlx_sizes import tensor_bytes
from .conftest import one_line_exit_2

CALIB = "def f(x):\n    return x + 1\n" * 200


@pytest.fixture(scope="module")
def models(tok, tmp_path_factory):
    """{"tied"/"untied": an mxint8 anchor of a small float32 Llama (so MXINT scales are written in float32),
    "mxfp": the tied one as an mxfp8 anchor}."""
    d = tmp_path_factory.mktemp("stored_budget")
    return {name: mfqat.save_anchor(tiny_llama(vocab_size=len(tok), hidden=128, intermediate=256, tie=tie),
                                    d / name, fmt, tok)
            for name, tie, fmt in (("tied", True, "mxint8"), ("untied", False, "mxint8"), ("mxfp", True, "mxfp8"))}


def _export(anchor, out, recipe):
    return to_mlx(anchor, out, recipe=recipe, calib_text=CALIB, verify=False)


@pytest.mark.parametrize("tie", ["tied", "untied"])
@pytest.mark.parametrize("recipe", ["auto:4.2:affine", "auto:4.6:affine", "auto:5.3:affine", "auto:6", "auto:7.5"])
def test_the_written_export_stores_at_most_the_budget(models, tmp_path, tie, recipe):
    """Derived affine levels (bfloat16 scale and bias per 64) and MXINT levels (float32 scale and bias per
    32: mxint4 stores 6 bits) alike: the files hold at most BPW bits per parameter, and not far below it."""
    rep = _export(models[tie], tmp_path / "o", recipe)
    budget = float(recipe.split(":")[1])
    assert budget - 0.15 < rep["stored_bits_per_weight"] <= budget, rep["stored_bits_per_weight"]
    assert rep["bits_per_weight"] < rep["stored_bits_per_weight"]  # the nominal figure is still reported


@pytest.mark.parametrize("recipe", ["auto:6:mxfp", "auto:7.5:mxfp"])
def test_an_mxfp_plan_stores_at_most_the_budget(models, tmp_path, recipe):
    """mxfp6 is written as mxfp8 bytes: costed at 8.25 bits, never chosen over mxfp8 (more error, same bytes)."""
    rep = _export(models["mxfp"], tmp_path / "o", recipe)
    assert rep["stored_bits_per_weight"] <= float(recipe.split(":")[1])
    assert "mxfp6_e2m3" not in {t["source"] for t in rep["tensors"].values() if "source" in t}


@pytest.mark.parametrize("tie,recipe", [("tied", "auto:4.6:affine"), ("untied", "auto:7")])
def test_the_budget_counts_every_written_byte_up_to_the_header_bounds_slack(models, tmp_path, tie, recipe):
    """sensitivity.json's accounting (fixed bits + each chosen level's stored bits x its weights) against the
    files' bytes: never below them, and above by no more than the header bound's few bytes per entry. A part
    left out (the norms, the scales' bytes, the headers) puts the accounting hundreds of bytes short."""
    out = tmp_path / "o"
    rep = _export(models[tie], out, recipe)
    s = json.loads((out / "sensitivity.json").read_text())
    counted = (s["fixed_bits"] + sum(s["stored_level_bits"][t["chosen"]] * t["numel"] for t in s["tensors"].values())) / 8
    entries = len(tensor_bytes(out))
    assert s["parameters"] == rep["parameters"]
    assert 0 <= counted - rep["stored_bytes"] <= 6 * entries + 16, (counted, rep["stored_bytes"], entries)


def test_a_budget_below_the_smallest_plan_is_refused_naming_it_and_the_smallest_is_achievable(models, tmp_path,
                                                                                                monkeypatch):
    anchor = models["untied"]
    with monkeypatch.context() as m:  # refused before the sensitivity pass (minutes on a real model)
        m.setattr(sensitivity, "measure", lambda *a, **k: pytest.fail("measured before refusing the budget"))
        with pytest.raises(ValueError) as e:
            _export(anchor, tmp_path / "low", "auto:3.6:affine")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("recipe 'auto:3.6:affine': the budget is below the smallest plan"), msg
    floor = float(re.search(r"smallest plan: ([\d.]+) stored bits/weight", msg).group(1))
    ask = re.search(r"ask for (auto:[\d.]+:affine) or more", msg).group(1)
    assert floor < float(ask[5:-7]) <= floor + 0.01
    assert not (tmp_path / "low").exists()
    # the smallest plan is every tensor in affine3: uniform:affine3 stores just that (the floor's header bound
    # is an upper bound), and the suggested budget exports within itself
    lowest = to_mlx(anchor, tmp_path / "u3", recipe="uniform:affine3", verify=False)["stored_bits_per_weight"]
    assert lowest <= floor < lowest + 0.005, (lowest, floor)
    rep = _export(anchor, tmp_path / "ask", ask)
    assert rep["stored_bits_per_weight"] <= float(ask[5:-7])


def test_the_command_line_refuses_it_in_one_line_before_the_export_runs(models, tmp_path, capsys, monkeypatch):
    """4.05 is above the nominal floor (mxint2: 2.25) but below the stored one (mxint2 with float32 scale and
    bias per 32 stores 4 bits, plus the norms and headers): refused from the anchor's shapes, nothing loaded."""
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the export ran: the budget was not checked"))
    one_line_exit_2(["export-mlx", str(models["tied"]), "--out", str(tmp_path / "x"), "--recipe", "auto:4.05"], capsys,
                    "recipe 'auto:4.05': the budget is below the smallest plan")
    assert not (tmp_path / "x").exists()
