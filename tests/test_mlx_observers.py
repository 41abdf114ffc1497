"""The window_minmax activation observer on MLX: bit-exact with PyTorch for the same window."""
import numpy as np
import pytest
import torch

import mfqat
from mfqat.qat import WindowMinMaxObserver as TorchObserver

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from mfqat.mlx.observers import WindowMinMaxObserver, clip_rates  # noqa: E402
from mfqat.mlx.qat import prepare, set_format  # noqa: E402
from mfqat.qat.modules import MFQATLinear as TorchLinear  # noqa: E402


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [nn.Linear(64, 64), nn.Linear(64, 32)]

    def __call__(self, x):
        return self.layers[1](nn.relu(self.layers[0](x)))


def inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, 64, generator=g) * (1 + 2 * (i % 3)) for i in range(n)]


def test_mlx_observer_matches_pytorch_bit_exactly_step_by_step():
    """Same window updates and the same float32 ops (clip, divide, round half-to-even, multiply):
    outputs and clip counts are equal bit for bit, training and eval."""
    t, m = TorchObserver(64, window=4).train(), WindowMinMaxObserver(64, window=4)
    m.train()
    for x in inputs(7) + [None]:
        if x is None:  # then a frozen eval forward on a wide input
            t.eval(), m.eval()
            x = torch.randn(3, 5, 64) * 9
        a, b = t(x).numpy(), np.array(m(mx.array(x.numpy())))
        assert a.tobytes() == b.tobytes()
        np.testing.assert_array_equal(t.range().numpy(), np.array(m.range()))
    assert t.clip_rate() == m.clip_rate() > 0


def test_mlx_rounds_ties_to_even_as_pytorch():
    """a_c = 127 gives a step of 1: x = k + 0.5 are exact ties (round half to even on both)."""
    t, m = TorchObserver(64, window=1).train(), WindowMinMaxObserver(64, window=1)
    m.train()
    t(torch.full((1, 64), 127.0)), m(mx.full((1, 64), 127.0))
    t.eval(), m.eval()
    x = torch.arange(-32, 32, dtype=torch.float32).reshape(1, 64) + 0.5
    a, b = t(x).numpy(), np.array(m(mx.array(x.numpy())))
    assert a.tobytes() == b.tobytes() and a[0, 32] == 0.0 and a[0, 33] == 2.0


def test_mlx_linear_with_observer_equals_pytorch_for_the_same_window():
    """PyTorch and MLX MFQATLinear (mxint4 weight + observer) on the same weight and window: the
    quantized activations are bit-exact; the matmul output within 1e-5 relative (the two
    backends sum the dot products in a different order)."""
    cfg = mfqat.QATConfig(activation_observer="window_minmax", observer_window=3, targets=r"layers\.",
                          formats=["mxint4"], schedule="fixed")
    model = prepare(TwoLinear(), cfg)
    set_format(model, "mxint4")
    layer = model.layers[0]
    w = torch.tensor(np.array(layer.weight))
    tl = TorchLinear(64, 64, bias=True, block_size=32)
    with torch.no_grad():
        tl.weight.copy_(w), tl.bias.copy_(torch.tensor(np.array(layer.bias)))
    tl.fmt = "mxint4"
    tl.act_observer = TorchObserver(64, 3)
    for x in inputs(5, seed=3):  # fill both windows by training forwards
        tl.act_observer.train()(x)
        layer.act_observer.train()
        layer.act_observer(mx.array(x.numpy()))
    tl.eval(), model.eval()
    x = torch.randn(4, 64) * 6
    np.testing.assert_array_equal(tl.act_observer(x).numpy(), np.array(layer.act_observer(mx.array(x.numpy()))))
    np.testing.assert_allclose(tl(x).detach().numpy(), np.array(layer(mx.array(x.numpy()))), rtol=1e-5, atol=1e-5)


def test_mlx_training_steps_fill_the_window_and_report_clip_rates():
    cfg = mfqat.QATConfig(activation_observer="window_minmax", observer_window=2, targets=r"layers\.")
    model = prepare(TwoLinear(), cfg)
    model.train()
    assert not any("_mins" in k for k, _ in __import__("mlx.utils").utils.tree_flatten(model.parameters()))

    def loss(mdl, x):
        return (mdl(x) ** 2).mean()

    vg = nn.value_and_grad(model, loss)
    for x in inputs(3):
        value, grads = vg(model, mx.array(x.numpy()))
        mx.eval(value, grads)
        assert np.isfinite(value.item())
    assert all(len(o._mins) == 2 for _, o in model.named_modules() if isinstance(o, WindowMinMaxObserver))
    rates = clip_rates(model)
    assert set(rates) == {"layers.0", "layers.1"} and all(0 <= r <= 1 for r in rates.values())


def test_mlx_train_cli_reports_the_clip_rate(tmp_path):
    from mfqat.data.sources import tiny_llama, tiny_tokenizer
    from mfqat.mlx.train import main as mlx_train
    tok = tiny_tokenizer()
    tiny_llama(vocab_size=len(tok), tie=True).save_pretrained(tmp_path / "tiny", safe_serialization=True)
    tok.save_pretrained(tmp_path / "tiny")
    cfg = tmp_path / "obs.yaml"
    cfg.write_text("qat:\n  formats: [mxint8, mxint4]\n  activation_observer: window_minmax\n  observer_window: 4\n")
    common = [str(tmp_path / "tiny"), "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-blocks", "1",
              "--qat-config", str(cfg), "--eval-formats", "mxint4"]
    summary = mlx_train(common + ["--out", str(tmp_path / "run")])
    assert 0 <= summary["activation_clip_rate"] <= 1 and len(summary["losses"]) == 2
    with pytest.raises(SystemExit, match="grad-checkpoint"):
        mlx_train(common + ["--out", str(tmp_path / "gc"), "--grad-checkpoint"])
