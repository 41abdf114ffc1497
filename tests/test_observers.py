"""Static activation observers (QATConfig.activation_observer = "window_minmax", mfqat/qat/observers.py)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.qat import WindowMinMaxObserver, joint_backward
from mfqat.qat.observers import int8_channel_fake_quant


def test_window_keeps_only_the_last_w_training_inputs():
    obs = WindowMinMaxObserver(4, window=3).train()
    big = torch.tensor([[100.0, -200.0, 1.0, 1.0]])
    obs(big)
    small = [torch.tensor([[1.0, -2.0, 3.0, -4.0]]) * k for k in (1, 2, 3)]
    for i, x in enumerate(small):
        obs(x)
        if i < 2:  # the big entry is still inside the window
            assert obs.range()[:2].tolist() == [100.0, 200.0]
    assert obs.range().tolist() == [3.0, 6.0, 9.0, 12.0]  # max |x| of the last 3 only
    obs.eval()
    obs(big)  # eval forwards do not enter the window
    assert obs.range().tolist() == [3.0, 6.0, 9.0, 12.0]


def test_clip_rate_on_a_constructed_input():
    obs = WindowMinMaxObserver(8, window=2).train()
    obs(torch.ones(5, 8))  # a_c = 1 for every channel
    obs.clip_rate(reset=True)
    x = torch.full((2, 10, 8), 0.5)
    x[0, :3, 2] = 1.5  # 3 elements above a_c
    x[1, 4, 7] = -7.0  # and one below -a_c
    x[1, 5, :] = 1.0  # exactly a_c: not clipped
    obs.eval()
    out = obs(x)
    assert obs.clip_rate() == pytest.approx(4 / x.numel())
    assert out[0, 0, 2].item() == 1.0 and out[1, 4, 7].item() == -1.0
    obs.clip_rate(reset=True)
    assert obs.clip_rate() == 0.0  # reset


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-3, 1e3))
def test_fake_quant_is_on_the_int8_grid_with_clipped_gradient(seed, spread):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, 16, generator=g) * spread).requires_grad_()
    amax = torch.rand(16, generator=g) * spread * 2
    amax[0] = 0.0
    q, clipped = int8_channel_fake_quant(x, amax)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    k = q.detach() / scale
    assert (k - torch.round(k)).abs().max() <= 1e-4 and k.abs().max() <= 127 + 1e-4  # float ulps of k * s / s
    inside = x.detach().abs() <= amax
    bound = (scale / 2 + amax * 1e-6).expand_as(x)  # half a step, plus float32 rounding of k * s
    assert torch.all((q.detach() - x.detach()).abs()[inside] <= bound[inside])
    assert torch.all(q.detach()[:, 0] == 0)
    assert clipped.item() == int((~inside).sum())
    q.sum().backward()
    assert torch.equal(x.grad, inside.float())


def test_default_config_has_no_observer_and_bad_values_are_refused():
    assert mfqat.QATConfig().activation_observer is None
    m = mfqat.prepare(tiny_llama(), mfqat.QATConfig())
    assert not any(isinstance(x, WindowMinMaxObserver) for x in m.modules())
    with pytest.raises(ValueError, match="activation_observer.*window_minmax"):
        mfqat.QATConfig(activation_observer="minmax")
    with pytest.raises(ValueError, match="observer_window"):
        mfqat.QATConfig(activation_observer="window_minmax", observer_window=0)
    with pytest.raises(ValueError, match="quantize_activations"):
        mfqat.QATConfig(activation_observer="window_minmax", quantize_activations=True)


def test_observer_changes_the_forward_but_not_the_state_dict():
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = mfqat.prepare(tiny_llama(), mfqat.QATConfig())
    obs = mfqat.prepare(tiny_llama(), mfqat.QATConfig(activation_observer="window_minmax", observer_window=4))
    assert list(obs.state_dict()) == list(plain.state_dict())  # the window is not in the state_dict
    obs.train()
    obs(input_ids=ids * 0 + 1)  # observe a narrow range, then a wide input clips
    with torch.no_grad():
        a, b = plain(input_ids=ids).logits, obs.eval()(input_ids=ids).logits
    assert not torch.equal(a, b)
    rates = mfqat.clip_rates(obs)
    assert len(rates) == 14 and 0 < max(rates.values()) <= 1


def test_joint_step_fills_the_window_once_per_format_and_trains():
    cfg = mfqat.QATConfig(activation_observer="window_minmax", observer_window=8)
    model = mfqat.prepare(tiny_llama(), cfg).train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ctl = model.mfqat_controller
    for step in range(2):
        ctl.set_step(model, step, 2)
        losses = joint_backward(model, model, {"input_ids": ids, "labels": ids}, ctl.step_formats(step, 2),
                                cfg.weight_of, lambda loss: loss.backward())
        assert set(losses) == set(cfg.formats) and all(v == v for v in losses.values())
    observers = [m for m in model.modules() if isinstance(m, WindowMinMaxObserver)]
    assert observers and all(o.filled == 2 * len(cfg.formats) for o in observers)
    assert all(p.grad is not None for n, p in model.named_parameters() if "proj" in n)
    assert 0 <= mfqat.qat.mean_clip_rate(model) <= 1


def test_train_loop_reports_the_clip_rate_and_saves_a_plain_anchor(tmp_path):
    from mfqat.train.loop import main as train_main
    cfg = tmp_path / "obs.yaml"
    cfg.write_text("qat:\n  formats: [mxint8, mxint4]\n  schedule: joint\n  activation_observer: window_minmax\n"
                   "  observer_window: 4\n")
    common = ["--model", "tiny", "--steps", "3", "--seq-len", "32", "--qat-config", str(cfg)]
    summary = train_main(common + ["--out", str(tmp_path / "run")])
    assert 0 <= summary["activation_clip_rate"] <= 1
    mfqat.load_anchor(tmp_path / "run" / "anchor", "mxint4")  # the window is not part of the anchor
    with pytest.raises(SystemExit, match="gradient-checkpointing"):
        train_main(common + ["--out", str(tmp_path / "gc"), "--gradient-checkpointing"])
