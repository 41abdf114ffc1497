"""Per-tensor affine groups: ``export-mlx --group-size 64,128 --recipe auto:BPW:affine`` gives the plan levels in
groups of 128 too (``affine3@g128``: 3.25 bits where affine3 in groups of 64 stores 3.5), which a tensor takes
only when its rows divide into them; the bits a coarser group frees go to the tensors that need them, the
written config gives each module its own group, and MLX reads it bit for bit."""
import json
import re

import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.export import sensitivity
from mfqat.export.mlx_export import plan_from_report, to_mlx
from mfqat.export.sensitivity import BudgetTooSmall, TensorSensitivity, allocate, ladder
from mfqat.formats import base_name, get_format, grouped
from mfqat.quant.derive import derive, fake_derive
from .conftest import one_line_exit_2

CALIB = "def f(x):\n    return x + 1\n" * 200


def test_a_grouped_format_is_its_width_in_its_own_group():
    f = get_format("affine3@g128")
    assert (f.name, f.family, f.bits, f.group, f.bits_per_weight()) == ("affine3@g128", "affine", 3, 128, 3.25)
    assert grouped("affine3", 32) == "affine3@g32" and base_name("affine3@g32") == "affine3"
    for bad in ("affine3@g96", "mxint4@g128", "affine3@g", "affine9@g64"):
        with pytest.raises(ValueError, match="affineK@gN with N one of 32, 64, 128"):
            get_format(bad)


@pytest.mark.parametrize("group", [32, 128])
def test_derived_in_a_grouped_format_is_the_width_at_that_group_whatever_the_caller_asks(group):
    """The caller's group (64, an export's --group-size) never overrides the format's own."""
    w = torch.randn(8, 256)
    q = derive(w, f"affine3@g{group}", 64)
    ref = derive(w, "affine3", group)
    assert q.block_size == group
    assert torch.equal(q.dequantize(torch.float32), ref.dequantize(torch.float32))
    assert torch.equal(fake_derive(w, f"affine3@g{group}", 64), fake_derive(w, "affine3", group))


def test_the_ladder_orders_the_grouped_levels_by_their_bits():
    assert ladder("mxint8", "affine", (128, 32), 64)[:5] == ["affine3@g128", "affine3", "affine3@g32", "affine4@g128",
                                                             "affine4"]
    assert ladder("mxint8", "affine", (64,), 64) == ladder("mxint8", "affine")  # the export's own group: no level
    with pytest.raises(ValueError, match="affine family"):
        ladder("mxint8", "mxint", (128,))


def test_the_greedy_fallback_takes_the_upgrade_that_buys_most_per_bit_past_a_grouped_step(monkeypatch):
    """From affine3@g128, a's next level (affine3, +0.25 bit) buys little and affine4@g128 (+1 bit) buys much:
    the one bit of budget goes to a's big step (cost 0.3 + 1.0), as the exact plan does, not to c's first step
    (0.6 per bit, more than a's next level's 0.08) and then c's second (1.02 + 0.75)."""
    levels = ladder("mxint8", "affine", (128,), 64)[:4]
    sens = {"a": _sens("a", 1024, {"affine3@g128": 1.02, "affine3": 1.0, "affine4@g128": 0.3, "affine4": 0.28}),
            "c": _sens("c", 1024, {"affine3@g128": 1.0, "affine3": 0.85, "affine4@g128": 0.75, "affine4": 0.74})}
    exact = allocate(sens, levels, 3.75, 64)
    monkeypatch.setattr(sensitivity, "_allocate_exact", lambda *a, **k: None)
    assert allocate(sens, levels, 3.75, 64) == exact == {"a": "affine4@g128", "c": "affine3@g128"}


def test_an_anchors_learned_scales_at_a_group_serve_its_grouped_level():
    """Scales learnt for affine3 in groups of 128 (mfqat refine --group-size 128) are affine3@g128's too."""
    from mfqat.anchor.learned_scales import LearnedWidth, pick

    stored = {"affine3": LearnedWidth("affine3", 128, info={})}
    assert pick(stored, "affine3@g128", 128) is stored["affine3"]
    assert pick(stored, "affine3@g64", 64) is None and pick(stored, "affine4@g128", 128) is None


def _sens(name, numel, errors):
    return TensorSensitivity(name, numel, "affine3", 1.0, errors)


@pytest.mark.parametrize("exact", [True, False])
def test_a_coarser_group_frees_the_bits_another_tensor_needs_and_never_goes_where_it_does_not_fit(exact, monkeypatch):
    """Tensor a (its rows divide by 128) loses little in groups of 128; b (they do not) gains much from 4 bits.
    At 3.875 bits/weight b reaches affine4 only if a drops to affine3@g128 (3.25 + 4.5; 3.5 + 4.5 is over):
    the dynamic programme and the greedy fallback both find it, and b is never given a @g128 level."""
    if not exact:
        monkeypatch.setattr(sensitivity, "_allocate_exact", lambda *a, **k: None)
    levels = ladder("mxint8", "affine", (128,), 64)[:4]  # affine3@g128, affine3, affine4@g128, affine4
    sens = {"a": _sens("a", 1024, {"affine3@g128": 0.11, "affine3": 0.10, "affine4@g128": 0.05, "affine4": 0.025}),
            "b": _sens("b", 1024, {"affine3": 1.0, "affine4": 0.2})}
    assert allocate(sens, levels, 3.875, 64) == {"a": "affine3@g128", "b": "affine4"}
    assert allocate(sens, levels, 3.8, 64) == {"a": "affine3", "b": "affine3"}  # the saved bits buy nothing here
    with pytest.raises(BudgetTooSmall, match="smallest plan: 3.375"):  # b cannot take affine3@g128
        allocate(sens, levels, 3.3, 64)


@pytest.fixture(scope="module")
def anchor(tok, tmp_path_factory):
    """An mxint8 anchor of a tiny Llama whose only matrices that divide by 128 are the down projections (hidden
    192 = 1.5 x 128, intermediate 512)."""
    model = tiny_llama(vocab_size=len(tok), hidden=192, intermediate=512, heads=2, tie=True)
    return mfqat.save_anchor(model, tmp_path_factory.mktemp("groups") / "anchor", "mxint8", tok)


def _floor(anchor, tmp_path, groups):
    with pytest.raises(BudgetTooSmall) as e:
        to_mlx(anchor, tmp_path / "low", recipe="auto:2:affine", calib_text=CALIB, group_size=groups)
    return float(re.search(r"ask for auto:([\d.]+):affine", str(e.value)).group(1))


def test_a_budget_only_grouped_levels_reach_is_met_and_written_with_each_modules_group(anchor, tmp_path):
    """The smallest plan with groups of 128 holds every down projection in affine3@g128: a budget under the
    smallest plan in groups of 64 is refused without them and met with them, the down projections stored in
    groups of 128 in config.json, every other matrix in 64, bit for bit in MLX (the export's own check)."""
    alone, with_128 = _floor(anchor, tmp_path, 64), _floor(anchor, tmp_path, (64, 128))
    assert with_128 < alone
    rep = to_mlx(anchor, tmp_path / "o", recipe=f"auto:{with_128}:affine", calib_text=CALIB, group_size=(64, 128))
    assert rep["stored_bits_per_weight"] <= with_128 and rep["verify"]["weights_bit_exact"]
    planned = {n: (t["source"], t["group_size"]) for n, t in rep["tensors"].items() if "source" in t}
    assert {n: p for n, p in planned.items() if "down_proj" in n} == {
        f"model.layers.{i}.mlp.down_proj.weight": ("affine3@g128", 128) for i in range(2)}
    assert all(g == 64 for n, (_, g) in planned.items() if "down_proj" not in n)
    quant = json.loads((tmp_path / "o" / "config.json").read_text())["quantization"]
    assert quant["group_size"] == 64
    assert all(quant[f"model.layers.{i}.mlp.down_proj"] == {"group_size": 128, "bits": 3, "mode": "affine"}
               for i in range(2))
    last = dict(sorted(rep["tensors"].items(), key=lambda kv: "down_proj" in kv[0]))  # a grouped tensor read last
    plan = plan_from_report({**rep, "tensors": last})  # the report gives the plan back, each tensor in its group
    assert {n: plan.group_of(f) for n, f in plan.formats.items()} == {n: g for n, (_, g) in planned.items()}
    from mlx_lm import load

    load(str(tmp_path / "o"))


def test_several_groups_are_refused_for_a_recipe_that_is_not_an_affine_auto_plan(anchor, tmp_path, capsys):
    one_line_exit_2(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--recipe", "uniform:affine4",
                     "--group-size", "64,128"], capsys, "several groups are levels of an auto:BPW:affine plan")
    from mfqat.cli import main

    with pytest.raises(SystemExit) as e:  # argparse's own refusal (usage, then the reason)
        main(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--recipe", "auto:4:affine", "--group-size",
              "64,96"])
    assert e.value.code == 2 and "'64,96': give 32, 64 or 128" in capsys.readouterr().err
    with pytest.raises(ValueError, match="several group sizes"):
        to_mlx(anchor, tmp_path / "y", recipe="uniform:affine4", group_size=(64, 128))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
