"""QATConfig.keep_quantized_weights: backward uses the forward's quantized weight instead of
recomputing it; the gradients must be those of the recompute path, bit for bit (issue 34 item 2)."""
import copy

import pytest
import torch
from torch import nn

import mfqat
from mfqat import QATConfig
from mfqat.data.sources import tiny_llama
from mfqat.qat.joint import joint_backward
from mfqat.qat.modules import MFQATLinear
from mfqat.qat.prepare import qat_modules

MXINT = (["mxint8", "mxint6", "mxint4"], {"mxint4": "search"})
MXFP = (["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"], {"mxfp4_e2m1": "search"})


def _layer_grads(keep: bool, formats, rules, bias: bool, autocast: bool):
    """Grads of weight, bias and input of one prepared Linear after a joint pass per format
    (through the anchor), two micro-batches so the search's kept exponents and the importance are used."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=bias))
    cfg = QATConfig(formats=formats, schedule="joint", scale_rules=rules, targets=r"^0$",
                    keep_quantized_weights=keep)
    mfqat.prepare(model, cfg)
    model.train()
    layer = model[0]
    assert isinstance(layer, MFQATLinear) and layer.keep_quantized_weights is keep
    xs = [torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(i)).requires_grad_() for i in range(2)]
    for x in xs:
        for fmt in formats:
            mfqat.set_format(model, fmt)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = model(x)
            (out.float() ** 2).mean().backward()
    grads = [layer.weight.grad] + ([layer.bias.grad] if bias else []) + [x.grad for x in xs]
    assert all(g is not None for g in grads)
    return grads


@pytest.mark.parametrize("formats,rules", [MXINT, MXFP, (MXINT[0], {}), (MXFP[0], {})],
                         ids=["mxint-search", "mxfp-search", "mxint", "mxfp"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_kept_weight_gives_the_recomputed_gradients_bit_for_bit(formats, rules, bias, autocast):
    kept = _layer_grads(True, formats, rules, bias, autocast)
    recomputed = _layer_grads(False, formats, rules, bias, autocast)
    for a, b in zip(kept, recomputed):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_kept_weight_is_the_forward_formats_and_costs_one_weight_copy():
    """With the option the forward saves qdq(W) in the format of that forward (a backward after the
    active format changed still gets that format's gradient, as the recompute path does), and autograd
    holds exactly one weight copy more than without it."""
    torch.manual_seed(1)
    layer = MFQATLinear.from_linear(nn.Linear(64, 32), anchor_format="mxint8")
    layer.scale_rules = {}
    x = torch.randn(4, 64, requires_grad=True)
    grads = []
    for keep in (True, False):
        layer.keep_quantized_weights = keep
        layer.fmt = "mxint4"
        out = layer(x)
        layer.fmt = "mxint8"  # changed between forward and backward
        (gx,) = torch.autograd.grad(out.sum(), x)
        grads.append(gx)
    assert torch.equal(grads[0], grads[1])
    assert _saved_bytes(layer, x, True) - _saved_bytes(layer, x, False) == layer.weight.numel() * 4


def _saved_bytes(layer, x, keep: bool) -> int:
    """Bytes autograd saves for one forward of ``layer``, the parameter itself not counted."""
    layer.keep_quantized_weights = keep
    seen = []

    def pack(t):
        if t.data_ptr() != layer.weight.data_ptr():
            seen.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(seen)


def test_joint_step_with_gradient_checkpointing_matches_without_the_option():
    """A checkpointed forward rerun in backward (reentrant and not) gives the same gradients kept or recomputed."""
    formats, rules = MXINT
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    results = {}
    base = tiny_llama()
    for reentrant in (True, False):
        for keep in (True, False):
            m = copy.deepcopy(base)
            mfqat.prepare(m, QATConfig(formats=formats, schedule="joint", scale_rules=rules,
                                       keep_quantized_weights=keep))
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            m.train()
            joint_backward(m, m, {"input_ids": ids, "labels": ids}, formats, lambda f: 1.0, lambda l: l.backward())
            assert all(lin.keep_quantized_weights is keep for _, lin in qat_modules(m))
            results[reentrant, keep] = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    for reentrant in (True, False):
        a, b = results[reentrant, True], results[reentrant, False]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_checks_the_flag():
    assert QATConfig().keep_quantized_weights is False
    with pytest.raises(TypeError, match="keep_quantized_weights: expected true or false"):
        QATConfig(keep_quantized_weights=1)


def test_train_flag_reaches_the_config():
    from mfqat.train.args import build_parser
    from mfqat.train.setup import load_qat_config

    on = load_qat_config(build_parser().parse_args(["--keep-quantized-weights"]))
    off = load_qat_config(build_parser().parse_args([]))
    assert on.keep_quantized_weights is True and off.keep_quantized_weights is False
    assert on.formats == off.formats and on.scale_rules == off.scale_rules  # the recipe is otherwise the same
