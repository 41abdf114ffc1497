"""End-to-end checks on the embedded SmolLM2-135M (marked slow; CI runs them: about a minute)."""
import numpy as np
import pytest
import torch

import mfqat
from mfqat.data.sources import load_model, load_text, split_text, token_blocks

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model(None)


@pytest.fixture(scope="module")
def held(smollm2):
    _, tok = smollm2
    return token_blocks(tok, split_text(load_text(None))[1], 64, max_blocks=2)


def test_smollm2_mxint4_export_matches_pytorch(smollm2, held, tmp_path):
    from mfqat.eval.perplexity import perplexity
    from mfqat.export import to_mlx
    from mfqat.mlx.train import perplexity as mlx_perplexity

    model, tok = smollm2
    anchor = mfqat.save_anchor(model, tmp_path / "anchor", "mxint8", tok)
    rep = to_mlx(anchor, tmp_path / "mlx", recipe="uniform:mxint4")
    assert rep["verify"]["weights_bit_exact"] and rep["verify"]["argmax_agreement"] >= 0.9
    assert abs(rep["bits_per_weight"] - 4.25) < 0.01
    mlx_model, mlx_tok = mlx_lm.load(str(tmp_path / "mlx"))
    ppl_mlx = mlx_perplexity(mlx_model, mx.array(held.numpy()))
    pt = mfqat.load_anchor(anchor, fmt="mxint4")
    from mfqat.export.mlx_export import reference_state
    from mfqat.export.recipes import build_plan
    a = mfqat.read_anchor(anchor)
    pt.load_state_dict(reference_state(a, build_plan(a, "uniform:mxint4")), strict=False)
    ppl_pt = perplexity(pt, held)
    assert abs(ppl_mlx / ppl_pt - 1) < 2e-3, (ppl_mlx, ppl_pt)
    assert len(mlx_lm.generate(mlx_model, mlx_tok, prompt="The Python language is", max_tokens=8)) > 0


def test_smollm2_mlx_training_model_matches_pytorch(tmp_path, held):
    """The MLX copy of SmolLM2 (rope_theta from rope_parameters) gives PyTorch's loss in each format."""
    from transformers import AutoModelForCausalLM

    from mfqat.mlx.models import load_for_training, smollm2_mlx_dir
    from mfqat.mlx.qat import prepare, set_format
    from mfqat.mlx.train import loss_fn

    src = smollm2_mlx_dir(str(tmp_path / "smollm2"))
    m, _, _ = load_for_training(str(src))
    prepare(m, mfqat.QATConfig())
    t = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    mfqat.prepare(t, mfqat.QATConfig())
    ids = held[:1]
    for fmt in (None, "mxint8", "mxint4"):
        set_format(m, fmt)
        mfqat.set_format(t, fmt)
        with torch.no_grad():
            want = t(input_ids=ids, labels=ids).loss.item()
        got = loss_fn(m, mx.array(ids.numpy())).item()
        assert abs(got - want) < 2e-3, (fmt, got, want)
