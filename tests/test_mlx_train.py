"""`mfqat mlx-train` runtime parity: resume, gradient checkpointing, clipping, weight decay, memory."""
import json

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from mlx.utils import tree_flatten  # noqa: E402

import mfqat  # noqa: E402
from mfqat.mlx import runtime  # noqa: E402
from mfqat.mlx.models import load_for_training  # noqa: E402
from mfqat.mlx.train import main as mlx_train, train_steps  # noqa: E402


def _run(tiny_dir, out, *extra):
    return mlx_train([str(tiny_dir), "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "1",
                      "--lr", "3e-3", "--eval-formats", "mxint4", "--out", str(out), *extra])


def test_resumed_run_gives_the_uninterrupted_losses_and_anchor(tiny_dir, tmp_path):
    full = _run(tiny_dir, tmp_path / "full", "--save-every", "2", "--weight-decay", "0.1")
    assert (tmp_path / "full" / "checkpoint-2" / "optimizer.safetensors").is_file()
    resumed = _run(tiny_dir, tmp_path / "res", "--resume", str(tmp_path / "full" / "checkpoint-2"),
                   "--weight-decay", "0.1")
    assert resumed["start_step"] == 2 and len(full["losses"]) == 4
    assert resumed["losses"] == full["losses"][2:]
    a, b = mfqat.read_anchor(tmp_path / "full" / "anchor"), mfqat.read_anchor(tmp_path / "res" / "anchor")
    assert all(np.array_equal(a.quantized[k].codes, b.quantized[k].codes) for k in a.quantized)
    assert all(np.array_equal(a.plain[k], b.plain[k]) for k in a.plain)
    with pytest.raises(FileNotFoundError, match="not an mlx-train checkpoint"):
        _run(tiny_dir, tmp_path / "bad", "--resume", str(tmp_path / "full"))


def test_grad_checkpoint_same_losses_and_memory_reported(tiny_dir, tmp_path):
    before = mx.get_memory_limit()
    try:
        plain = _run(tiny_dir, tmp_path / "plain", "--formats", "mxint4", "--schedule", "fixed")
        ck = _run(tiny_dir, tmp_path / "ck", "--formats", "mxint4", "--schedule", "fixed", "--grad-checkpoint",
                  "--memory-limit", "3", "--cache-limit", "0.5")
        assert mx.get_memory_limit() == 3 * 1024 ** 3
    finally:
        mx.set_memory_limit(before)
    np.testing.assert_allclose(ck["losses"], plain["losses"], rtol=1e-5)
    assert ck["grad_checkpoint_blocks"] == 2 and plain["grad_checkpoint_blocks"] == 0
    assert ck["memory_limit_gib"] == 3 and ck["cache_limit_gib"] == 0.5
    assert plain["peak_memory_mib"] > 0
    assert json.loads((tmp_path / "ck" / "summary.json").read_text())["peak_memory_mib"] > 0


def test_checkpoint_layers_recomputes_in_backward(tiny_dir):
    model, _, _ = load_for_training(str(tiny_dir))
    calls = []
    layer_cls = type(model.layers[0])
    assert runtime.checkpoint_layers(model) == len(model.layers)
    assert type(model.layers[0]).__name__ == f"Checkpointed{layer_cls.__name__}"
    assert type(load_for_training(str(tiny_dir))[0].layers[0]) is layer_cls  # the class itself untouched
    orig = layer_cls.__call__
    layer_cls.__call__ = lambda self, *a, **k: calls.append(1) or orig(self, *a, **k)
    try:
        batch = mx.array(np.random.default_rng(0).integers(0, 200, (2, 17)).astype(np.int32))
        train_steps(model, iter([batch]), 1, lr=1e-3)
    finally:
        layer_cls.__call__ = orig
    assert len(calls) > len(model.layers)  # forward + recomputation in backward


def test_grad_clip_and_weight_decay_take_effect(tiny_dir):
    batch = mx.array(np.random.default_rng(1).integers(0, 200, (2, 17)).astype(np.int32))

    def params(**kw):
        model, _, _ = load_for_training(str(tiny_dir))
        train_steps(model, iter([batch] * 2), 2, lr=1e-2, **kw)
        return dict(tree_flatten(model.parameters()))
    base, clipped, decayed = params(grad_clip=0), params(grad_clip=1e-4), params(grad_clip=0, weight_decay=0.5)
    k = "model.layers.0.mlp.up_proj.weight"
    assert not np.array_equal(np.array(base[k]), np.array(clipped[k]))
    assert np.abs(np.array(decayed[k])).sum() < np.abs(np.array(base[k])).sum()


def test_lora_alpha_targets_layers_reach_the_adapters_and_mlx_lm_loads_them(tiny_dir, tmp_path):
    from mlx_lm.utils import load_adapters

    s = _run(tiny_dir, tmp_path / "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-layers", "1",
             "--lora-targets", "self_attn.q_proj,mlp.down_proj")
    cfg = json.loads((tmp_path / "lora" / "adapters" / "adapter_config.json").read_text())
    assert cfg["num_layers"] == 1 and cfg["lora_parameters"]["scale"] == 2.0  # alpha / rank
    assert cfg["lora_parameters"]["keys"] == ["self_attn.q_proj", "mlp.down_proj"]
    trained = mx.load(str(tmp_path / "lora" / "adapters" / "adapters.safetensors"))
    last = len(load_for_training(str(tiny_dir))[0].layers) - 1
    assert trained and all(k.startswith(f"model.layers.{last}.") and ("q_proj" in k or "down_proj" in k)
                           for k in trained), sorted(trained)
    model, _, _ = load_for_training(str(tiny_dir))
    load_adapters(model, str(tmp_path / "lora" / "adapters"))  # mlx-lm's own loader takes the config
    got = [k for k, _ in tree_flatten(model.parameters()) if ".lora_" in k]
    assert sorted(got) == sorted(trained) and s["adapters"]
