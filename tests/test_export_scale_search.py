"""export-mlx --scale-search: the exported blocks are the output-aware search of the anchor, bit for bit."""
import json

import numpy as np
import pytest
import torch

import mfqat
from mfqat.data.sources import calibration_blocks, tiny_llama, tiny_tokenizer
from mfqat.export import to_mlx
from mfqat.anchor.importance import importance_matrix
from mfqat.formats import get_format
from mfqat.quant.scale_rules import DEFAULT_SCALE_RULE, SCALE_SEARCH_FORMATS

from .test_export_exact import mlx_dequantized

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")


@pytest.mark.parametrize("anchor_fmt,fmt", [("mxint8", "mxint4"), ("mxfp8", "mxfp4")])
def test_scale_search_export_is_the_weighted_search(tmp_path, anchor_fmt, fmt):
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok), tie=True)
    with torch.no_grad():  # heavy-tailed weights: blocks where floor is not the best exponent
        for p in model.parameters():
            p.mul_(torch.rand_like(p) ** 3 * 4)
    anchor_dir = mfqat.save_anchor(model, tmp_path / "a", anchor_fmt, tok)
    rep = to_mlx(anchor_dir, tmp_path / "m", recipe=f"uniform:{fmt}", scale_search=True)
    searched = fmt in SCALE_SEARCH_FORMATS  # MXFP formats measured worse searched: they keep their rule
    assert rep["verify"]["weights_bit_exact"] and rep["scale_search"]["tensors"] == (14 if searched else 0)
    imp = importance_matrix(mfqat.load_anchor(anchor_dir), calibration_blocks(tok, None, n_blocks=8, seq_len=128))
    anchor = mfqat.read_anchor(anchor_dir)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    weights = {}
    for f in sorted((tmp_path / "m").glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    changed = 0
    for name, q in anchor.quantized.items():
        module = name[: -len(".weight")]
        if module not in imp:
            continue
        rule = "search" if searched else DEFAULT_SCALE_RULE.get(get_format(fmt).name, "floor")
        want = mfqat.slice_and_scale(q, fmt, rule, imp[module] if searched else None).dequantize(torch.float32).numpy()
        got = mlx_dequantized(tmp_path / "m", module, weights, cfg["quantization"])
        assert np.array_equal(got, want), name
        changed += not np.array_equal(want, mfqat.slice_and_scale(q, fmt, "floor").dequantize(torch.float32).numpy())
    assert changed > 0


def test_a_searched_export_never_holds_the_anchor_or_its_model(tmp_path, monkeypatch):
    """--scale-search (and --imatrix-path) exports read the anchor lazily and measure the importance module by
    module: neither Anchor.materialize nor a whole model (anchor_model) is asked for."""
    from mfqat.anchor import checkpoint, search

    tok = tiny_tokenizer()
    anchor_dir = mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True), tmp_path / "a", "mxint8", tok)

    def refuse(*a, **k):
        raise AssertionError("the searched export held the anchor or its whole model")
    monkeypatch.setattr(checkpoint.Anchor, "materialize", refuse)
    monkeypatch.setattr(search, "anchor_model", refuse)
    rep = to_mlx(anchor_dir, tmp_path / "m", recipe="uniform:mxint3", scale_search=True)
    assert rep["scale_search"]["tensors"] == 14 and rep["verify"]["weights_bit_exact"]
