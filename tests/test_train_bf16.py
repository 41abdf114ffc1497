"""`mfqat train --dtype bfloat16` (issue 44 item 3): bfloat16 master weights, gradients and optimizer state.

The MF-QAT forward of a bfloat16 master computes, bit for bit, what the reference quantizers give for a
float32 copy of the same values (and returns it in bfloat16); a run keeps every parameter and Adam state
in bfloat16 and writes an anchor that loads and exports as a float32 run's does; flags that contradict a
bfloat16 master are one error line before any model loads.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.formats import get_format
from mfqat.qat import QATConfig
from mfqat.qat.prepare import prepare, qat_modules, set_format
from mfqat.quant.derive import derive_affine
from mfqat.quant.reference import mx_fake_quantize_blocks, to_blocks
from mfqat.quant.scale_search import quantize_search
from mfqat.train.loop import main as train_main

from .conftest import one_line_exit_2

ROOT = Path(__file__).resolve().parents[1]


def reference_qdq(w32: torch.Tensor, fmt: str, mod) -> torch.Tensor:
    """What format ``fmt`` of an MF-QAT module trains on, from the reference quantizers alone (float32):
    the anchor's rounding, then the format's own rule (floor, search with the module's importance, or
    MLX's affine derivation)."""
    bs, anchor = mod.block_size, mod.anchor_format

    def mx(x, f, rule="floor"):
        return mx_fake_quantize_blocks(to_blocks(x, bs), get_format(f), rule)[0].reshape(x.shape)
    base = mx(w32, anchor)
    if fmt == anchor:
        return base
    if get_format(fmt).family == "affine":
        return derive_affine(base, fmt, mod.affine_group_size).dequantize(torch.float32)
    if (mod.scale_rules or {}).get(fmt) == "search":
        return quantize_search(base, fmt, bs, mod.importance()).dequantize(torch.float32)
    return mx(base, fmt, (mod.scale_rules or {}).get(fmt, "floor"))


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("recipe", ["mxint_joint_search", "mxfp_joint_search", "affine_joint"])
def test_a_bf16_master_fake_quantizes_to_the_reference_of_its_float32_copy_bit_for_bit(recipe, backend,
                                                                                       monkeypatch):
    monkeypatch.setenv("MFQAT_BACKEND", backend)
    cfg = QATConfig(**QATConfig.read_yaml(recipe))
    model = prepare(tiny_llama(vocab_size=320, seed=3).to(torch.bfloat16), cfg)
    model.train()
    ids = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    for f in cfg.formats:  # the anchor-format forward records the importance the search weighs with
        set_format(model, f)
        model(input_ids=ids)
    mods = list(qat_modules(model))
    assert mods
    for name, mod in mods:
        w32 = mod.weight.detach().float()
        for f in cfg.formats:
            q = mod.quantized_weight(f)
            assert q.dtype == torch.bfloat16, (name, f, q.dtype)
            ref = reference_qdq(w32, f, mod)
            assert torch.equal(q.float(), ref), (name, f, (q.float() - ref).abs().max())


def test_train_dtype_bfloat16_keeps_a_bf16_master_and_writes_an_anchor_that_loads_and_exports(tmp_path):
    out = tmp_path / "run"
    s = train_main(["--model", "tiny", "--dtype", "bfloat16", "--steps", "1", "--seq-len", "32", "--batch-size",
                    "2", "--eval-blocks", "1", "--save-master", "--save-every", "1", "--lr", "1e-3",
                    "--out", str(out)])
    assert s["master_dtype"] == "bfloat16" and s["eval"][-1]["bits/weight"] == 16
    with safe_open(out / "master" / "model.safetensors", "pt") as f:  # the master weights as trained
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    opt = torch.load(out / "checkpoint-1" / "optimizer.bin", weights_only=True)
    moments = [t for st in opt["state"].values() for k, t in st.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}  # Adam's state too
    meta = json.loads((out / "anchor" / "mfqat.json").read_text())
    assert meta["step"] == 1 and meta["anchor_format"] == "mxint8"
    for fmt in ("mxint8", "mxint4"):
        loaded = mfqat.load_anchor(out / "anchor", fmt)
        logits = loaded(input_ids=torch.arange(32).reshape(1, 32)).logits
        assert torch.isfinite(logits).all()
    run = subprocess.run([sys.executable, "-m", "mfqat", "export-mlx", str(out / "anchor"), "--out",
                          str(tmp_path / "mlx"), "--recipe", "uniform:mxint4"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "MFQAT_PROGRESS": "0"})
    assert run.returncode == 0 and "weights bit-exact: True" in run.stdout, run.stdout + run.stderr


REFUSED = [
    (["--dtype", "bfloat16", "--mixed-precision", "fp16"], "--dtype bfloat16 with --mixed-precision fp16"),
    (["--dtype", "bfloat16", "--base", "nf4", "--lora-rank", "4", "--no-qat"], "--dtype bfloat16 with --base nf4"),
    (["--dtype", "bfloat16", "--base", "int8", "--lora-rank", "4", "--no-qat"], "--dtype bfloat16 with --base int8"),
]


@pytest.mark.parametrize("flags,expect", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_flags_that_contradict_a_bf16_master_are_one_line_exit_2_before_any_model_loads(flags, expect, tmp_path,
                                                                                         capsys, monkeypatch):
    from mfqat.cli import app

    monkeypatch.setattr(app, "_run", lambda *a, **k: pytest.fail("the command ran: the mistake was not caught"))
    one_line_exit_2(["train", "--model", "tiny", "--out", str(tmp_path / "o"), *flags], capsys, expect)


def test_dtype_bfloat16_with_bf16_autocast_is_accepted():
    from mfqat.train.args import build_parser, check_train_args

    check_train_args(build_parser().parse_args(["--dtype", "bfloat16", "--mixed-precision", "bf16"]))


def test_resume_refuses_a_checkpoint_of_another_master_dtype(tmp_path):
    from mfqat.train.args import build_parser, check_resume, run_identity

    ck = tmp_path / "checkpoint-1"
    ck.mkdir()
    written = build_parser().parse_args(["--model", "tiny"])  # a float32 run wrote it
    (ck / "mfqat_step.json").write_text(json.dumps({"step": 1, "run": run_identity(written)}))
    check_resume(build_parser().parse_args(["--model", "tiny", "--resume", str(ck)]))
    with pytest.raises(ValueError, match="--dtype float32 there, bfloat16 here"):  # Adam's float32 state
        check_resume(build_parser().parse_args(["--model", "tiny", "--dtype", "bfloat16", "--resume", str(ck)]))
