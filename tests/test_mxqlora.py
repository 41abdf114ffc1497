"""MX-QLoRA: LoRA on a frozen anchor held as packed MX codes; one adapter for every format."""
import json

import pytest
import torch

import mfqat
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.mxqlora.model import (MXFrozenLinear, load_with_adapter, lora_parameters, mx_qlora_model,
                           save_mx_adapter, set_base_format)

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def anchor(tmp_path_factory):
    path = tmp_path_factory.mktemp("mxq") / "anchor"
    mfqat.save_anchor(tiny_llama(), path, "mxint8", tokenizer=tiny_tokenizer())
    return path


def test_base_is_packed_codes_and_matches_load_anchor(anchor):
    model = mx_qlora_model(anchor, rank=4)
    layers = [m for m in model.modules() if isinstance(m, MXFrozenLinear)]
    assert layers and all(m.packed.dtype == torch.uint8 and m.packed.numel() == m.in_features * m.out_features
                          for m in layers)  # 1 byte/weight for MXINT8, no float copy
    assert [n for n, p in model.named_parameters() if p.requires_grad] == \
           [n for n, _ in model.named_parameters() if ".lora_" in n]
    x = torch.randint(0, 256, (2, 16))
    for fmt in ["mxint8", "mxint4"]:
        set_base_format(model, fmt)  # adapters start at B = 0: exactly the anchor in fmt
        with torch.no_grad():
            assert torch.equal(model(input_ids=x).logits, mfqat.load_anchor(anchor, fmt)(input_ids=x).logits)


def test_one_adapter_two_slices_same_logits_as_peft_on_load_anchor(anchor, tmp_path):
    torch.manual_seed(0)
    model = mx_qlora_model(anchor, rank=4, alpha=8)
    opt = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    x = torch.randint(0, 256, (2, 16))
    for fmt in ["mxint8", "mxint6", "mxint4"]:
        set_base_format(model, fmt)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.abs().sum() > 0 for p in lora_parameters(model))
    save_mx_adapter(model, tmp_path / "adapter")
    model.eval()
    for fmt in ["mxint8", "mxint4"]:
        set_base_format(model, fmt)
        with torch.no_grad():
            ours = model(input_ids=x).logits
            peft_logits = load_with_adapter(anchor, tmp_path / "adapter", fmt)(input_ids=x).logits
        assert torch.equal(ours, peft_logits)


def test_backward_recomputes_the_weight_of_the_forward_format(anchor):
    """The input gradient through a frozen MX layer is grad @ W(fmt) for the format of the forward."""
    layer = next(m for m in mx_qlora_model(anchor, rank=2).modules() if isinstance(m, MXFrozenLinear))
    x = torch.randn(3, layer.in_features, requires_grad=True)
    layer.fmt = "mxint4"
    y = layer(x)
    layer.fmt = "mxint8"  # switching after forward must not change this backward
    y.sum().backward()
    w4 = layer.weight_in("mxint4", torch.float32)
    assert torch.equal(x.grad, torch.ones(3, layer.out_features) @ w4)


def test_refuses_formats_the_anchor_cannot_reach(anchor):
    model = mx_qlora_model(anchor, rank=2)
    with pytest.raises(ValueError, match="cannot slice mxint8 to mxfp4"):
        set_base_format(model, "mxfp4")


def test_cli_trains_and_reports(anchor, tmp_path):
    from mfqat.cli import main

    main(["mx-qlora", str(anchor), "--formats", "mxint8,mxint4", "--steps", "2", "--seq-len", "16",
          "--batch-size", "2", "--eval-blocks", "2", "--lora-rank", "2", "--out", str(tmp_path / "o"),
          "--mlx-adapter-path", str(tmp_path / "mlx")])
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert [r["format"] for r in s["eval"]] == ["mxint8", "mxint4"] and s["peak_memory_mib"] > 0
    assert s["seconds_per_step"] == s["train_seconds"] / 2 and s["final_loss"] == s["losses"][-1]
    assert s["s_per_step"] == s["seconds_per_step"]  # the key's name up to 0.1.0, kept one release
    assert (tmp_path / "o" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "mlx" / "adapters.safetensors").is_file() and s["mlx_adapter"] == str(tmp_path / "mlx")


def test_building_never_allocates_a_float_copy_of_a_target_weight(anchor):
    """The peak-memory property: targets go from the anchor's codes to packed layers directly
    (the model is built on the meta device), so no float tensor of a target's shape is ever filled.
    (accelerate's init_empty_weights creates each parameter with an uninitialized ``empty`` before
    moving it to meta: those pages are never touched, so they are not counted.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = {tuple(e["shape"]) for e in mfqat.read_anchor(anchor).meta["tensors"].values()}
    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta \
                        and tuple(t.shape) in shapes and not str(func).startswith("aten.empty"):
                    made.append((str(func), tuple(t.shape)))
            return out

    with Record():
        model = mx_qlora_model(anchor, rank=2)
    assert not made, made[:3]
    assert not [n for n, p in model.named_parameters() if p.is_meta]


def test_gradient_checkpointing_gives_the_same_adapter_gradients(anchor, monkeypatch):
    from mfqat.mxqlora.train import enable_checkpointing

    calls = []
    weight_in = MXFrozenLinear.weight_in
    monkeypatch.setattr(MXFrozenLinear, "weight_in", lambda self, *a: calls.append(1) or weight_in(self, *a))
    x = torch.randint(0, 256, (2, 16))
    grads, counts = [], []
    for ckpt in (False, True):
        calls.clear()
        torch.manual_seed(0)
        model = mx_qlora_model(anchor, rank=2)
        with torch.no_grad():
            for p in lora_parameters(model):
                p.normal_(0, 0.1)  # B = 0 would make A's gradient vanish
        if ckpt:
            enable_checkpointing(model)
        model.train()
        set_base_format(model, "mxint4")
        model(input_ids=x, labels=x).loss.backward()
        grads.append([p.grad for p in lora_parameters(model)])
        counts.append(len(calls))
    n = sum(isinstance(m, MXFrozenLinear) for m in model.modules())
    assert counts[1] >= counts[0] + n  # every layer's forward really runs again in backward
    assert all(torch.equal(a, b) for a, b in zip(*grads))
