"""auto:BPW sensitivity: the measured KL of one tensor equals a brute-force KL computed by
lowering only that tensor by hand (Slice-and-Scale of the anchor) and comparing the logits."""
import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.export.sensitivity import ladder, measure


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    model = tiny_llama(vocab_size=256)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)  # peaked distributions: KLs well above float noise
    path = mfqat.save_anchor(model, tmp_path_factory.mktemp("sens") / "a", "mxint8")
    return mfqat.read_anchor(path)


def brute_force_kl(anchor, name: str, probe: str, blocks: torch.Tensor) -> float:
    model = mfqat.load_anchor(anchor.path)  # every tensor in the anchor's format
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=blocks).logits.double(), -1)
        param = dict(model.named_parameters())[name]
        param.copy_(mfqat.slice_and_scale(anchor.quantized[name], probe).dequantize(torch.float32))
        low = torch.log_softmax(model(input_ids=blocks).logits.double(), -1)
    return (ref.exp() * (ref - low)).sum(-1).mean().item()


@pytest.mark.parametrize("probe", ["mxint2", "mxint4"])
def test_measured_kl_equals_brute_force(anchor, probe):
    names = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    blocks = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    sens = measure(anchor, names, probe, blocks)
    for name in names:
        want = brute_force_kl(anchor, name, probe, blocks)
        assert want > 1e-6, name
        assert sens[name].probe_kl == pytest.approx(want, rel=1e-3, abs=5e-8), name  # float32 noise ~2e-8
        # relative weight error of the probe level, also by hand
        w8 = anchor.quantized[name].dequantize(torch.float32)
        wp = mfqat.slice_and_scale(anchor.quantized[name], probe).dequantize(torch.float32)
        assert sens[name].rel_error[probe] == pytest.approx(((wp - w8) ** 2).sum().item() / (w8 ** 2).sum().item(),
                                                             rel=1e-6)
        assert sens[name].rel_error["mxint8"] == 0.0 and set(sens[name].rel_error) == set(ladder("mxint8"))
    # lowering q_proj in layer 1 and down_proj in layer 0 does not cost the same
    assert sens[names[0]].probe_kl != pytest.approx(sens[names[1]].probe_kl, rel=1e-2)
