"""scripts/bench/bench_pareto.py's bookkeeping: the sensitivity passes it keeps between calls, and the
recipe suffixes it turns into export options (the exports themselves are tested in test_mlx_export.py)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("mlx_lm")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))
import bench_pareto  # noqa: E402

import mfqat.export.sensitivity as sensitivity  # noqa: E402


def test_a_sensitivity_pass_is_kept_per_calibration_tokens_and_reused_by_a_later_call(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sensitivity, "measure", lambda anchor, names, probe, blocks, levels=None, derived_group=64:
                        calls.append(blocks.sum().item()) or {"pass": len(calls)})
    anchor_dir = tmp_path / "anchor"
    anchor_dir.mkdir()
    (anchor_dir / "mfqat.json").write_text("{}")
    anchor = SimpleNamespace(path=anchor_dir)
    pydoc, other = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    real = sensitivity.measure
    bench_pareto.measure_each_probe_once(tmp_path / "store")
    first = sensitivity.measure(anchor, ["w"], "affine3", pydoc, ["affine3", "affine4"], 64)
    assert sensitivity.measure(anchor, ["w"], "affine3", pydoc, ["affine3", "affine4"], 64) == first
    assert sensitivity.measure(anchor, ["w"], "affine3", other, ["affine3", "affine4"], 64) != first  # other text
    assert len(calls) == 2
    sensitivity.measure = real  # a later call of the script: a fresh wrapper, the same store
    bench_pareto.measure_each_probe_once(tmp_path / "store")
    assert sensitivity.measure(anchor, ["w"], "affine3", pydoc, ["affine3", "affine4"], 64) == first
    assert len(calls) == 2


def test_recipe_suffixes_set_the_group_the_refine_and_the_calibration_text(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(bench_pareto, "to_mlx", lambda anchor, dest, **kw: seen.update(kw))
    monkeypatch.setattr("mfqat.data.mix.mixed_text",
                        lambda spec, model=None, n_blocks=None: f"text of {spec} from {model} for {n_blocks}")
    bench_pareto.mfqat_export(tmp_path / "anchor", tmp_path / "out", "auto:3.79:affine@g32+refine16/b96", "pydoc:1")
    assert seen["recipe"] == "auto:3.79:affine" and seen["group_size"] == 32
    assert (seen["refine"].steps, seen["refine"].n_blocks) == (16, 96)
    assert seen["calib_text"] == f"text of pydoc:1 from {tmp_path / 'anchor'} for 100"  # generated: sized to 96 + 4
    bench_pareto.mfqat_export(tmp_path / "anchor", tmp_path / "out7", "auto:3.79:affine+gptq/b192", "generated")
    assert seen["calib_text"] == f"text of generated from {tmp_path / 'anchor'} for 192"
    bench_pareto.mfqat_export(tmp_path / "anchor", tmp_path / "out2", "uniform:affine4+refine8")
    assert (seen["refine"].steps, seen["refine"].n_blocks, seen["calib_text"]) == (8, 32, None)
    bench_pareto.mfqat_export(tmp_path / "anchor", tmp_path / "out3", "uniform:affine4+refine8/t2/l5e-4/b64")
    assert (seen["refine"].steps, seen["refine"].n_blocks, seen["refine"].temperature, seen["refine"].lr) == \
        (8, 64, 2.0, 5e-4)
    bench_pareto.mfqat_export(tmp_path / "anchor", tmp_path / "out4", "auto:3.79:affine+gptq/b192+refine64/b128")
    assert (seen["gptq"].n_blocks, seen["refine"].n_blocks, seen["refine"].steps) == (192, 128, 64)
    assert not seen["gptq"].sequential
    bench_pareto.mfqat_export(tmp_path / "anchor", tmp_path / "out6", "auto:3.79:affine+gptq/s/d0.05")
    assert (seen["gptq"].sequential, seen["gptq"].damp, seen["gptq"].n_blocks, seen["refine"]) == (True, 0.05, 256, None)
    with pytest.raises(ValueError, match="unknown refine option 's2'"):
        bench_pareto.mfqat_export(tmp_path / "anchor", tmp_path / "out5", "uniform:affine4+refine8/s2")
