"""``export-mlx --gptq``: error-compensated codes on the derived affine grid (mfqat.export.gptq), checked against a
column-by-column oracle written from the update rule (inverse Hessian downdated after each column, no Cholesky
factor, no lazy batches), then through a real export that stays bit-exact and keeps its codes under --refine."""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mfqat.export.gptq as gptq_module
from mfqat.export.gptq import GRID_SHRINKS, GPTQConfig, best_codes, gptq_codes, output_error, searched_grid
from mfqat.quant.derive import derive_affine


def _problem(seed: int, rows: int = 24, k: int = 128, bits: int = 3, group: int = 32, corr: float = 0.4):
    """A bfloat16-valued matrix, its derived affine grid and the second moment of correlated inputs."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, k, generator=g).bfloat16().float()
    mix = torch.eye(k) + corr * torch.randn(k, k, generator=g)
    x = torch.randn(4 * k, k, generator=g) @ mix
    h = x.T @ x / x.shape[0]
    q = derive_affine(w, f"affine{bits}", group)
    return w, h, q


def _oracle(w, h, s, b, bits, group, damp):
    """GPTQ as first written (OBQ's update in column order): quantize column j on its group's grid, spread
    its error over the later columns with the inverse Hessian, then remove column j from that inverse."""
    w = w.double().clone()
    k = w.shape[1]
    hd = h.double() + damp * torch.diagonal(h.double()).mean() * torch.eye(k)
    hinv = torch.linalg.inv(hd)
    codes = torch.empty(w.shape, dtype=torch.uint8)
    for j in range(k):
        sj, bj = s[:, j // group].double(), b[:, j // group].double()
        q = torch.round((w[:, j] - bj) / sj).clamp(0, 2 ** bits - 1)
        codes[:, j] = q.to(torch.uint8)
        err = (w[:, j] - (q * sj + bj)) / hinv[j, j]
        w[:, j + 1:] -= err.unsqueeze(1) * hinv[j, j + 1:].unsqueeze(0)
        hinv = hinv - torch.outer(hinv[:, j], hinv[j, :]) / hinv[j, j]
    return codes


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gptq_codes_are_the_column_by_column_oracle(bits):
    w, h, q = _problem(bits, bits=bits)
    cfg = GPTQConfig(act_order=False, block_columns=16)
    got = gptq_codes(w, h, q.scales, q.biases, bits, 32, cfg)
    want = _oracle(w, h, q.scales, q.biases, bits, 32, cfg.damp)
    assert (got != want).float().mean() < 0.01  # float32 against float64: a rounding tie may land either way
    assert (got != q.codes).float().mean() > 0.05  # and it is not round-to-nearest


def test_act_order_is_the_oracle_on_permuted_columns():
    w, h, q = _problem(7)
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    got = gptq_codes(w, h, q.scales, q.biases, 3, 32, GPTQConfig(act_order=True))
    # the oracle on the permuted problem, each column on its own group's grid, then put back in place
    s, b = q.scales[:, perm // 32], q.biases[:, perm // 32]
    want = _oracle(w[:, perm], h[perm][:, perm], s, b, 3, 1, GPTQConfig().damp)
    back = torch.empty_like(want)
    back[:, perm] = want
    assert (got != back).float().mean() < 0.01


def test_lazy_batches_do_not_change_the_codes():
    w, h, q = _problem(3)
    one = gptq_codes(w, h, q.scales, q.biases, 3, 32, GPTQConfig(block_columns=1))
    big = gptq_codes(w, h, q.scales, q.biases, 3, 32, GPTQConfig(block_columns=128))
    assert (one != big).float().mean() < 0.005


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2 ** 16), bits=st.sampled_from([2, 3, 4]), corr=st.floats(0.1, 1.0))
def test_gptq_lowers_the_output_error_of_round_to_nearest(seed, bits, corr):
    w, h, q = _problem(seed, bits=bits, corr=corr)
    new = dataclasses.replace(q, codes=gptq_codes(w, h, q.scales, q.biases, bits, 32))
    assert output_error(w, new, h) < output_error(w, q, h)


@pytest.mark.parametrize("seed", [0, 1])
def test_errors_are_taken_in_the_bfloat16_arithmetic_mlx_dequantizes_in(seed):
    # at 8 bits the bfloat16 roundings of q * s and + b are as large as the code steps: an error taken in float32
    # pushes the wrong amount on, and the output error of the written (bfloat16-dequantized) codes is higher
    w, h, q = _problem(seed, bits=8)
    assert q.dtype == torch.bfloat16
    right = dataclasses.replace(q, codes=gptq_codes(w, h, q.scales, q.biases, 8, 32, None, torch.bfloat16))
    float32 = dataclasses.replace(q, codes=gptq_codes(w, h, q.scales, q.biases, 8, 32, None, torch.float32))
    assert output_error(w, right, h) < 0.8 * output_error(w, float32, h)


def test_uncorrelated_inputs_give_round_to_nearest_on_the_grid():
    w, h, q = _problem(5)
    diag = torch.diag(torch.rand(128) + 0.5)
    got = gptq_codes(w, diag, q.scales, q.biases, 3, 32)
    s = q.scales.repeat_interleave(32, dim=1)
    b = q.biases.repeat_interleave(32, dim=1)
    assert torch.equal(got, torch.round((w - b) / s).clamp(0, 7).to(torch.uint8))


def test_a_dead_input_and_a_singular_moment_are_handled():
    w, h, q = _problem(9)
    h[:, 3] = 0
    h[3, :] = 0  # input 3 is always zero
    low_rank = torch.randn(128, 2)
    for m in (h, low_rank @ low_rank.T):
        codes = gptq_codes(w, m, q.scales, q.biases, 3, 32)
        assert codes.max() <= 7 and codes.shape == w.shape
    # a matrix whose inputs were all zero: nothing to weigh, so round-to-nearest on the grid
    s, b = q.scales.repeat_interleave(32, dim=1), q.biases.repeat_interleave(32, dim=1)
    assert torch.equal(gptq_codes(w, torch.zeros(128, 128), q.scales, q.biases, 3, 32),
                       torch.round((w - b) / s).clamp(0, 7).to(torch.uint8))


def test_mismatched_shapes_and_bad_settings_are_refused():
    w, h, q = _problem(1)
    with pytest.raises(ValueError, match="do not fit groups of 32"):
        gptq_codes(w[:, :100], h, q.scales, q.biases, 3, 32)
    with pytest.raises(ValueError, match="do not fit"):
        gptq_codes(w, h[:64, :64], q.scales, q.biases, 3, 32)
    with pytest.raises(ValueError, match="damp must be positive"):
        GPTQConfig(damp=0)


def _grid_oracle(w, d, s0, b0, bits, group):
    """searched_grid written group by group: the given grid, then each shrunk range in order, a later one kept
    only when its weighted round-to-nearest error (in bfloat16 dequantization) is strictly lower."""
    qmax = 2 ** bits - 1
    s_out, b_out = s0.clone(), b0.clone()
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // group):
            x, dd = w[r, g * group:(g + 1) * group], d[g * group:(g + 1) * group]

            def err(sc, bi):
                if sc == 0:  # MLX's own grid may have a negative scale (a group whose minimum is the larger)
                    return float("inf")
                q = torch.round((x - bi) / sc).clamp(0, qmax)
                deq = (q.bfloat16() * torch.tensor(sc).bfloat16() + torch.tensor(bi).bfloat16()).float()
                return float(((x - deq) ** 2 * dd).sum())
            best, bs, bb = err(float(s0[r, g]), float(b0[r, g])), float(s0[r, g]), float(b0[r, g])
            lo, hi = float(x.min()), float(x.max())
            for p in GRID_SHRINKS:
                sc = float(torch.tensor((hi - lo) * p / qmax).bfloat16())
                bi = float(torch.tensor(lo * p).bfloat16())
                e = err(sc, bi)
                if e < best:
                    best, bs, bb = e, sc, bi
            s_out[r, g], b_out[r, g] = bs, bb
    return s_out, b_out


@pytest.mark.parametrize("seed, bits", [(0, 3), (1, 2), (2, 4)])
def test_grid_search_is_the_group_by_group_oracle_and_never_worse(seed, bits):
    w, h, q = _problem(seed, rows=6, k=64, bits=bits, group=32)
    w[0, 3] = 40.0  # an outlier: clipping its group's range pays
    q = derive_affine(w, f"affine{bits}", 32)
    d = torch.diagonal(h)
    s, b = searched_grid(w, d, q.scales, q.biases, bits, 32, torch.bfloat16)
    want_s, want_b = _grid_oracle(w, d, q.scales.float(), q.biases.float(), bits, 32)
    assert torch.allclose(s, want_s, rtol=0, atol=1e-6) and torch.allclose(b, want_b, rtol=0, atol=1e-6)
    assert torch.equal(s, s.bfloat16().float()) and torch.equal(b, b.bfloat16().float())  # what MLX stores
    assert not torch.equal(s, q.scales.float())  # some group moved (the outlier's at least)

    def weighted(sc, bi):
        blocks = w.reshape(w.shape[0], -1, 32)
        codes = torch.round((blocks - bi.unsqueeze(-1)) / sc.unsqueeze(-1)).clamp(0, 2 ** bits - 1)
        deq = (codes.bfloat16() * sc.bfloat16().unsqueeze(-1) + bi.bfloat16().unsqueeze(-1)).float()
        return ((blocks - deq) ** 2 * d.reshape(1, -1, 32)).sum(-1)
    assert (weighted(s, b) <= weighted(q.scales.float(), q.biases.float())).all()  # never worse, group by group


def test_grid_search_in_row_chunks_is_the_whole(monkeypatch):
    w, h, q = _problem(5, rows=10, k=64, bits=3, group=32)
    whole = searched_grid(w, torch.diagonal(h), q.scales, q.biases, 3, 32, torch.bfloat16)
    monkeypatch.setattr(gptq_module, "GRID_CHUNK_ELEMENTS", 3 * 64)  # 3 rows a chunk, the last one short
    chunked = searched_grid(w, torch.diagonal(h), q.scales, q.biases, 3, 32, torch.bfloat16)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def _correlated(seed: int):
    """The case where the search's diag-H proxy misleads: inputs of rank 8 (plus a little noise) and a few large
    weights, so GPTQ compensates most of the rounding on the derived grid."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 128, generator=g) * 0.02
    w[torch.rand(16, 128, generator=g) < 0.02] *= 8
    w = w.bfloat16().float()
    x = torch.randn(512, 8, generator=g) @ torch.randn(8, 128, generator=g) + 0.05 * torch.randn(512, 128, generator=g)
    return w, x.T @ x / 512, derive_affine(w, "affine3", 32)


def test_a_searched_grid_that_loses_to_plain_gptq_is_not_taken():
    cfg = GPTQConfig(grid_search=True)
    kinds = set()
    for seed in range(6):
        w, h, q = _correlated(seed)
        plain = dataclasses.replace(q, codes=gptq_codes(w, h, q.scales, q.biases, 3, 32, GPTQConfig(), q.dtype))
        s, b = searched_grid(w, torch.diagonal(h), q.scales, q.biases, 3, 32, q.dtype)
        on_grid = dataclasses.replace(q, codes=gptq_codes(w, h, s, b, 3, 32, GPTQConfig(), q.dtype), scales=s, biases=b)
        errors = {"rtn": output_error(w, q, h), "gptq": output_error(w, plain, h), "searched": output_error(w, on_grid, h)}
        best, e, how = best_codes(w, h, q, cfg)
        assert how == min(errors, key=errors.get) and e == errors[how] and output_error(w, best, h) == e
        kinds.add(how)
    assert kinds == {"gptq", "searched"}, kinds  # both outcomes occur in these seeds: the choice is made, not assumed
    w, h, q = _problem(6)
    assert best_codes(w, h, q, GPTQConfig())[2] != "searched"  # without grid_search, no searched candidate


def test_grid_search_weighs_each_input_by_its_importance():
    """An outlier on an input that never fires costs nothing: its group clips it; the same outlier on a busy input
    keeps the full range."""
    w, h, q = _problem(3, rows=1, k=32, bits=3, group=32)
    w[0, 0] = 5.0
    q = derive_affine(w, "affine3", 32)
    quiet = torch.ones(32)
    quiet[0] = 0.0
    busy = torch.full((32,), 1e-3)
    busy[0] = 1e3
    s_quiet, _ = searched_grid(w, quiet, q.scales, q.biases, 3, 32, torch.bfloat16)
    s_busy, _ = searched_grid(w, busy, q.scales, q.biases, 3, 32, torch.bfloat16)
    full = abs(float(q.scales[0, 0]))
    assert abs(float(s_quiet[0, 0])) < 0.8 * full and abs(float(s_busy[0, 0])) >= 0.95 * full


def test_grid_search_keeps_a_constant_groups_grid():
    w, h, q = _problem(4, rows=2, k=64, bits=3, group=32)
    w[1, :32] = 0.5
    q = derive_affine(w, "affine3", 32)
    s, b = searched_grid(w, torch.diagonal(h), q.scales, q.biases, 3, 32, torch.bfloat16)
    assert float(s[1, 0]) == float(q.scales[1, 0]) and float(b[1, 0]) == float(q.biases[1, 0])
    assert torch.isfinite(s).all() and torch.isfinite(b).all()


# ----------------------------------------------------------------------------- through a real export

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402

import mfqat  # noqa: E402
from mfqat.data.sources import tiny_llama  # noqa: E402
from mfqat.export.mlx_files import load_weights  # noqa: E402
from mfqat.export.refine import RefineConfig  # noqa: E402

SMALL_GPTQ = GPTQConfig(n_blocks=8, seq_len=32)
SMALL_REFINE = dict(steps=6, lr=3e-3, batch=2, seq_len=32, n_blocks=8, n_valid=2)


@pytest.fixture(scope="module")
def anchor(tok, tmp_path_factory):
    torch.manual_seed(0)
    return mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), tmp_path_factory.mktemp("gptq") / "a",
                             "mxint8", tok)


@pytest.fixture(scope="module")
def exports(anchor, tmp_path_factory):
    d = tmp_path_factory.mktemp("gptq_out")
    out = {}
    for name, kw in {"plain": {}, "gptq": dict(gptq=SMALL_GPTQ),
                     "gptq_sequential": dict(gptq=dataclasses.replace(SMALL_GPTQ, sequential=True)),
                     "gptq_grid": dict(gptq=dataclasses.replace(SMALL_GPTQ, grid_search=True)),
                     "gptq_refined": dict(gptq=SMALL_GPTQ, refine=RefineConfig(**SMALL_REFINE))}.items():
        out[name] = (d / name, mfqat.export.to_mlx(anchor, d / name, recipe="uniform:affine3", **kw))
    return out


def _arrays(folder):
    return {k: np.array(v.astype(mx.float32)) for k, v in load_weights(folder).items()}


def test_gptq_export_lowers_the_output_error_and_stays_bit_exact(exports):
    folder, rep = exports["gptq"]
    g = rep["gptq"]
    assert g["tensors"] > 0 and g["output_error_gptq"] < g["output_error_rtn"]
    v = rep["verify"]
    assert v["weights_bit_exact"] and v["max_abs_logit_diff"] <= v["logit_tolerance"]
    plain, new = _arrays(exports["plain"][0]), _arrays(folder)
    assert sorted(plain) == sorted(new) and rep["stored_bytes"] == exports["plain"][1]["stored_bytes"]
    changed = [k for k in plain if k.endswith(".weight") and not np.array_equal(plain[k], new[k])]
    assert len(changed) == g["tensors"]  # new codes where GPTQ won, the derived ones elsewhere
    for k in plain:
        if k.endswith((".scales", ".biases")):
            assert np.array_equal(plain[k], new[k]), f"{k}: gptq keeps the derived grid"


def test_sequential_gptq_takes_other_inputs_and_stays_bit_exact(exports):
    """On the quantized model's inputs the moments change, so the codes do; the export is still exact."""
    folder, rep = exports["gptq_sequential"]
    assert rep["gptq"]["sequential"] and not exports["gptq"][1]["gptq"]["sequential"]
    assert rep["gptq"]["tensors"] > 0 and rep["verify"]["weights_bit_exact"]
    anchor_inputs, quantized_inputs = _arrays(exports["gptq"][0]), _arrays(folder)
    changed = [k for k in anchor_inputs if k.endswith("proj.weight")
               and not np.array_equal(anchor_inputs[k], quantized_inputs[k])]
    assert any(".layers.1." in k for k in changed), changed


def test_grid_searched_gptq_writes_its_grid_and_stays_bit_exact(exports):
    """The searched scales and biases are what MLX reads (same bytes), and the codes are GPTQ's on them."""
    folder, rep = exports["gptq_grid"]
    g = rep["gptq"]
    assert g["grid_search"] and not exports["gptq"][1]["gptq"]["grid_search"]
    assert g["tensors"] > 0 and rep["verify"]["weights_bit_exact"]
    assert rep["stored_bytes"] == exports["plain"][1]["stored_bytes"]
    plain, searched = _arrays(exports["gptq"][0]), _arrays(folder)
    moved = [k for k in plain if k.endswith(".scales") and not np.array_equal(plain[k], searched[k])]
    assert len(moved) == g["on_searched_grid"] > 0, moved  # the matrices that took the searched grid wrote it
    assert g["output_error_gptq"] <= exports["gptq"][1]["gptq"]["output_error_gptq"]  # never worse than plain GPTQ


def test_refine_after_gptq_keeps_the_gptq_codes(exports):
    gptq, refined = _arrays(exports["gptq"][0]), _arrays(exports["gptq_refined"][0])
    rep = exports["gptq_refined"][1]
    assert rep["refine"]["kept"] and rep["verify"]["weights_bit_exact"]
    moved = 0
    for k in gptq:
        if k.endswith(".weight") and k in refined:
            assert np.array_equal(gptq[k], refined[k]), f"{k}: the refine wrote other codes than GPTQ's"
        elif k.endswith((".scales", ".biases")):
            moved += not np.array_equal(gptq[k], refined[k])
    assert moved > 0


def test_gptq_codes_survive_a_row_chunked_write(anchor, exports, tmp_path, monkeypatch):
    # real models' matrices are over CHUNK_ELEMENTS: the writer and the check must not derive them again in chunks
    import mfqat.export.recipes as recipes
    monkeypatch.setattr(recipes, "CHUNK_ELEMENTS", 256)
    rep = mfqat.export.to_mlx(anchor, tmp_path / "c", recipe="uniform:affine3", gptq=SMALL_GPTQ)
    assert rep["verify"]["weights_bit_exact"]
    whole, chunked = _arrays(exports["gptq"][0]), _arrays(tmp_path / "c")
    for k in whole:
        assert np.array_equal(whole[k], chunked[k]), f"{k}: a row-chunked write lost the GPTQ codes"


def test_gptq_without_affine_matrices_is_refused(anchor, tmp_path):
    with pytest.raises(ValueError, match="--gptq changes the codes of derived affine"):
        mfqat.export.to_mlx(anchor, tmp_path / "mx", recipe="uniform:mxint4", gptq=SMALL_GPTQ)
    assert not (tmp_path / "mx").exists()


def test_the_cli_flag_runs_gptq_and_says_what_it_did(anchor, tmp_path, capsys):
    from mfqat.cli import main

    main(["export-mlx", str(anchor), "--out", str(tmp_path / "g"), "--recipe", "uniform:affine3", "--gptq",
          "--no-refine"])
    said = capsys.readouterr().out
    rep = json.loads((tmp_path / "g" / "mfqat_export.json").read_text())
    g = rep["gptq"]
    assert g["tensors"] > 0 and g["calibration_blocks"] == GPTQConfig().n_blocks and "refine" not in rep
    assert f"gptq: {g['tensors']} of {g['candidates']} affine matrices" in said


def test_the_cli_flags_set_gptqs_blocks_and_dampening_and_the_refines_blocks(anchor, tmp_path):
    from mfqat.cli import main

    main(["export-mlx", str(anchor), "--out", str(tmp_path / "g"), "--recipe", "uniform:affine3", "--gptq",
          "--gptq-blocks", "8", "--gptq-damp", "0.1", "--gptq-grid-search", "--refine-steps", "2",
          "--refine-blocks", "6"])
    rep = json.loads((tmp_path / "g" / "mfqat_export.json").read_text())
    assert (rep["gptq"]["calibration_blocks"], rep["gptq"]["damp"], rep["gptq"]["grid_search"]) == (8, 0.1, True)
    assert (rep["refine"]["calibration_blocks"], rep["refine"]["steps"]) == (6, 2)


@pytest.mark.parametrize("flags, said", [
    (["--gptq-damp", "0.1", "--no-refine"], "--gptq-damp sets --gptq's calibration: add --gptq"),
    (["--gptq-blocks", "8", "--no-refine"], "--gptq-blocks sets --gptq's calibration: add --gptq"),
    (["--gptq-grid-search", "--no-refine"], "--gptq-grid-search sets --gptq's calibration: add --gptq"),
    (["--gptq", "--gptq-damp", "0"], "--gptq-damp must be > 0"),
    (["--gptq", "--gptq-blocks", "0"], "--gptq-blocks must be >= 1"),
    (["--refine-blocks", "8", "--no-refine"], "--refine-blocks 8 with --no-refine"),
    (["--refine-blocks", "0"], "--refine-blocks must be >= 1")])
def test_the_cli_refuses_gptq_and_refine_block_flags_that_cannot_apply(anchor, tmp_path, capsys, flags, said):
    from .conftest import one_line_exit_2

    one_line_exit_2(["export-mlx", str(anchor), "--out", str(tmp_path / "g"), "--recipe", "uniform:affine3", *flags],
                    capsys, said)
    assert not (tmp_path / "g").exists()


@pytest.mark.parametrize("recipe", ["uniform:mxint4", "auto:4.5:mxint", "seed", "uniform:nvfp4"])
def test_the_cli_refuses_gptq_up_front_for_a_recipe_without_affine_matrices(anchor, tmp_path, capsys, recipe):
    from .conftest import one_line_exit_2

    one_line_exit_2(["export-mlx", str(anchor), "--out", str(tmp_path / "g"), "--recipe", recipe, "--gptq"],
                    capsys, "GPTQ changes the codes of derived affine matrices")
    assert not (tmp_path / "g").exists()


def test_a_calibration_text_shorter_than_the_blocks_asked_for_is_said(anchor, tmp_path):
    short = "def f(x):\n    return x + 1\n" * 40  # ~1,100 bytes: 34 blocks of 32 byte tokens, not 64
    with pytest.warns(UserWarning, match="gptq: the calibration text gives 3[0-9] blocks of 32 tokens, not 64"):
        rep = mfqat.export.to_mlx(anchor, tmp_path / "s", recipe="uniform:affine3", calib_text=short,
                                  gptq=GPTQConfig(n_blocks=64, seq_len=32), verify=False)
    assert 30 <= rep["gptq"]["calibration_blocks"] < 64


def test_gptq_past_the_memory_budget_is_refused_before_it_runs(anchor, tmp_path):
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.memory import LIBRARY_BYTES, BudgetError

    from mfqat.export import build_plan

    import math

    from mfqat.models import layer_index

    a = read_anchor(anchor)  # tied: the embedding is no GPTQ matrix (no codes, no moment), the head not untied
    shapes = {n: tuple(a.shape(n)) for n in build_plan(a, "uniform:affine3").formats
              if len(a.shape(n)) == 2 and "embed" not in n}
    per_layer = {}  # as documented: one layer at a time, its matrices' moments and all its tensors in float32,
    for n, (_, k) in shapes.items():
        per_layer[layer_index(n)] = per_layer.get(layer_index(n), 0) + k * k * 4
    for n in list(a.quantized) + list(a.plain):
        per_layer[layer_index(n)] = per_layer.get(layer_index(n), 0) + 4 * math.prod(a.shape(n))
    outside = per_layer.pop(None)  # or the tensors outside the layers (the embedding) while they are recorded;
    tokens = SMALL_GPTQ.n_blocks * SMALL_GPTQ.seq_len  # the hidden states twice and the masks,
    activations = 2 * tokens * a.config["hidden_size"] * 4 + 2 * tokens * SMALL_GPTQ.seq_len * 4
    held = sum(rows * k for rows, k in shapes.values()) + max(max(per_layer.values()), outside) + activations
    work = max(rows * k * 8 + k * k * 24 for rows, k in shapes.values())  # and the largest matrix's working copies
    with pytest.raises(BudgetError, match="--gptq .* drop --gptq"):
        mfqat.export.to_mlx(anchor, tmp_path / "m", recipe="uniform:affine3", gptq=SMALL_GPTQ,
                            max_memory=LIBRARY_BYTES + held + work - 1)
    assert not (tmp_path / "m").exists()
    rep = mfqat.export.to_mlx(anchor, tmp_path / "m", recipe="uniform:affine3", gptq=SMALL_GPTQ, verify=False,
                              max_memory=LIBRARY_BYTES + held + work)
    assert rep["gptq"]["tensors"] > 0


def test_the_grid_search_is_counted_in_the_memory_check(anchor):
    """The search holds the largest matrix's other candidates' codes (2 bytes a weight) and a searched chunk's
    temporaries beside plain GPTQ's working copies."""
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.export import build_plan
    from mfqat.export.gptq import GRID_CHUNK_ELEMENTS, gptq_names, memory_needed

    a = read_anchor(anchor)
    names = gptq_names(a, build_plan(a, "uniform:affine3"))
    largest = max(math.prod(a.shape(n)) for n in names if "embed" not in n)
    extra = memory_needed(a, names, 8, 32, grid_search=True) - memory_needed(a, names, 8, 32)
    assert extra == 2 * largest + 16 * GRID_CHUNK_ELEMENTS


def test_an_export_refuses_a_grid_search_past_the_memory_budget(anchor, tmp_path):
    """The budget plain GPTQ fits in refuses the grid search up front: the export passes the setting on."""
    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.export import build_plan
    from mfqat.export.gptq import gptq_names, memory_needed
    from mfqat.memory import LIBRARY_BYTES, BudgetError

    a = read_anchor(anchor)
    plain = memory_needed(a, gptq_names(a, build_plan(a, "uniform:affine3")), SMALL_GPTQ.n_blocks, SMALL_GPTQ.seq_len)
    with pytest.raises(BudgetError, match="--gptq"):
        mfqat.export.to_mlx(anchor, tmp_path / "m", recipe="uniform:affine3", max_memory=LIBRARY_BYTES + plain,
                            gptq=dataclasses.replace(SMALL_GPTQ, grid_search=True))
    assert not (tmp_path / "m").exists()
