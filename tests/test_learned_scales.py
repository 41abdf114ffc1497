"""QATConfig.learn_scales: affine scales and biases learned with the weights (LSQ-style). The gradient is
the formula's, the anchor stores what the forward used so every width loads and exports bit for bit,
and the training front ends (mfqat train, MFQATTrainer) give the scales their own learning rate."""
import json

import pytest
import torch
from transformers import TrainingArguments

import mfqat
import mfqat.export  # noqa: F401  (mfqat.export.to_mlx)
from mfqat.data.sources import tiny_llama, tiny_tokenizer
from mfqat.integrations.hf import MFQATTrainer
from mfqat.qat.joint import joint_backward
from mfqat.qat.learned_scales import learned_affine, learned_parameters, param_groups, with_learned
from mfqat.qat.prepare import qat_modules, set_format
from mfqat.quant.derive import derive_affine

FORMATS = ["mxint8", "affine4", "affine3"]


def _trained(steps: int = 3, tie: bool = True):
    """(tiny Llama trained ``steps`` joint steps with learned scales at group 32, tokenizer, token ids)."""
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok), tie=tie),
                          mfqat.QATConfig(formats=FORMATS, affine_group_size=32, learn_scales=True,
                                          quantize_embeddings=True))
    ids = torch.randint(0, len(tok), (2, 32), generator=torch.Generator().manual_seed(0))
    _train(model, ids, steps, lr=1e-4, scales_lr=2e-2)
    return model, tok, ids


def _train(model, ids, steps: int, lr: float, scales_lr: float) -> None:
    """``steps`` joint MF-QAT steps over FORMATS on ``ids``, the scales in their own optimizer group."""
    opt = torch.optim.AdamW(param_groups(model, lr, 0.0, scales_lr))
    for _ in range(steps):
        opt.zero_grad()
        joint_backward(model, model, {"input_ids": ids, "labels": ids}, FORMATS, lambda f: 1.0, lambda x: x.backward())
        opt.step()


def _assert_every_width_reproduced(model, path, ids=None) -> None:
    """Every quantized weight (fused experts per parameter) of ``load_anchor(path, fmt, group_size=32)``
    equals the trained model's forward in fmt, bit for bit, for affine4 and affine3; and the logits on ``ids``."""
    from mfqat.qat.experts import MFQATExperts
    model.eval()
    for fmt in ("affine4", "affine3"):
        loaded = mfqat.load_anchor(path, fmt, group_size=32)
        set_format(model, fmt)
        with torch.no_grad():
            for name, m in qat_modules(model):
                pairs = [(f"{name}.{n}", w) for n, w in m.mfqat_weights.items()] if isinstance(m, MFQATExperts) \
                    else [(f"{name}.weight", m)]
                for key, w in pairs:
                    assert torch.equal(loaded.get_parameter(key).float(), w.quantized_weight().float()), (fmt, key)
            if ids is not None:
                assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_the_gradient_is_the_formula_and_the_value_is_mlx_dequantize():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(8, 64, generator=g) * 0.05).requires_grad_(True)
    ac = (torch.randn(2, 8, 2, generator=g) * 0.1).requires_grad_(True)
    r = torch.randn(8, 64, generator=g)
    out = learned_affine(w, "affine4", 32, ac)
    (out * r).sum().backward()
    q = derive_affine(w.detach(), "affine4", 32)
    assert torch.equal(out.detach(), with_learned(q, ac).dequantize(torch.float32))  # bf16 arithmetic, bit for bit
    assert not torch.equal(out.detach(), q.dequantize(torch.float32))  # and the learned scales act
    codes, rb = q.codes.float().reshape(8, 2, 32), r.reshape(8, 2, 32)
    assert torch.allclose(ac.grad[0], (rb * codes).sum(-1) * q.scales, rtol=1e-5, atol=1e-7)  # dW/da = q s0
    assert torch.allclose(ac.grad[1], rb.sum(-1) * q.scales, rtol=1e-5, atol=1e-7)  # dW/dc = s0
    assert torch.equal(w.grad, r)  # straight-through to the master weight


def test_training_moves_the_scales_and_the_anchor_reproduces_every_width_bit_exact(tmp_path):
    model, tok, ids = _trained()
    moved = [p for p in learned_parameters(model) if p.detach().abs().max() > 0]
    assert moved and len(moved) == len(learned_parameters(model))
    path = mfqat.save_anchor(model, tmp_path / "anchor", tokenizer=tok, step=3)
    meta = json.loads((path / "mfqat.json").read_text())
    assert meta["format_version"] == 4 and set(meta["refined"]) == {"affine4", "affine3"}
    assert meta["refined"]["affine4"]["group_size"] == 32 and meta["refined"]["affine4"]["file"] in meta["manifest"]
    assert not [k for k in list(meta["tensors"]) + list(meta["full_precision"]) if "learned" in k]
    _assert_every_width_reproduced(model, path, ids)


def test_an_export_ships_the_scales_training_learned(tmp_path):
    pytest.importorskip("mlx_lm")
    model, tok, _ = _trained(steps=2, tie=False)
    path = mfqat.save_anchor(model, tmp_path / "anchor", tokenizer=tok)
    rep = mfqat.export.to_mlx(path, tmp_path / "mlx", recipe="uniform:affine4", group_size=32)
    assert rep["anchor_refined"] == ["affine4"] and rep["verify"]["weights_bit_exact"]
    plain = mfqat.export.to_mlx(path, tmp_path / "mlx64", recipe="uniform:affine4", group_size=64)
    assert not plain.get("anchor_refined")  # learned at group 32: another group is the derived model


def test_the_master_folder_and_the_state_dict_stay_drop_in(tmp_path):
    from mfqat.train.setup import save_master
    model, tok, ids = _trained(steps=1)
    save_master(model, tok, tmp_path / "master")
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "master" / "model.safetensors"))
    assert not [k for k in keys if "learned" in k]
    mfqat.unprepare(model)
    assert not [k for k in model.state_dict() if "learned" in k]


@pytest.mark.parametrize("kwargs, match", [
    ({"formats": ["mxint8", "mxint4"]}, "no affine width"),
    ({"formats": ["mxint8", "affine4"], "through_anchor": False}, "through_anchor"),
    ({"formats": ["mxint8", "affine4"], "learned_scales_lr": 0}, "learned_scales_lr"),
])
def test_learn_scales_without_what_it_needs_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mfqat.QATConfig(learn_scales=True, **kwargs)
    with pytest.raises(TypeError, match="learn_scales"):
        mfqat.QATConfig(formats=["mxint8", "affine4"], learn_scales="yes")


def test_mfqat_trainer_gives_the_scales_their_own_learning_rate(tmp_path):
    tok = tiny_tokenizer()
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)),
                          mfqat.QATConfig(formats=FORMATS, affine_group_size=32, learn_scales=True,
                                          learned_scales_lr=5e-3))
    ids = torch.randint(0, len(tok), (8, 32), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                             save_strategy="no", report_to=[], use_cpu=True, learning_rate=1e-5, weight_decay=0.1)
    trainer = MFQATTrainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                           processing_class=tok)
    trainer.train()
    (group,) = [g for g in trainer.optimizer.param_groups if g.get("mfqat_learned_scales")]
    assert {id(p) for p in group["params"]} == {id(p) for p in learned_parameters(model)}
    assert group["weight_decay"] == 0.0 and group["initial_lr"] == 5e-3
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(list(model.parameters()))
    trainer.save_model(str(tmp_path / "final"))
    meta = json.loads((tmp_path / "final" / "mfqat_anchor" / "mfqat.json").read_text())
    assert set(meta["refined"]) == {"affine4", "affine3"}


def test_mfqat_train_learns_scales_and_refuses_them_with_lora(tmp_path, capsys):
    from mfqat.cli.app import main
    base = ["train", "--model", "tiny", "--qat-config", "affine_joint", "--learn-scales", "--steps", "2",
            "--batch-size", "2", "--seq-len", "64", "--eval-blocks", "2", "--eval-formats", "affine4"]
    main(base + ["--out", str(tmp_path / "run")])
    meta = json.loads((tmp_path / "run" / "anchor" / "mfqat.json").read_text())
    assert set(meta["refined"]) == {"affine4", "affine3"}
    with pytest.raises(SystemExit, match="LoRA freezes"):
        main(base + ["--out", str(tmp_path / "lora"), "--lora-rank", "4"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_tied_embeddings_and_bf16_masters_store_what_they_trained(tmp_path, dtype):
    from mfqat.models.catalog import MOE, build  # the tiny random models of every family
    model = build("qwen3_moe", dict(head_dim=16, **MOE, tie_word_embeddings=True), 320).to(dtype)
    mfqat.prepare(model, mfqat.QATConfig(formats=FORMATS, affine_group_size=32, learn_scales=True,
                                         quantize_embeddings=True))
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    _train(model, ids, 2, lr=1e-3, scales_lr=5e-2)
    assert all(p.detach().abs().max() > 0 for p in learned_parameters(model))
    _assert_every_width_reproduced(model, mfqat.save_anchor(model, tmp_path / "anchor"))


def test_frozen_scales_train_nothing_and_break_nothing():
    peft = pytest.importorskip("peft")
    tok = tiny_tokenizer()
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)), mfqat.QATConfig(formats=["mxint8", "affine4"],
                                                                           affine_group_size=32, learn_scales=True))
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, len(tok), (2, 16), generator=torch.Generator().manual_seed(0))
    set_format(model, "affine4")
    lora(input_ids=ids, labels=ids).loss.backward()  # PEFT froze the scales with the base weights
    assert all(p.grad is None for p in learned_parameters(model))


def test_an_anchor_of_some_layers_or_of_another_format_is_handled(tmp_path):
    model, tok, _ = _trained(steps=1, tie=False)
    one = "model.layers.0.self_attn.q_proj.weight"
    path = mfqat.save_anchor(model, tmp_path / "subset", targets=[one])  # the other layers stay fp, no width
    loaded = mfqat.load_anchor(path, "affine4", group_size=32)
    set_format(model, "affine4")
    with torch.no_grad():
        assert torch.equal(loaded.get_parameter(one), model.get_submodule(one[:-7]).quantized_weight())
    with pytest.raises(ValueError, match="trained on the codes derived from a mxint8 anchor"):
        mfqat.save_anchor(model, tmp_path / "fp8", "mxfp8_e4m3")
    assert not (tmp_path / "fp8").exists()


def test_mlx_training_refuses_learned_scales():
    pytest.importorskip("mlx")
    from mfqat.mlx.qat import prepare as mlx_prepare
    with pytest.raises(ValueError, match="PyTorch-only"):
        mlx_prepare(object(), mfqat.QATConfig(formats=["mxint8", "affine4"], learn_scales=True))


def test_an_optimizer_the_user_passes_is_left_as_given(tmp_path):
    tok = tiny_tokenizer()
    model = mfqat.prepare(tiny_llama(vocab_size=len(tok)), mfqat.QATConfig(formats=FORMATS, affine_group_size=32,
                                                                           learn_scales=True))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    trainer = MFQATTrainer(model=model, args=args, train_dataset=[], processing_class=tok, optimizers=(opt, None))
    assert trainer.create_optimizer() is opt and len(opt.param_groups) == 1
