"""Elastic evaluation of an anchor in a base model: what the benchmarks and the demo measure must be
what ``load_anchor`` serves, including the tensors that are not quantized."""
import copy

import pytest
import torch

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.sources import tiny_llama
from mfqat.eval.elastic import anchor_state, evaluate_formats
from mfqat.eval.perplexity import perplexity
from mfqat.qat import QATConfig


@pytest.mark.parametrize("tie", [True, False])
def test_anchor_in_the_base_model_scores_as_load_anchor(tmp_path, tie):
    base = tiny_llama(tie=tie)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    trained = copy.deepcopy(base)
    mfqat.prepare(trained, QATConfig(formats=["mxint8", "mxint4"]))
    torch.manual_seed(1)
    with torch.no_grad():  # fine-tuning moves every parameter: embeddings and norms too
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = mfqat.save_anchor(trained, tmp_path / "a", "mxint8")
    anchor = read_anchor(path)
    blocks = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(2))
    rows = evaluate_formats(base, {f: anchor_state(anchor, f) for f in ("mxint8", "mxint4")}, blocks)
    for row in rows:
        served = perplexity(mfqat.load_anchor(path, row["format"]), blocks)
        assert row["perplexity"] == pytest.approx(served, rel=1e-6), row["format"]
    after = base.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the base model was not restored"


def test_a_state_from_another_architecture_is_refused_and_the_model_kept():
    base = tiny_llama()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    state = {k: torch.zeros_like(v) for k, v in base.state_dict().items()}
    state["model.layers.7.mlp.up_proj.weight"] = torch.zeros(128, 64)  # a layer this model lacks
    with pytest.raises(ValueError, match="model.layers.7.mlp.up_proj.weight"):
        evaluate_formats(base, {"mxint8": state}, torch.randint(0, 256, (2, 8)))
    after = base.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the model was left half-loaded"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ptq_eval_in_place_scores_each_formats_state_and_restores_the_model(dtype):
    """``mfqat eval MODEL`` (evaluate_ptq: one format's weights in the model at a time, each quantized from the
    originals) gives the rows of evaluate_formats over every ptq_state held at once, to the last digit; the
    order (8 bits after 3) shows a format quantized from the previous one's weights instead of the originals."""
    from mfqat.eval.elastic import evaluate_ptq, ptq_state

    base = tiny_llama().to(dtype)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    blocks = torch.randint(0, 256, (4, 24), generator=torch.Generator().manual_seed(3))
    formats = ["mxint3", "mxfp4_e2m1", "mxint8"]
    want = evaluate_formats(base, {f: ptq_state(base, f) for f in formats}, blocks)
    got = evaluate_ptq(base, formats, blocks)
    assert got == want
    after = base.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the model was not restored"
