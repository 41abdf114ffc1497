"""``mfqat convert`` tensor by tensor (mfqat.anchor.dequantized): the same checkpoint as loading the model in
float32 and calling ``save_pretrained`` (names, dtypes, values bit for bit, config.json and
generation_config.json), in every family where transformers saves the model's own state dict; the others (a
conversion on save) say why and are loaded whole, as before."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import mfqat
from mfqat.anchor.dequantized import save_dequantized, why_not_streamed
from mfqat.anchor.load import load_anchor
from mfqat.cli.app import main
from mfqat.models.catalog import SUPPORTED, build

from .conftest import growth_slope

ROOT = Path(__file__).resolve().parents[1]


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_checkpoint(got: Path, want: Path) -> None:
    a, b = _tensors(got), _tensors(want)
    assert sorted(a) == sorted(b), f"names differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in b:
        assert a[k].dtype == b[k].dtype, f"{k}: {a[k].dtype} against {b[k].dtype}"
        assert torch.equal(a[k], b[k]), f"{k}: values differ"
    for name in ("config.json", "generation_config.json"):
        assert (got / name).is_file() == (want / name).is_file(), name
        if (want / name).is_file():
            assert json.loads((got / name).read_text()) == json.loads((want / name).read_text()), name


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_the_streamed_convert_is_what_save_pretrained_writes_in_every_family(name, tmp_path):
    model_type, extra = SUPPORTED[name]
    path = mfqat.save_anchor(build(model_type, extra, 256), tmp_path / "a", "mxint8")
    anchor = mfqat.read_anchor(path, lazy=True)
    why = why_not_streamed(anchor)
    if why is not None:
        with pytest.raises(ValueError, match="cannot be converted tensor by tensor"):
            save_dequantized(anchor, tmp_path / "new", "mxint4")
        pytest.skip(f"{name}: loaded whole ({why})")
    load_anchor(path, "mxint4").save_pretrained(tmp_path / "old")
    assert save_dequantized(anchor, tmp_path / "new", "mxint4") == "mxint4"
    _same_checkpoint(tmp_path / "new", tmp_path / "old")


@pytest.mark.parametrize("fmt", [None, "mxint3", "affine4"])
def test_the_streamed_convert_of_tied_and_untied_anchors_in_each_kind_of_format(anchor, untied_anchor, fmt, tmp_path):
    for i, path in enumerate((anchor, untied_anchor)):
        lazy = mfqat.read_anchor(path, lazy=True)
        assert why_not_streamed(lazy) is None
        load_anchor(path, fmt).save_pretrained(tmp_path / f"old{i}")
        save_dequantized(lazy, tmp_path / f"new{i}", fmt)
        _same_checkpoint(tmp_path / f"new{i}", tmp_path / f"old{i}")


def test_the_cli_streams_a_bf16_ptq_anchor_as_the_loaded_model_saves_it(tmp_path, capsys):
    """A PTQ anchor of a bfloat16 checkpoint keeps its norms in bfloat16; the float32 model holds them upcast."""
    from transformers import AutoModelForCausalLM

    from mfqat.anchor.stream import anchor_from_folder
    from mfqat.data.sources import tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    tiny_llama(vocab_size=len(tok), layers=2).to(torch.bfloat16).save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    path = anchor_from_folder(tmp_path / "src", tmp_path / "a")
    assert any(v.dtype == torch.bfloat16 for v in mfqat.read_anchor(path).plain.values())
    main(["convert", str(path), "--to", "mxint4", "--out", str(tmp_path / "c")])
    assert "loads the whole model" not in capsys.readouterr().out
    load_anchor(path, "mxint4").save_pretrained(tmp_path / "old")
    _same_checkpoint(tmp_path / "c", tmp_path / "old")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "c").dtype == torch.float32


def test_the_dense_families_stream():
    """The families users convert most are written tensor by tensor (a regression to 'loaded whole' would pass
    the parity test above by skipping)."""
    streamed = []
    for name in ("llama", "qwen3", "mistral"):
        model_type, extra = SUPPORTED[name]
        import tempfile
        with tempfile.TemporaryDirectory() as d:
            path = mfqat.save_anchor(build(model_type, extra, 256), Path(d) / "a", "mxint8")
            streamed.append(why_not_streamed(mfqat.read_anchor(path, lazy=True)))
    assert streamed == [None, None, None], streamed


CONVERT_PROBE = r"""
import json, sys
import psutil, transformers, mfqat.anchor.dequantized, mfqat.anchor.load
from mfqat.cli.app import main
def hwm():  # this process's own high-water mark (kB)
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
base = psutil.Process().memory_info().rss // 1024
try:
    main(["convert", sys.argv[1], "--to", "mxint4", "--out", sys.argv[2]])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps({"base": base, "peak": hwm()}))
"""


def _convert_growth(tmp_path: Path, layers: int) -> tuple:
    """(peak RSS growth of a child running ``mfqat convert`` on the PTQ anchor of a bf16 Llama of ``layers``
    layers, the model's bf16 bytes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mfqat.anchor.stream import anchor_from_folder

    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    bf16 = 2 * sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / f"src{layers}", max_shard_size="20MB")
    del model
    anchor = anchor_from_folder(tmp_path / f"src{layers}", tmp_path / f"a{layers}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MFQAT_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-c", CONVERT_PROBE, str(anchor), str(tmp_path / f"c{layers}")],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "loads the whole model" not in out.stdout, out.stdout
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return (rss["peak"] - rss["base"]) * 1024, bf16


@pytest.mark.slow
def test_converts_memory_does_not_grow_with_the_model(tmp_path):
    """Issue 44: ``mfqat convert`` writes one tensor at a time. Loading the float32 model and its state dict (the
    path before) grows by ~4 bytes per bf16 byte; streamed, the peak is one float32 tensor whatever the depth."""
    slope = growth_slope(lambda layers: _convert_growth(tmp_path, layers), 2, 24)
    assert slope < 1.0, f"convert's peak grows by {slope:.2f} bytes per bf16 byte of model"
