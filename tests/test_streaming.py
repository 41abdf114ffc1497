"""Models the size users ship: safetensors read and written one tensor at a time, anchors read lazily, PTQ
anchors quantized tensor by tensor from a sharded bf16 checkpoint, the export's check past a memory budget,
and the memory law of a streaming export (peak growth / the model's bf16 bytes), measured in a child process."""
import json
import re
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.anchor.stream import anchor_from_folder, streamable
from mfqat.data.sources import load_model, tiny_llama, tiny_tokenizer
from mfqat.export.verify import check_layers
from mfqat.storage.manifest import AnchorError
from mfqat.storage.tensor_files import ShardWriter, TensorFile, TensorFileError

from .conftest import growth_slope

ROOT = Path(__file__).resolve().parents[1]


def _copy_refused(code: int):
    def refuse(*args):
        raise OSError(code, os.strerror(code))
    return refuse


@pytest.mark.parametrize("copy", ["in the kernel", "across file systems", "no copy_file_range"])
def test_shard_writer_round_trip_in_torch_safetensors_and_mlx(tmp_path, monkeypatch, copy):
    """Each way a spill reaches its shard (mfqat.storage.tensor_files.append_file) gives the same files."""
    import errno

    import mlx.core as mx

    if copy == "across file systems":
        monkeypatch.setattr(os, "copy_file_range", _copy_refused(errno.EXDEV))
    elif copy == "no copy_file_range":
        monkeypatch.delattr(os, "copy_file_range", raising=False)

    tensors = {"a": torch.randn(3, 5), "b": torch.randint(0, 255, (7,), dtype=torch.uint8),
               "c": torch.randn(4, 4).to(torch.bfloat16), "d": torch.zeros(0, 3)}
    w = ShardWriter(tmp_path, 60)
    for k, v in tensors.items():
        w.add(k, v)
    w.add("e", np.arange(6, dtype=np.uint32).reshape(2, 3))
    w.add_chunks("f", torch.bfloat16, (4, 2), [torch.ones(2, 2, dtype=torch.bfloat16),
                                               torch.full((2, 2), 2.0, dtype=torch.bfloat16)])
    files = w.close()
    assert len(files) == 3 and (tmp_path / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) | {"e", "f"}
    got = {}
    for f in files:
        got.update(load_file(tmp_path / f))
        assert set(mx.load(str(tmp_path / f))) == set(load_file(tmp_path / f))
        with TensorFile.open(tmp_path / f) as tf:
            for k in tf.infos:
                assert torch.equal(tf.read(k), got[k])
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k
    assert got["e"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["f"].float().tolist() == [[1, 1], [1, 1], [2, 2], [2, 2]]
    assert not list(tmp_path.glob(".shard-*")), "spill files left behind"


def test_a_full_disk_while_a_shard_is_assembled_is_raised_not_hidden(tmp_path, monkeypatch):
    import errno

    monkeypatch.setattr(os, "copy_file_range", _copy_refused(errno.ENOSPC))
    w = ShardWriter(tmp_path, 1 << 20)
    w.add("x", torch.zeros(8))
    with pytest.raises(OSError, match="No space left"):
        w.close()


def test_a_tensor_that_fills_a_shard_exactly_closes_it(tmp_path):
    w = ShardWriter(tmp_path, 64)
    w.add("full", torch.zeros(16))  # 64 bytes: exactly one shard
    w.add("next", torch.zeros(1))
    files = w.close()
    assert len(files) == 2
    assert set(load_file(tmp_path / files[0])) == {"full"} and set(load_file(tmp_path / files[1])) == {"next"}


def test_chunks_that_do_not_add_up_are_refused(tmp_path):
    w = ShardWriter(tmp_path, 1 << 20)
    with pytest.raises(ValueError, match="x: chunks gave 8 bytes"):
        w.add_chunks("x", torch.float32, (3,), [torch.zeros(2)])
    w.abort()
    assert not list(tmp_path.glob(".shard-*"))


def _tensor_file(tmp_path) -> Path:
    w = ShardWriter(tmp_path, 1 << 20)
    w.add("w", torch.randn(8, 8))
    w.add("b", torch.randn(8))
    return tmp_path / w.close()[0]


@pytest.mark.parametrize("damage", ["truncated", "trailing", "gap", "header"])
def test_a_damaged_safetensors_file_is_refused_naming_it(tmp_path, damage):
    path = _tensor_file(tmp_path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    if damage == "truncated":
        data = data[:-5]
    elif damage == "trailing":
        data = data + b"\0" * 4
    elif damage == "gap":
        header = json.loads(data[8:8 + n])
        header["b"]["data_offsets"] = [o + 4 for o in header["b"]["data_offsets"]]
        text = json.dumps(header).encode()
        data = struct.pack("<Q", len(text)) + text + data[8 + n:] + b"\0" * 4
    else:
        data = struct.pack("<Q", 1 << 40) + data[8:]
    path.write_bytes(data)
    with pytest.raises(TensorFileError, match=f"^{path}: cannot read safetensors"):
        TensorFile.open(path)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny Llama saved in bfloat16 by save_pretrained, in two shards with an index, with a tokenizer."""
    tok = tiny_tokenizer()
    folder = tmp_path_factory.mktemp("stream") / "src"
    model = tiny_llama(vocab_size=len(tok), layers=3).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="100KB")
    tok.save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def test_ptq_anchor_tensor_by_tensor_equals_the_loaded_models(bf16_folder, tmp_path):
    assert streamable(bf16_folder) is None
    streamed = read_anchor(anchor_from_folder(bf16_folder, tmp_path / "s"))
    model, tok = load_model(str(bf16_folder))
    loaded = read_anchor(mfqat.save_anchor(model, tmp_path / "l", "mxint8", tok))
    assert list(streamed.quantized) == list(loaded.quantized) and streamed.quantized
    for k in loaded.quantized:
        a, b = streamed.quantized[k], loaded.quantized[k]
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales), k
    assert set(streamed.plain) == set(loaded.plain)
    for k, v in loaded.plain.items():
        assert streamed.plain[k].dtype == torch.bfloat16, "a bf16 checkpoint's plain tensors stay bf16"
        assert torch.equal(streamed.plain[k].float(), v.float()), k
    for key in ("tied", "full_precision", "block_size", "scale_rule", "scale_rules", "anchor_format"):
        assert streamed.meta[key] == loaded.meta[key], key
    assert (tmp_path / "s" / "tokenizer.json").is_file()


def test_a_checkpoint_whose_names_do_not_map_is_not_streamed(bf16_folder, tmp_path):
    import shutil

    odd = tmp_path / "odd"
    shutil.copytree(bf16_folder, odd)
    index = json.loads((odd / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    tensors = load_file(odd / shard)
    tensors["renamed." + name] = tensors.pop(name)
    from safetensors.torch import save_file
    save_file(tensors, odd / shard, metadata={"format": "pt"})
    assert "differ from the model's" in streamable(odd)


def test_stored_tensors_the_model_lacks_are_ignored_as_transformers_ignores_them(bf16_folder, tmp_path):
    """An older checkpoint's ``rotary_emb.inv_freq`` buffers: from_pretrained leaves them unused, and so does the
    stream (with a warning naming them) instead of loading the whole model."""
    import shutil
    from safetensors.torch import save_file

    old = tmp_path / "old"
    shutil.copytree(bf16_folder, old)
    index = json.loads((old / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    tensors = load_file(old / shard)
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    tensors[extra] = torch.rand(8)
    index["weight_map"][extra] = shard
    save_file(tensors, old / shard, metadata={"format": "pt"})
    (old / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.warns(UserWarning, match="rotary_emb.inv_freq"):
        assert streamable(old) is None
    want = read_anchor(anchor_from_folder(bf16_folder, tmp_path / "a"))
    with pytest.warns(UserWarning, match="ignored"):
        got = read_anchor(anchor_from_folder(old, tmp_path / "b"))
    assert set(got.plain) == set(want.plain) and set(got.quantized) == set(want.quantized)
    assert all(torch.equal(got.plain[k], v) for k, v in want.plain.items())
    assert all(torch.equal(got.quantized[k].codes, q.codes) for k, q in want.quantized.items())
    # any other stored tensor the model lacks (a scale under another name, a tower the class does not build) is
    # not dropped by guess: the folder is refused, and the model loaded (transformers decides what it means)
    tensors["model.layers.0.self_attn.q_proj.weight_scale"] = torch.ones(1)
    index["weight_map"]["model.layers.0.self_attn.q_proj.weight_scale"] = shard
    save_file(tensors, old / shard, metadata={"format": "pt"})
    (old / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "weight_scale" in streamable(old)


@pytest.fixture
def llama_renaming():
    """transformers' conversion mapping told (as a family's own mapping would) that checkpoints store the final
    norm as ``model.final_norm``; removed again after the test."""
    from transformers import conversion_mapping as cm
    from transformers.core_model_loading import WeightRenaming

    cm.register_checkpoint_conversion_mapping("LlamaForCausalLM", [WeightRenaming(r"model\.final_norm\.", "model.norm.")],
                                              overwrite=True)
    yield
    cm._checkpoint_conversion_mapping_cache.pop("LlamaForCausalLM", None)
    cm.USER_REGISTERED_MAPPINGS.discard("LlamaForCausalLM")


def test_a_tensor_transformers_renames_on_load_streams_under_the_models_name(bf16_folder, tmp_path, llama_renaming):
    import shutil
    from safetensors.torch import save_file

    renamed = tmp_path / "renamed"
    shutil.copytree(bf16_folder, renamed)
    index = json.loads((renamed / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    index["weight_map"]["model.final_norm.weight"] = shard
    tensors = load_file(renamed / shard)
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / shard, metadata={"format": "pt"})
    (renamed / "model.safetensors.index.json").write_text(json.dumps(index))
    assert streamable(renamed) is None
    want = read_anchor(anchor_from_folder(bf16_folder, tmp_path / "a"))
    got = read_anchor(anchor_from_folder(renamed, tmp_path / "b"), lazy=True)
    assert set(got.plain) == set(want.plain) and "model.norm.weight" in got.plain
    assert all(torch.equal(got.plain[k], v) for k, v in want.plain.items())


def test_a_lazy_anchor_reads_the_same_tensors_and_keeps_none(bf16_folder, tmp_path):
    path = anchor_from_folder(bf16_folder, tmp_path / "a")
    eager, lazy = read_anchor(path), read_anchor(path, lazy=True)
    for k in eager.quantized:
        assert torch.equal(lazy.quantized[k].codes, eager.quantized[k].codes), k
        assert lazy.shape(k) == tuple(eager.quantized[k].shape)
    for k in eager.plain:
        assert torch.equal(lazy.plain[k], eager.plain[k]), k
    assert not lazy.quantized._held and not lazy.plain._held, "a lazy read kept tensors in memory"


def test_a_corrupted_shard_of_a_lazy_anchor_is_refused_before_any_tensor_is_used(bf16_folder, tmp_path):
    path = anchor_from_folder(bf16_folder, tmp_path / "a", max_shard_bytes=50_000)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(AnchorError, match=f"{shard.name}: sha256 mismatch"):
        read_anchor(path, lazy=True)


def test_export_from_the_folder_streams_and_equals_the_export_of_the_loaded_model(bf16_folder, tmp_path):
    rep = mfqat.export.to_mlx(bf16_folder, tmp_path / "m", recipe="uniform:affine4")
    assert rep["ptq"] == "tensor by tensor"
    model, tok = load_model(str(bf16_folder))
    anchor = mfqat.save_anchor(model, tmp_path / "l", "mxint8", tok)
    mfqat.export.to_mlx(anchor, tmp_path / "ml", recipe="uniform:affine4")
    a, b = {}, {}
    for f in (tmp_path / "m").glob("model*.safetensors"):
        a.update(load_file(f))
    for f in (tmp_path / "ml").glob("model*.safetensors"):
        b.update(load_file(f))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_row_chunked_matrices_pass_the_cut_check_with_every_chunks_edges_sampled(bf16_folder, tmp_path, monkeypatch):
    from mfqat.export import recipes, verify

    monkeypatch.setattr(recipes, "CHUNK_ELEMENTS", 64 * 7 + 3)  # 7 rows a chunk: every matrix in chunks
    seen = {}
    real = verify.check_written

    def spy(out, plan, digests, record):
        seen.update({p: sorted(rows) for p, (_, _, rows) in record.samples.items()})
        return real(out, plan, digests, record)
    monkeypatch.setattr(verify, "check_written", spy)
    rep = mfqat.export.to_mlx(bf16_folder, tmp_path / "c", recipe="uniform:affine4", max_memory=0)["verify"]
    assert rep["weights_check"] == "every byte by sha256, sampled rows through MLX"
    gate = seen["model.layers.0.mlp.gate_proj.weight"]  # 128 rows in chunks of 7
    assert gate[:4] == [0, 6, 7, 13] and gate[-2:] == [126, 127]


def test_past_the_memory_budget_the_logits_are_checked_on_the_first_layers(bf16_folder, tmp_path):
    rep = mfqat.export.to_mlx(bf16_folder, tmp_path / "m", recipe="uniform:mxint4", max_memory=0)
    v = rep["verify"]
    assert re.fullmatch(r"first 2 of 3 layers, \d+ of 257 token ids", v["logits_checked"]), v["logits_checked"]
    assert v["weights_bit_exact"] and v["max_abs_logit_diff"] <= v["logit_tolerance"]
    assert not list((tmp_path / "m").glob(".check-*")), "the cut model was left in the export"
    full = mfqat.export.to_mlx(bf16_folder, tmp_path / "f", recipe="uniform:mxint4")["verify"]
    assert full["logits_checked"] == "whole model"


@pytest.mark.parametrize("config,k", [
    ({"num_hidden_layers": 30}, 2),
    ({"num_hidden_layers": 1}, 1),
    ({"num_hidden_layers": 8, "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["x"] * 4}, 5),
    ({"num_hidden_layers": 8, "full_attention_interval": 4}, 4),
    ({"num_hidden_layers": 8, "first_k_dense_replace": 3}, 4),
])
def test_the_cut_check_keeps_every_kind_of_layer(config, k):
    assert check_layers(config) == k


def test_a_broken_layer_past_the_cut_is_still_caught_by_the_tensor_check(bf16_folder, tmp_path, monkeypatch):
    """The cut logits check sees only the first layers: the bit-exact tensor check covers every layer."""
    from mfqat.export import mlx_export

    real = mlx_export.to_mlx_storage

    def corrupt(q, scale_dtype="float32"):
        st = real(q, scale_dtype)
        if q.shape[0] == 128 and st.biases is not None:  # the MLP's gate/up rows: flip one bias
            st.biases = st.biases.copy()
            st.biases.flat[0] += 1.0
        return st
    monkeypatch.setattr(mlx_export, "to_mlx_storage", corrupt)
    with pytest.raises(RuntimeError, match=r"export check failed: .*layers.*(elements|row \d+) differ"):
        mfqat.export.to_mlx(bf16_folder, tmp_path / "m", recipe="uniform:mxint4", max_memory=0)
    assert not (tmp_path / "m").exists()


def _model_bytes(folder: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("model*.safetensors*"))}


def test_an_export_from_the_hf_folder_writes_the_bytes_of_an_export_from_its_written_anchor(bf16_folder, tmp_path):
    """The HF path never writes its PTQ anchor (mfqat.anchor.stream.folder_anchor): same files as the two steps."""
    direct = mfqat.export.to_mlx(bf16_folder, tmp_path / "d", recipe="uniform:affine4")
    assert direct["ptq"] == "tensor by tensor"
    anchor = anchor_from_folder(bf16_folder, tmp_path / "a")
    mfqat.export.to_mlx(anchor, tmp_path / "two", recipe="uniform:affine4")
    assert _model_bytes(tmp_path / "d") == _model_bytes(tmp_path / "two")
    tok = lambda d: {f.name: f.read_bytes() for f in d.iterdir() if f.name.startswith("tokenizer")}  # noqa: E731
    assert tok(tmp_path / "d") == tok(tmp_path / "two") and tok(tmp_path / "d")
    assert not (tmp_path / "d" / "ptq-anchor").exists()


def test_a_refined_export_from_the_hf_folder_equals_the_refined_export_of_its_anchor(bf16_folder, tmp_path):
    """--refine reads every tensor at every step: from an HF folder it reads a written temporary anchor (removed)."""
    from mfqat.export.refine import RefineConfig

    cfg = RefineConfig(steps=2, batch=1, seq_len=16, n_blocks=2, n_valid=1)
    direct = mfqat.export.to_mlx(bf16_folder, tmp_path / "d", recipe="uniform:affine4", refine=cfg, verify=False)
    anchor = anchor_from_folder(bf16_folder, tmp_path / "a")
    two = mfqat.export.to_mlx(anchor, tmp_path / "two", recipe="uniform:affine4", refine=cfg, verify=False)
    assert direct["refine"]["validation_kl_after"] == two["refine"]["validation_kl_after"]
    assert _model_bytes(tmp_path / "d") == _model_bytes(tmp_path / "two")
    assert not (tmp_path / "d" / "ptq-anchor").exists()


def test_the_cut_weights_check_past_the_budget_writes_the_same_files_as_the_whole_check(bf16_folder, tmp_path):
    whole = mfqat.export.to_mlx(bf16_folder, tmp_path / "w", recipe="uniform:affine3")["verify"]
    cut = mfqat.export.to_mlx(bf16_folder, tmp_path / "c", recipe="uniform:affine3", max_memory=0)["verify"]
    assert whole["weights_check"] == "every element through MLX" and "bytes_hashed" not in whole
    assert cut["weights_check"] == "every byte by sha256, sampled rows through MLX"
    written = sum(f.stat().st_size for f in (tmp_path / "c").glob("model*.safetensors"))
    assert written - 20_000 < cut["bytes_hashed"] < written  # every tensor's bytes (the headers aside)
    assert 0 < cut["weights_checked"] < whole["weights_checked"]
    assert whole["prompt_tokens"] >= 64 and 16 <= cut["prompt_tokens"] < 64  # the cut check: fewer positions
    assert _model_bytes(tmp_path / "w") == _model_bytes(tmp_path / "c")


def test_the_cut_check_catches_bytes_that_changed_on_their_way_to_the_file(bf16_folder, tmp_path, monkeypatch):
    """A byte in the middle of a tensor (a row no sample reads) differs in the file from what the export
    computed: the sha256 of every tensor's bytes catches it."""
    from mfqat.storage import tensor_files

    real = tensor_files._Shard.assemble

    def damaged(self, dest, metadata):
        real(self, dest, metadata)
        with TensorFile.open(dest) as f:
            info = f.infos["model.layers.1.mlp.down_proj.weight"] if "model.layers.1.mlp.down_proj.weight" in f.infos \
                else None
        if info is not None:
            data = bytearray(dest.read_bytes())
            data[info.start + info.nbytes // 2] ^= 0x10
            dest.write_bytes(bytes(data))
    monkeypatch.setattr(tensor_files._Shard, "assemble", damaged)
    with pytest.raises(RuntimeError, match="export check failed: model.layers.1.mlp.down_proj.weight: the bytes in "
                                           "the written file differ"):
        mfqat.export.to_mlx(bf16_folder, tmp_path / "m", recipe="uniform:affine4", max_memory=0)
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_source_weight_with_nan_or_inf_is_refused_naming_it(bf16_folder, tmp_path, bad):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(bf16_folder, src)
    name = "model.layers.2.self_attn.o_proj.weight"
    shard = next(f for f in src.glob("*.safetensors") if name in load_file(f))
    tensors = load_file(shard)
    tensors[name][5, 7] = bad
    from safetensors.torch import save_file
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{re.escape(name)}: the weight holds NaN or Inf"):
        mfqat.export.to_mlx(src, tmp_path / "m", recipe="uniform:affine4")
    assert not (tmp_path / "m").exists()


MEMORY_PROBE = r"""
import json, resource, sys, torch
import mlx.core, mlx_lm, transformers, mfqat.export, mfqat.anchor.stream
from transformers import LlamaConfig
import psutil
def hwm():  # this process's own high-water mark (kB); ru_maxrss would also count the parent's peak at spawn
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
base = psutil.Process().memory_info().rss // 1024  # now, after the imports (their transient peak may be higher)
import mfqat.export.recipes, mfqat.export.sensitivity as sens
mfqat.export.recipes.CHUNK_ELEMENTS = 1 << 20  # the embedding in row chunks too: its transient is not the signal
blocks = sens.calibration_blocks  # auto: one calibration block of 32 tokens (what is held does not depend on them)
sens.calibration_blocks = lambda anchor, text, n_blocks=4, seq_len=128: blocks(anchor, text, 1, 32)
mfqat.export.to_mlx(sys.argv[1], sys.argv[2], recipe=sys.argv[3], max_memory=0)
print(json.dumps({"base": base, "peak": hwm()}))
"""


def _export_growth(tmp_path: Path, layers: int, recipe: str = "uniform:affine4") -> tuple:
    """(peak RSS growth of a child exporting a bf16 Llama of ``layers`` layers with ``recipe``, the model's bf16
    bytes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    src = tmp_path / f"src{layers}"
    if src.is_dir():  # built for another recipe
        return _run_growth_probe(tmp_path, src, layers, recipe, 2 * sum(p.numel() for p in model.parameters()))
    model.save_pretrained(src, max_shard_size="20MB")
    tok.save_pretrained(src)
    bf16 = 2 * sum(p.numel() for p in model.parameters())
    del model
    return _run_growth_probe(tmp_path, src, layers, recipe, bf16)


def _run_growth_probe(tmp_path: Path, src: Path, layers: int, recipe: str, bf16: int) -> tuple:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MFQAT_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(src), str(tmp_path / f"m{layers}-{recipe}"), recipe],
                         capture_output=True, text=True, env=env, check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return (rss["peak"] - rss["base"]) * 1024, bf16


@pytest.mark.slow
def test_the_streaming_exports_memory_does_not_grow_with_the_model(tmp_path):
    """The growth law of export-mlx on an HF folder: peak RSS growth (VmHWM of a child process, past its
    imports) at 2 and at 24 layers of the same width; the slope, extra peak per extra bf16 byte of model, is
    a ratio, never a time. Holding the model (the path before streaming) grows by ~3-4 bytes per bf16 byte
    here; streaming, the peak is one tensor's working set and the check's first layers whatever the depth."""
    slope = growth_slope(lambda layers: _export_growth(tmp_path, layers), 2, 24)
    assert slope < 1.0, f"the export's peak grows by {slope:.2f} bytes per bf16 byte of model"


@pytest.mark.slow
def test_an_auto_exports_memory_does_not_hold_the_model(tmp_path):
    """Issue 44: ``auto:BPW``'s sensitivity pass runs the model with each module's weights read from the anchor
    as it runs (mfqat.export.sensitivity); it used to load the whole model in float32 and the anchor beside it
    (slope ~3 bytes per bf16 byte here). The PTQ anchor is written and read back lazily. Runs to run, the peak
    of either size moves by ~50 MiB (allocator state), so the sizes are 2 and 24 layers (143 MiB of bf16 apart)
    and the bound sits between the lazy pass (0.1-0.7) and the held model (3.2)."""
    slope = growth_slope(lambda layers: _export_growth(tmp_path, layers, "auto:4.5"), 2, 24)
    assert slope < 1.5, f"the auto: export's peak grows by {slope:.2f} bytes per bf16 byte of model"


def test_eval_tensor_by_tensor_equals_loading_whole_state_dicts(bf16_folder, tmp_path):
    from mfqat.anchor.checkpoint import empty_model, load_format
    from mfqat.anchor.load import load_anchor
    from mfqat.eval.elastic import anchor_state, evaluate_anchor_formats, evaluate_formats

    path = anchor_from_folder(bf16_folder, tmp_path / "a")
    blocks = torch.randint(0, 200, (2, 32))
    formats = ["mxint6", "mxint4", "affine4"]
    whole = evaluate_formats(load_anchor(path), {f: anchor_state(read_anchor(path), f) for f in formats}, blocks)
    anchor = read_anchor(path, lazy=True)
    model = empty_model(anchor.config)
    load_format(model, anchor, None)
    model.tie_weights()
    streamed = evaluate_anchor_formats(model.eval(), anchor, formats, blocks)
    assert [r["perplexity"] for r in streamed] == [r["perplexity"] for r in whole]
    restored = load_anchor(path).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, restored[k]), f"{k}: the anchor's own format was not loaded back"


def test_cli_eval_of_an_anchor_in_bfloat16(bf16_folder, tmp_path, capsys):
    from mfqat.cli import main as cli_main

    path = anchor_from_folder(bf16_folder, tmp_path / "a")
    cli_main(["eval", str(path), "--formats", "mxint4", "--blocks", "2", "--seq-len", "32", "--dtype", "bfloat16",
              "--text", str(ROOT / "README.md"), "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert "mxint4" in out and (tmp_path / "p.png").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eval_module_by_module_prints_the_held_models_numbers(bf16_folder, tmp_path, capsys, dtype):
    """Past --max-memory (default: the memory available) an anchor is evaluated module by module
    (mfqat.export.lazy_model), each format's tensors built as the model of --dtype would hold them: the same
    perplexities to the last printed digit as the held model, the tied embedding included (SmolLM2's layout)."""
    from mfqat.cli import main as cli_main

    tok = tiny_tokenizer()
    tied = mfqat.save_anchor(tiny_llama(vocab_size=len(tok), tie=True, layers=3), tmp_path / "tied", "mxint8", tok)
    for name, path in (("bf16", anchor_from_folder(bf16_folder, tmp_path / "a")), ("tied", tied)):
        tables = []
        for budget in ([], ["--max-memory", "1MB"]):
            cli_main(["eval", str(path), "--formats", "mxint4,mxint3,affine4", "--blocks", "3", "--seq-len", "32",
                      "--dtype", dtype, "--text", str(ROOT / "README.md"), "--plot", str(tmp_path / f"{name}.png"),
                      "--overwrite", *budget])
            out = capsys.readouterr().out
            assert ("running it module by module" in out) == bool(budget), out
            tables.append(out[out.index("base ("):out.index("plot:")])
        assert tables[1] == tables[0], f"{name}: module by module\n{tables[1]}\nheld\n{tables[0]}"


def test_row_chunks_quantize_as_the_whole_tensor(bf16_folder, tmp_path, monkeypatch):
    from mfqat.anchor import stream

    whole = read_anchor(anchor_from_folder(bf16_folder, tmp_path / "w"))
    monkeypatch.setattr(stream, "CHUNK_ELEMENTS", 3 * 64 + 7)  # 3 rows a chunk, an uneven last chunk
    chunked = read_anchor(anchor_from_folder(bf16_folder, tmp_path / "c"))
    for k, q in whole.quantized.items():
        assert torch.equal(chunked.quantized[k].codes, q.codes) and torch.equal(chunked.quantized[k].scales, q.scales), k


@pytest.mark.parametrize("recipe", ["uniform:affine4", "uniform:mxint4", "uniform:mxfp4_e2m1"])
def test_large_matrices_written_in_row_chunks_equal_the_whole_tensor_export(bf16_folder, tmp_path, monkeypatch, recipe):
    from mfqat.export import recipes

    whole = mfqat.export.to_mlx(bf16_folder, tmp_path / "w", recipe=recipe)
    monkeypatch.setattr(recipes, "CHUNK_ELEMENTS", 64 * 7 + 3)  # 7 rows a chunk, an uneven last chunk
    chunked = mfqat.export.to_mlx(bf16_folder, tmp_path / "c", recipe=recipe)
    assert chunked["verify"]["weights_checked"] == whole["verify"]["weights_checked"]
    a, b = {}, {}
    for f in (tmp_path / "w").glob("model*.safetensors"):
        a.update(load_file(f))
    for f in (tmp_path / "c").glob("model*.safetensors"):
        b.update(load_file(f))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("recipe", ["uniform:affine6", "uniform:affine3"])
def test_refined_matrices_written_in_row_chunks_equal_the_whole_tensor_export(bf16_folder, tmp_path, monkeypatch,
                                                                               recipe):
    """A matrix with --refine's learned scales is written (and checked) in row chunks too, each chunk with its
    rows' learned scales: a 3B model's embedding at affine6 written whole took 13 GB."""
    from mfqat.export import recipes
    from mfqat.export.refine import RefineConfig

    cfg = RefineConfig(steps=3, batch=1, seq_len=16, n_blocks=2, n_valid=1)
    whole = mfqat.export.to_mlx(bf16_folder, tmp_path / "w", recipe=recipe, refine=cfg)
    assert whole["refine"]["kept"], "the learned scales were not kept: nothing to write"
    monkeypatch.setattr(recipes, "CHUNK_ELEMENTS", 64 * 7 + 3)  # 7 rows a chunk, an uneven last chunk
    chunked = mfqat.export.to_mlx(bf16_folder, tmp_path / "c", recipe=recipe, refine=cfg)
    assert chunked["verify"]["weights_checked"] == whole["verify"]["weights_checked"]
    assert _model_bytes(tmp_path / "c") == _model_bytes(tmp_path / "w")


def test_the_cut_check_counts_the_layers_of_a_vision_language_releases_text_config():
    from mfqat.export.verify import cut_config

    cfg = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 8, "layer_types": ["a", "a", "a", "b"] * 2}}
    assert check_layers(cfg) == 4
    cut = cut_config(cfg, 4)
    assert cut["text_config"]["num_hidden_layers"] == 4 and cut["text_config"]["layer_types"] == ["a", "a", "a", "b"]
    assert cfg["text_config"]["num_hidden_layers"] == 8, "the anchor's own config was changed"


def _logits(config: dict, state: dict, ids: list) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[config["model_type"]].from_dict(config), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing), (missing, unexpected)
    model.tie_weights()
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits


def test_the_checks_vocabulary_cut_gives_the_whole_models_logits_on_the_kept_ids(bf16_folder, tmp_path, monkeypatch):
    """The cut logits check keeps a few token ids' rows of the embedding and head (VocabCut): the cut
    reference model's logits are the whole model's on those ids, in the renumbered order (the row-chunked
    dequantization of large matrices included)."""
    from mfqat.export import recipes, verify
    from mfqat.export.recipes import build_plan

    anchor = read_anchor(anchor_from_folder(bf16_folder, tmp_path / "a"))
    plan = build_plan(anchor, "uniform:affine4")
    ids = [5, 17, 17, 200, 3, 130]
    full = _logits(anchor.config, dict(verify.reference_tensors(anchor, plan)), ids)
    monkeypatch.setattr(verify.VocabCut, "FIRST", 4)
    monkeypatch.setattr(recipes, "CHUNK_ELEMENTS", 64 * 5 + 1)  # the embedding dequantized in row chunks
    vocab = verify.VocabCut(anchor.config["vocab_size"], ids, anchor.config)
    state = dict(verify.reference_tensors(anchor, plan, vocab=vocab))
    assert state["model.embed_tokens.weight"].shape[0] == len(vocab.ids) < anchor.config["vocab_size"]
    assert {5, 17, 200, 3, 130, 0, 1, 2} <= set(vocab.ids.tolist())
    cut = _logits(vocab.config(anchor.config), state, vocab.tokens(ids))
    torch.testing.assert_close(cut, full[..., vocab.ids], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "phi3", "gemma3_text", "gpt_neox", "deepseek_v3", "qwen3_5_moe"])
def test_every_familys_export_passes_the_cut_check(name, tmp_path, monkeypatch):
    """Past the memory budget the logits check runs on the first layers and a few token ids: it passes on
    families with other special tokens (phi3), embedding scaling and softcaps (gemma3), untied heads
    (gpt_neox), dense-then-MoE layers (deepseek_v3) and hybrid linear attention (qwen3_5_moe)."""
    from mfqat.export import verify
    from mfqat.models.catalog import SUPPORTED, build

    monkeypatch.setattr(verify.VocabCut, "FIRST", 8)
    tok = tiny_tokenizer()
    model_type, extra = SUPPORTED[name]
    anchor = mfqat.save_anchor(build(model_type, extra, len(tok)), tmp_path / "a", "mxint8", tokenizer=tok)
    rep = mfqat.export.to_mlx(anchor, tmp_path / "m", recipe="uniform:mxint4", max_memory=0)
    assert re.fullmatch(r"first \d+ of \d+ layers, \d+ of 257 token ids", rep["verify"]["logits_checked"])


REPEAT_EXPORT = r"""
import sys, mfqat.export
mfqat.export.to_mlx(sys.argv[1], sys.argv[2], recipe="seed", verify=False)
"""


def test_an_export_is_the_same_bytes_whatever_the_hash_seed(tmp_path):
    """Two exports of one anchor in processes with different hash seeds write identical files (config.json's
    per-module entries for bfloat16-kept tensors came from a set, in hash order)."""
    from mfqat.models.catalog import SUPPORTED, build

    tok = tiny_tokenizer()
    model_type, extra = SUPPORTED["qwen3_5"]
    anchor = mfqat.save_anchor(build(model_type, extra, len(tok)), tmp_path / "a", "mxint8", tokenizer=tok)
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MFQAT_PROGRESS": "0", "PYTHONHASHSEED": seed}
        subprocess.run([sys.executable, "-c", REPEAT_EXPORT, str(anchor), str(tmp_path / seed)], env=env, check=True,
                       capture_output=True)
        outs.append(tmp_path / seed)
    cfg = json.loads((outs[0] / "config.json").read_text())
    assert sum(v is False for v in cfg["quantization"].values()) >= 2  # several bfloat16-kept modules
    stamped = ("mfqat_export.json", "README.md")  # they name the output folder
    names = sorted(p.name for p in outs[0].iterdir() if p.is_file() and p.name not in stamped)
    assert names == sorted(p.name for p in outs[1].iterdir() if p.is_file() and p.name not in stamped)
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
