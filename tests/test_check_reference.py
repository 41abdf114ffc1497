"""The export check's PyTorch reference (mfqat.export.verify.reference_logits) runs module by module: the
logits of the model loaded whole from the reference's state dict, bit for bit, with one module's weights held
at a time, and the same refusals when the reference and the config disagree."""
import json
import weakref

import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_tokenizer
from mfqat.export import verify
from mfqat.export.recipes import build_plan
from mfqat.models.catalog import SUPPORTED, build


def _anchor(name: str, tmp_path):
    model_type, extra = SUPPORTED[name]
    path = mfqat.save_anchor(build(model_type, extra, len(tiny_tokenizer())), tmp_path / "a", "mxint8")
    return mfqat.read_anchor(path, lazy=True)


def _whole_model_logits(anchor, plan, ids, upcast):
    """What the check computed before: the reference's state dict loaded into the whole float32 model."""
    import transformers
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[anchor.config["model_type"]].from_dict(anchor.config)
    model = getattr(transformers, plan.family.hf_auto_class).from_config(config, dtype=torch.float32)
    model.load_state_dict(dict(verify.reference_tensors(anchor, plan, upcast=upcast)), strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "qwen3_5_moe"])
def test_the_lazy_reference_gives_the_whole_models_logits_holding_one_module(name, tmp_path, monkeypatch):
    anchor = _anchor(name, tmp_path)
    plan = build_plan(anchor, "uniform:affine4", derived_group=32)
    ids = list(range(3, 40))
    alive, most = [], [0]
    made = verify.reference_tensor

    def counted(*args, **kwargs):
        v = made(*args, **kwargs)
        alive[:] = [r for r in alive if r() is not None] + [weakref.ref(v)]
        most[0] = max(most[0], len(alive))
        return v

    monkeypatch.setattr(verify, "reference_tensor", counted)
    with torch.no_grad():
        lazy = verify.reference_logits(anchor, plan, anchor.config, lambda n: True, None, True, ids)
    monkeypatch.undo()
    assert torch.equal(lazy, _whole_model_logits(anchor, plan, ids, True))
    planned = len(plan.formats)
    assert 0 < most[0] <= 4 < planned, f"{most[0]} of the reference's tensors alive at once ({planned} planned)"


def test_a_reference_that_does_not_match_the_config_is_refused_naming_a_tensor(tmp_path):
    anchor = _anchor("llama", tmp_path)
    plan = build_plan(anchor, "uniform:affine4", derived_group=32)
    fewer = json.loads(json.dumps(anchor.config))
    fewer["num_hidden_layers"] -= 1
    last = fewer["num_hidden_layers"]
    with pytest.raises(RuntimeError, match=rf"unexpected \['model\.layers\.{last}\."):
        verify.reference_logits(anchor, plan, fewer, lambda n: True, None, False, [1, 2])
    more = dict(anchor.config, num_hidden_layers=anchor.config["num_hidden_layers"] + 1)
    with pytest.raises(RuntimeError, match=rf"does not match .*missing \['model\.layers\.{last + 1}\."):
        verify.reference_logits(anchor, plan, more, lambda n: True, None, False, [1, 2])
    wider = dict(anchor.config, intermediate_size=anchor.config["intermediate_size"] * 2)
    with pytest.raises(RuntimeError, match=r"reference has model\.layers\.0\.mlp\.\w+_proj\.weight \(\d+, \d+\) where"):
        verify.reference_logits(anchor, plan, wider, lambda n: True, None, False, [1, 2])
