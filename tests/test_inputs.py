"""Inputs that used to pass silently or fail later with a misleading message (issue 13)."""
import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.qat import QATConfig
from mfqat.quant.kernels import cpp

BAD_CONFIGS = [
    (dict(block_size=0), ValueError, "QATConfig.block_size"),
    (dict(block_size=-32), ValueError, "QATConfig.block_size"),
    (dict(block_size=48), ValueError, "QATConfig.block_size"),
    (dict(block_size="32"), TypeError, "QATConfig.block_size"),
    (dict(block_size=True), TypeError, "QATConfig.block_size"),
    (dict(scale_rule="bogus"), ValueError, "QATConfig.scale_rule"),
    (dict(activation_format="bogus"), ValueError, "QATConfig.activation_format"),
    (dict(activation_format="nf4"), ValueError, "QATConfig.activation_format"),
    (dict(mask_saturated="no"), TypeError, "QATConfig.mask_saturated"),
    (dict(quantize_embeddings="yes"), TypeError, "QATConfig.quantize_embeddings"),
    (dict(quantize_activations=1), TypeError, "QATConfig.quantize_activations"),
    (dict(repeats=0), ValueError, "QATConfig.repeats"),
    (dict(repeats="2"), TypeError, "QATConfig.repeats"),
    (dict(seed=1.5), TypeError, "QATConfig.seed"),
    (dict(formats=[]), ValueError, "QATConfig.formats"),
    (dict(formats="mxint4"), TypeError, "QATConfig.formats"),
    (dict(formats=["nf4"]), ValueError, "QATConfig.formats"),
    (dict(schedule=3), TypeError, "QATConfig.schedule"),
    (dict(layer_formats=["mxint4"]), TypeError, "QATConfig.layer_formats"),
    (dict(layer_formats={"mlp": []}), ValueError, "QATConfig.layer_formats"),
    (dict(layer_formats={"mlp": ["affine4"]}), ValueError, "QATConfig.layer_formats"),
    (dict(layer_formats={"mlp(": ["mxint4"]}), ValueError, "QATConfig.layer_formats"),
    (dict(targets="layers.(\\d"), ValueError, "QATConfig.targets: invalid regular expression"),
    (dict(targets=[3]), TypeError, "QATConfig.targets"),
    (dict(exclude=["ok", "[bad"]), ValueError, "QATConfig.exclude: invalid regular expression"),
]


@pytest.mark.parametrize("kwargs,exc,field", BAD_CONFIGS, ids=[str(c[0]) for c in BAD_CONFIGS])
def test_qatconfig_rejects_bad_fields_at_construction(kwargs, exc, field):
    with pytest.raises(exc, match=field.replace("(", r"\(").replace("[", r"\[")):
        QATConfig(**kwargs)


def test_qatconfig_from_yaml_validates(tmp_path):
    path = tmp_path / "qat.yaml"
    path.write_text("formats: [mxint4]\nschedule: fixed\nblock_size: '32'\n")
    with pytest.raises(TypeError, match="QATConfig.block_size"):
        QATConfig.from_yaml(path)


@pytest.mark.parametrize("call", [mfqat.quantize, mfqat.fake_quantize])
def test_block_size_zero_is_not_the_default(call):
    with pytest.raises(ValueError, match="block_size=0"):
        call(torch.randn(2, 64), "mxint4", 0)


def test_mlx_block_size_zero_is_not_the_default():
    mx = pytest.importorskip("mlx.core")
    from mfqat.mlx import quant as mq

    x = mx.zeros((2, 64))
    for call in (mq.quantize, mq.qdq, mq.fake_quantize):
        with pytest.raises(ValueError, match="block_size=0"):
            call(x, "mxint4", 0)


def test_prepare_twice_says_already_prepared():
    model = mfqat.prepare(tiny_llama(), QATConfig(formats=["mxint4"], schedule="fixed"))
    with pytest.raises(ValueError, match="already prepared"):
        mfqat.prepare(model, QATConfig(formats=["mxint8"], schedule="fixed"))
    mfqat.unprepare(model)
    mfqat.prepare(model, QATConfig(formats=["mxint8"], schedule="fixed"))  # allowed again


def test_mlx_prepare_twice_says_already_prepared():
    pytest.importorskip("mlx.core")
    import mlx.nn as nn

    from mfqat.mlx.qat import prepare

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(64, 64)]

    model = prepare(Tiny(), QATConfig(formats=["mxint4"], schedule="fixed"))
    with pytest.raises(ValueError, match="already prepared"):
        prepare(model, QATConfig(formats=["mxint8"], schedule="fixed"))


@pytest.mark.skipif(not cpp.AVAILABLE, reason="the C++ extension is not built")
def test_forced_cpp_on_meta_tensor_names_the_device(monkeypatch):
    monkeypatch.setenv("MFQAT_BACKEND", "cpp")
    with pytest.raises(RuntimeError, match="meta tensors are not supported") as info:
        mfqat.fake_quantize(torch.empty(4, 32, device="meta"), "mxint4")
    assert "not built" not in str(info.value)
