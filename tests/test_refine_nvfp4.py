"""``export-mlx --refine`` on nvfp4 tensors (issue 49): the E2M1 codes kept, each block's E4M3 scale learned
(straight-through E4M3 rounding, valid E4M3 values only), the global scale kept, the export still bit-exact."""
import json

import numpy as np
import pytest
import torch

pytest.importorskip("mlx_lm")
import mlx.core as mx  # noqa: E402

import mfqat  # noqa: E402
from mfqat.cli import main  # noqa: E402
from mfqat.export.mlx_files import load_weights  # noqa: E402
from mfqat.export.refine import RefineConfig, _Blocks  # noqa: E402
from mfqat.quant.api import quantize_nvfp4  # noqa: E402
from mfqat.quant.nvfp4 import E2M1, E4M3, e4m3_decode  # noqa: E402
from mfqat.quant.reference import mx_codes_to_values  # noqa: E402

SMALL = dict(steps=16, lr=8e-3, batch=2, seq_len=32, n_blocks=16, n_valid=4)


def _np(x) -> np.ndarray:
    """An MLX array as numpy, exactly (bfloat16 widened to float32; uint32 codes and uint8 scales as they are)."""
    return np.array(x.astype(mx.float32)) if x.dtype == mx.bfloat16 else np.array(x)


def _report(d) -> dict:
    return json.loads((d / "mfqat_export.json").read_text())


@pytest.fixture(scope="module")
def sharp_anchor(tok, tmp_path_factory):
    """The tiny tied Llama with its matrices times 4: sharper next-token distributions, so that nvfp4 costs a
    KL (~0.02) a refine can lower (the plain tiny model's ~4e-4 is mostly noise to 3-bit-mantissa scales)."""
    from mfqat.data.sources import tiny_llama

    model = tiny_llama(vocab_size=len(tok), tie=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return mfqat.save_anchor(model, tmp_path_factory.mktemp("sharp") / "anchor", "mxint8", tok)


@pytest.fixture(scope="module")
def exports(sharp_anchor, tmp_path_factory):
    d = tmp_path_factory.mktemp("refine_nvfp4")
    plain = mfqat.export.to_mlx(sharp_anchor, d / "plain", recipe="uniform:nvfp4")
    refined = mfqat.export.to_mlx(sharp_anchor, d / "refined", recipe="uniform:nvfp4", refine=RefineConfig(**SMALL))
    return d / "plain", plain, d / "refined", refined


def test_refine_lowers_the_kl_of_an_nvfp4_export_and_it_stays_bit_exact(exports):
    _, _, out, rep = exports
    r = rep["refine"]
    assert r["kept"] and r["validation_kl_after"] < r["validation_kl_before"]
    assert r["tensors"] == len(rep["tensors"])  # every nvfp4 tensor learnt
    v = rep["verify"]
    assert v["weights_bit_exact"] and v["max_abs_logit_diff"] <= v["logit_tolerance"]
    assert _report(out)["refine"]["kept"]


def test_refine_keeps_every_code_and_byte_and_moves_the_scales_within_e4m3(exports):
    plain_dir, plain, out, rep = exports
    a, b = load_weights(plain_dir), load_weights(out)
    assert sorted(a) == sorted(b) and not any(k.endswith(".biases") for k in b)  # nvfp4: no bias learnt
    moved = 0
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        if k.endswith(".weight"):
            assert np.array_equal(_np(a[k]), _np(b[k])), f"{k}: refine changed codes"
        elif k.endswith(".scales"):
            s0, s = _np(a[k]), _np(b[k])
            assert s.dtype == np.uint8, k  # E4M3 bytes
            assert not ((s & 0x7F) == 0x7F).any(), f"{k}: a learned scale is NaN"
            assert np.array_equal(s == 0, s0 == 0), f"{k}: a learned scale rounded to zero (or left zero)"
            moved += not np.array_equal(s0, s)
    assert moved > 0, "refine wrote the derived nvfp4 scales unchanged"
    assert rep["stored_bytes"] == plain["stored_bytes"]


def _tensor(global_scale=None):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen) * torch.logspace(-3, 2, 6).unsqueeze(-1)
    x[1, 16:32] = 0  # an all-zero block: scale 0, kept 0
    return quantize_nvfp4(x, global_scale)


@pytest.mark.parametrize("g", [None, 3.0])
def test_the_nvfp4_weight_function_gives_autograds_values_and_gradients(g, monkeypatch):
    """W = e2m1(P) * (s * g / 2688) built by one autograd Function keeping the uint8 codes: at a = 0 the tensor's
    own dequantization, and values and gradients bit for bit what autograd gives for the plain expression."""
    import mfqat.export.refine as refine

    monkeypatch.setattr(refine, "_CHUNK_ELEMENTS", 100)  # 1 row of 64 a chunk: the reduction in row chunks
    q = _tensor(None if g is None else torch.tensor(g))
    blocks = _Blocks(q)
    assert torch.equal(blocks.weight().detach(), q.dequantize(torch.float32))
    with torch.no_grad():
        blocks.a.copy_(torch.randn(blocks.a.shape, generator=torch.Generator().manual_seed(1)) * 0.2)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2))
    w1 = blocks.weight()
    w1.backward(grad)
    a = blocks.a.detach().clone().requires_grad_()
    s0 = e4m3_decode(q.scales)
    s = refine._ste_e4m3(s0 * (1 + a), s0)
    if g is not None:
        s = s * (torch.tensor(g) / torch.tensor(2688.0))
    values = mx_codes_to_values(q.codes, E2M1).reshape(6, 4, 16)
    w2 = (values * s.unsqueeze(-1)).reshape(q.shape)
    w2.backward(grad)
    assert torch.equal(w1, w2) and torch.equal(blocks.a.grad, a.grad)
    learned = blocks.learned()  # what the exporter writes: same codes and global scale, E4M3 bytes
    assert torch.equal(learned.codes, q.codes) and learned.global_scale is q.global_scale
    assert learned.scales.dtype == torch.uint8 and torch.equal(learned.dequantize(torch.float32), w1.detach())


def test_learned_scales_are_clamped_to_e4m3_and_never_round_to_zero():
    q = _tensor()
    blocks = _Blocks(q)
    with torch.no_grad():
        blocks.a.fill_(-3.0)  # s0 * (1 + a) negative: the smallest E4M3 scale, not zero
    s = blocks.learned().scales
    live = q.scales != 0
    assert torch.equal(s[live], torch.ones_like(s[live])) and torch.equal(s[~live], q.scales[~live])
    assert e4m3_decode(s[live]).min() == 2.0 ** -9
    with torch.no_grad():
        blocks.a.fill_(1e6)  # far above 448: saturates at 448
    s = blocks.learned().scales
    assert (e4m3_decode(s[live]) == E4M3.max_normal).all() and torch.equal(s[~live], q.scales[~live])
    with torch.no_grad():
        blocks.a.fill_(float("nan"))  # a diverged a: a valid byte, never NaN
    s = blocks.learned().scales
    assert not ((s & 0x7F) == 0x7F).any() and torch.equal(s != 0, q.scales != 0)


def test_nvfp4_scales_are_learned_by_the_default_refine_and_with_refine(anchor, tmp_path, capsys):
    """The default refine learns nvfp4 scales (they lowered held-out perplexity on both texts, BENCHMARKS.md), as
    --refine does: the same steps give the same files."""
    main(["export-mlx", str(anchor), "--out", str(tmp_path / "x"), "--recipe", "uniform:nvfp4", "--refine-steps", "2"])
    d = _report(tmp_path / "x")["refine"]
    assert "skipped" not in d and d["tensors"] == len(_report(tmp_path / "x")["tensors"])
    capsys.readouterr()
    main(["export-mlx", str(anchor), "--out", str(tmp_path / "y"), "--recipe", "uniform:nvfp4", "--refine",
          "--refine-steps", "2"])  # --refine accepts an nvfp4 recipe
    r = _report(tmp_path / "y")["refine"]
    assert r["steps"] == 2 and r["tensors"] == len(_report(tmp_path / "y")["tensors"])
    assert r["validation_kl_after"] == d["validation_kl_after"]
    assert "affine / nvfp4 / MX tensors" in capsys.readouterr().err
