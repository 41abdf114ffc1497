"""``export-mlx HF --awq`` without loading the model (mfqat.export.awq.streamed_awq): the importance measured on
the full-precision model run module by module, each tensor rescaled as it is read from the shards. The anchor it
quantizes is the one of the old path - the model loaded in float32, rescaled in place (apply_awq), saved
(save_anchor) - code for code, in every family AWQ serves, and an export of it is bit-exact."""
import pytest
import torch

import mfqat
from mfqat.anchor.stream import close_anchor, folder_anchor, inspect_folder
from mfqat.data.sources import calibration_blocks, load_model, tiny_tokenizer
from mfqat.export.awq import apply_awq, streamed_awq
from mfqat.models import family_for
from mfqat.models.catalog import SUPPORTED, build

AWQ_FAMILIES = sorted(n for n in SUPPORTED if family_for(SUPPORTED[n][0]).awq_groups)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def bf16_folder(name, tok, path):
    """A tiny random model of family ``name`` saved in bfloat16 (norms moved off 1, so a wrong fold shows)."""
    model_type, extra = SUPPORTED[name]
    model = build(model_type, extra, len(tok))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n and p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.3)
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("name", AWQ_FAMILIES)
def test_streamed_awq_quantizes_the_loaded_models_anchor(name, tok, tmp_path):
    src = bf16_folder(name, tok, tmp_path / "src")
    inspected = inspect_folder(src)
    if inspected[0] is not None:
        pytest.skip(f"{name}: not streamed ({inspected[0]}); the export loads the model")
    model, mtok = load_model(str(src))
    want_stats = apply_awq(model, calibration_blocks(mtok, None))
    want = mfqat.read_anchor(mfqat.save_anchor(model, tmp_path / "loaded", "mxint8", mtok))
    transforms, entry = streamed_awq(src, inspected)
    assert entry["awq"] == want_stats  # the same importance, hence the same scales
    got = folder_anchor(src, "mxint8", inspected=inspected, transforms=transforms)
    try:
        assert sorted(got.quantized) == sorted(want.quantized)
        for k in want.quantized:
            a, b = got.quantized[k], want.quantized[k]
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), k
            if k in transforms:  # rescaled in float32, recorded so, as the loaded model holds it
                assert a.dtype == b.dtype == torch.float32 and got.meta["tensors"][k]["dtype"] == "float32", k
        scaled_plain = [k for k in want.plain if k in transforms]
        for k in want.plain:
            assert torch.equal(got.plain[k].float(), want.plain[k].float()), k
            assert k not in transforms or got.plain[k].dtype == torch.float32, k
        assert any(k in transforms for k in want.quantized) and (scaled_plain or name == "olmo2")
    finally:
        close_anchor(got)


def test_streamed_awq_export_is_bit_exact_and_never_loads_the_model(tok, tmp_path, monkeypatch):
    pytest.importorskip("mlx_lm")
    from mfqat.data import sources
    from mfqat.export import to_mlx

    src = bf16_folder("llama", tok, tmp_path / "src")

    def refuse(*a, **k):
        raise AssertionError("the streamed AWQ export loaded the model")
    monkeypatch.setattr(sources, "load_model", refuse)
    rep = to_mlx(src, tmp_path / "m", recipe="uniform:mxint4", awq=True)
    assert rep["ptq"] == "AWQ, tensor by tensor" and rep["awq"]
    assert rep["verify"]["weights_bit_exact"]


def test_a_written_awq_anchor_holds_the_scaled_codes(tok, tmp_path):
    """``export-mlx HF --awq`` with ``auto:`` or ``--refine`` writes its PTQ anchor (anchor_from_folder) instead of
    reading it from the shards: it must be the same AWQ-scaled anchor, not the source quantized unscaled."""
    from mfqat.export.mlx_export import _ptq_anchor

    src = bf16_folder("llama", tok, tmp_path / "src")
    codes = {}
    for written in (False, True):
        report: dict = {}
        anchor, _ = _ptq_anchor(src, tmp_path / f"scratch-{written}", True, None, report, "mxint8", written=written)
        try:
            assert report["ptq"] == "AWQ, tensor by tensor" and report["awq"]
            codes[written] = {k: anchor.quantized[k].codes.clone() for k in anchor.quantized}
            if written:
                assert anchor.meta["tensors"]["model.layers.0.self_attn.q_proj.weight"]["dtype"] == "float32"
        finally:
            close_anchor(anchor)
    assert codes[True].keys() == codes[False].keys()
    for k in codes[False]:
        assert torch.equal(codes[True][k], codes[False][k]), k
