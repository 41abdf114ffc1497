"""Issue 36, anchors and exports as users rely on them: importance input refused with the layer
named, newer format versions refused, auto:BPW against a brute force, the export report against the
files on disk, and the export check exact to the bit."""
import itertools
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import mfqat
from mfqat.anchor.checkpoint import AnchorError, read_anchor
from mfqat.data.sources import tiny_llama
from mfqat.storage.manifest import canonical_digest, seal


@pytest.fixture
def copy(untied_anchor, tmp_path):
    return shutil.copytree(untied_anchor, tmp_path / "a")


def reseal(path, meta):
    """Write mfqat.json as a deliberate edit would: fresh hashes and digest (so only the checks
    on the content can refuse it)."""
    seal(meta, path)
    meta["files"] = {n: meta["manifest"].get(n, d) for n, d in meta["files"].items()}
    meta["digest"] = canonical_digest(meta)
    (path / "mfqat.json").write_text(json.dumps(meta))


# 4. importance input: negative, NaN or wrongly shaped values are refused, naming the layer ------------

@pytest.mark.parametrize("bad", ["negative", "nan", "shape"])
def test_stored_importance_that_is_not_a_mean_square_is_refused_naming_the_tensor(copy, bad):
    meta = json.loads((copy / "mfqat.json").read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    cols = meta["tensors"][name]["shape"][-1]
    imp = torch.rand(cols) + 0.1
    if bad == "negative":
        imp[7] = -1e-3
    elif bad == "nan":
        imp[3] = float("nan")
    else:
        imp = imp[:-32]
    sd = load_file(str(copy / "model.safetensors"))
    sd[f"{name}.importance"] = imp
    save_file(sd, str(copy / "model.safetensors"), metadata={"format": "pt"})
    reseal(copy, meta)
    with pytest.raises(AnchorError, match=f"{name}.importance"):
        read_anchor(copy)
    sd[f"{name}.importance"] = torch.rand(cols) + 0.1  # a valid one is read back as it is
    save_file(sd, str(copy / "model.safetensors"), metadata={"format": "pt"})
    reseal(copy, meta)
    assert torch.equal(read_anchor(copy).quantized[name].importance, sd[f"{name}.importance"])


@pytest.mark.parametrize("bad", ["negative", "nan", "shape"])
def test_imatrix_with_negative_nan_or_wrong_width_is_refused_naming_the_layer(tmp_path, bad):
    from mfqat.export.awq import awq_pairs
    from mfqat.export.imatrix import imatrix_for_model

    from .test_imatrix import write_imatrix

    model = tiny_llama()
    consumers = [c[0] for _, c in awq_pairs(model)]
    g = torch.Generator().manual_seed(0)
    sums = {m: torch.rand(model.get_submodule(m).in_features, generator=g) * 8 + 1 for m in consumers}
    counts = dict.fromkeys(consumers, 8.0)
    victim = "model.layers.1.mlp.down_proj"
    ok = imatrix_for_model(model, write_imatrix(tmp_path / "ok.gguf", sums, counts), consumers)
    assert torch.equal(ok[victim], sums[victim] / 8)
    if bad == "negative":
        sums[victim][5] = -2.0
    elif bad == "nan":
        sums[victim][9] = float("nan")
    else:
        sums[victim] = sums[victim][:64]
    with pytest.raises(ValueError, match=victim):
        imatrix_for_model(model, write_imatrix(tmp_path / "bad.gguf", sums, counts), consumers)


# 5. newer anchor format versions are refused, naming the version; older ones load -------------------

def test_an_anchor_one_version_newer_is_refused_naming_it_and_older_ones_load(copy):
    from mfqat.anchor.meta import ANCHOR_FORMAT_VERSION

    meta = json.loads((copy / "mfqat.json").read_text())
    newer = ANCHOR_FORMAT_VERSION + 1
    reseal(copy, {**meta, "format_version": newer})
    with pytest.raises(AnchorError, match=f"format version {newer} is newer than this mfqat supports "
                                          f"\\({ANCHOR_FORMAT_VERSION}\\)"):
        read_anchor(copy)
    for v in range(2, ANCHOR_FORMAT_VERSION + 1):  # every version this mfqat writes or wrote
        reseal(copy, {**meta, "format_version": v})
        assert read_anchor(copy).meta["format_version"] == v
    old = {k: v for k, v in meta.items() if k not in ("manifest", "digest", "full_precision")}
    (copy / "mfqat.json").write_text(json.dumps({**old, "format_version": 1}))
    assert read_anchor(copy).meta["format_version"] == 1
    from mfqat.cli import main as cli_main

    reseal(copy, {**meta, "format_version": newer})
    with pytest.raises(SystemExit) as e:  # the command line says the same in one line (exit 2)
        cli_main(["verify", str(copy)])
    assert e.value.code == 2


def test_an_export_one_version_newer_is_refused_naming_it_and_older_ones_verify(untied_anchor, tmp_path, capsys):
    """mfqat_export.json carries its format version; `mfqat verify` refuses a newer one by name (exit 2)
    and reads version 1 and exports written before the field existed."""
    from mfqat.cli import main as cli_main
    from mfqat.export import to_mlx
    from mfqat.export.verify import EXPORT_FORMAT_VERSION

    out = tmp_path / "mlx"
    to_mlx(untied_anchor, out, recipe="uniform:mxint4", verify=False)
    meta = json.loads((out / "mfqat_export.json").read_text())
    assert meta["format_version"] == EXPORT_FORMAT_VERSION
    newer = EXPORT_FORMAT_VERSION + 1
    for version, ok in ((newer, False), (EXPORT_FORMAT_VERSION, True), (None, True)):
        body = {k: v for k, v in meta.items() if k not in ("manifest", "digest", "format_version")}
        if version is not None:
            body["format_version"] = version
        (out / "mfqat_export.json").write_text(json.dumps(seal(body, out, "mfqat_export.json")))
        if ok:
            cli_main(["verify", str(out)])
            assert "MLX export" in capsys.readouterr().out
        else:
            with pytest.raises(SystemExit) as e:
                cli_main(["verify", str(out)])
            assert e.value.code == 2
            assert f"format version {newer} is newer than this mfqat supports" in capsys.readouterr().err


# 6. auto:BPW allocation against a brute force ----------------------------------------------------------

@pytest.fixture(scope="module")
def sensitivities(untied_anchor):
    from mfqat.export.sensitivity import calibration_blocks, ladder, measure

    a = read_anchor(untied_anchor)
    levels = ladder(a.format)
    return levels, measure(a, list(a.quantized), "mxint3", calibration_blocks(a, None, 2, 64), levels)


def test_auto_allocation_is_the_brute_force_optimum_and_leaves_no_width_unconsidered(sensitivities):
    """On 5 tensors of the tiny model (three sizes), for budgets from 2.5 to 8.25 bits/weight, the
    allocation fits the budget and its summed estimated KL is the brute-force minimum over every
    assignment of the 6 widths; on all 14 tensors, no tensor could move to any width that still fits
    and lowers the total (a plan that could have fit a better width is never returned)."""
    from mfqat.export.sensitivity import allocate, level_bits

    levels, sens = sensitivities
    bpw = level_bits(levels)
    pick = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight",
            "model.layers.1.self_attn.o_proj.weight"]
    assert len({sens[n].numel for n in pick}) == 2 and len(levels) == 6

    def cost(plan, sub):
        return sum(sub[n].at(plan[n]) for n in sub)

    def used(plan, sub):
        return sum(bpw[plan[n]] * sub[n].numel for n in sub) / sum(s.numel for s in sub.values())

    sub = {n: sens[n] for n in pick}
    plans = [dict(zip(sub, c)) for c in itertools.product(levels, repeat=len(sub))]
    seen = set()
    for budget in (2.5, 3.3, 4.0, 4.6, 5.25, 6.0, 6.7, 7.5, 8.25):
        plan = allocate(sub, levels, budget)
        assert used(plan, sub) <= budget + 1e-9, budget
        best = min(cost(p, sub) for p in plans if used(p, sub) <= budget + 1e-9)
        assert cost(plan, sub) <= best * (1 + 1e-9) + 1e-15, (budget, plan)
        seen.update(plan.values())
    assert seen == set(levels)  # every width was chosen somewhere
    for budget in (3.0, 4.5, 6.5):
        plan = allocate(sens, levels, budget)
        assert used(plan, sens) <= budget + 1e-9
        for n in sens:
            for f in levels:
                moved = {**plan, n: f}
                if used(moved, sens) <= budget + 1e-9:
                    assert cost(moved, sens) >= cost(plan, sens) * (1 - 1e-9), (budget, n, plan[n], f)


# 7. the export report says what the files hold --------------------------------------------------------

@pytest.fixture(scope="module")
def fp_anchor(tok, tmp_path_factory):
    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok)), tmp_path_factory.mktemp("semfp") / "a",
                             "mxfp8_e4m3", tok)


@pytest.mark.parametrize("which,recipe,group", [("int", "seed", 64), ("int", "uniform:affine3", 64),
                                                ("fp", "seed", 64)])
def test_export_report_group_size_and_bits_are_those_on_disk(untied_anchor, fp_anchor, tmp_path, which, recipe, group):
    """For every tensor of mfqat_export.json: its MLX mode, bits and group size are those of the
    module's quantization entry in config.json and of the stored arrays' shapes (bits from the
    packed words per row, group size from the scales per row), and its bits_per_weight is that
    format's at that group size."""
    pytest.importorskip("mlx.core")
    from mfqat.export import to_mlx
    from mfqat.export.mlx_files import load_weights

    src = untied_anchor if which == "int" else fp_anchor
    out = tmp_path / "m"
    to_mlx(src, out, recipe=recipe, verify=False, group_size=group)
    rep = json.loads((out / "mfqat_export.json").read_text())
    quant = json.loads((out / "config.json").read_text())["quantization"]
    weights = load_weights(out)
    a = read_anchor(src)
    shapes = {**{k: q.shape for k, q in a.quantized.items()}, **{k: tuple(v.shape) for k, v in a.plain.items()}}
    seen = set()
    for name, t in rep["tensors"].items():
        if "origin" not in t:
            continue
        module, cols = name[: -len(".weight")], shapes[name][-1]
        entry = quant.get(module, {k: quant[k] for k in ("group_size", "bits", "mode")})
        if t["mlx"] == "bfloat16":
            assert entry is False and f"{module}.scales" not in weights, name
            continue
        w, s = weights[name], weights[f"{module}.scales"]
        assert (t["mlx"], t["bits"], t["group_size"]) == (entry["mode"], entry["bits"], entry["group_size"]), name
        assert w.shape[-1] * 32 == cols * t["bits"], (name, w.shape, t["bits"])
        assert s.shape[-1] * t["group_size"] == cols, (name, s.shape, t["group_size"])
        assert t["bits_per_weight"] == mfqat.get_format(t["source"]).bits_per_weight(t["group_size"]), name
        seen.add((t["source"], t["bits"], t["group_size"]))
    assert len(seen) > 1 or recipe.startswith("uniform")
    if recipe == "uniform:affine3":
        assert seen == {("affine3", 3, 64)}


# 8. the export check is exact: one flipped code or a scale one ulp off is reported -------------------

def test_export_check_reports_one_flipped_code_or_a_scale_one_ulp_off(untied_anchor, tmp_path):
    mx = pytest.importorskip("mlx.core")
    from mfqat.cli import main as cli_main
    from mfqat.export import to_mlx
    from mfqat.export.mlx_export import plan_from_report
    from mfqat.export.mlx_files import load_weights
    from mfqat.export.verify import verify_export

    out = tmp_path / "m"
    rep = to_mlx(untied_anchor, out, recipe="uniform:mxint4", verify=False)
    plan, a = plan_from_report(rep), read_anchor(untied_anchor)
    name, module = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj"
    files = sorted(out.glob("model*.safetensors"))
    assert len(files) == 1
    original = load_weights(out)

    def write(**changed):
        mx.save_safetensors(str(files[0]), {**original, **changed}, metadata={"format": "mlx"})

    w = np.array(original[name])
    flipped = w.copy()
    flipped[3, 2] ^= np.uint32(1)  # the lowest bit of one 4-bit code
    write(**{name: mx.array(flipped)})
    with pytest.raises(RuntimeError, match=f"{name}: 1 elements differ"):
        verify_export(out, a, plan, "def f")
    with pytest.raises(SystemExit) as e:  # mfqat verify: the file no longer matches the manifest
        cli_main(["verify", str(out)])
    assert e.value.code == 2
    s = np.array(original[f"{module}.scales"].astype(mx.float32))
    assert original[f"{module}.scales"].dtype == mx.float32
    nudged = s.copy()
    nudged[5, 1] = np.nextafter(nudged[5, 1], np.float32(np.inf))
    write(**{f"{module}.scales": mx.array(nudged)})
    with pytest.raises(RuntimeError, match=f"{name}: \\d+ elements differ"):
        verify_export(out, a, plan, "def f")
    write()  # the untouched files pass
    assert verify_export(out, a, plan, "def f")["weights_bit_exact"]
