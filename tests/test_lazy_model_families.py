"""The lazily filled model (mfqat.export.lazy_model: --refine's teacher and student, the auto: sensitivity
pass) computes the logits of the model loaded whole, bit for bit, for every family mfqat supports - also
where a layer reads a child's weights without calling it (Qwen3.5 / Qwen3-Next's Gated DeltaNet hands
``conv1d.weight`` to a kernel: before the fix those weights stayed on the meta device and the logits were
garbage, different on every call)."""
import pytest
import torch

import mfqat
from mfqat.anchor.checkpoint import anchor_model
from mfqat.export.lazy_model import LazyModel, anchor_source
from mfqat.models.catalog import SUPPORTED, build


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_lazy_logits_equal_the_loaded_models_in_every_family(name, tmp_path):
    model_type, extra = SUPPORTED[name]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8")
    anchor = mfqat.read_anchor(path, lazy=True)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = anchor_model(mfqat.read_anchor(path))(input_ids=ids, use_cache=False).logits
        lazy = LazyModel(anchor)
        first, again = lazy.logits(anchor_source(anchor), ids), lazy.logits(anchor_source(anchor), ids)
    assert torch.equal(first, want), f"{name}: max diff {(first - want).abs().max().item()}"
    assert torch.equal(again, want)
    checkpointed = LazyModel(anchor).logits(anchor_source(anchor), ids)  # autograd on: layers checkpointed
    assert torch.equal(checkpointed.detach(), want)
