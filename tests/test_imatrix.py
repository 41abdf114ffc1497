"""llama.cpp imatrix GGUF as AWQ input: written with gguf-py's GGUFWriter in llama.cpp's layout, read back."""
import copy

import numpy as np
import pytest
import torch
from gguf import GGUFWriter

from mfqat.cli import main
from mfqat.data.sources import calibration_blocks, tiny_llama, tiny_tokenizer
from mfqat.export.awq import apply_awq, awq_pairs
from mfqat.anchor.importance import activation_sums, importance_matrix
from mfqat.export.imatrix import imatrix_for_model, read_imatrix

# HF module -> the GGUF name convert_hf_to_gguf.py gives it (written out by hand: checks gguf-py's map)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(module: str) -> str:
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest]}.weight"


def write_imatrix(path, sums, counts, skip=()):
    """An imatrix GGUF as llama-imatrix writes it: general.type, imatrix.* keys, in_sum2 + counts per matrix."""
    w = GGUFWriter(str(path), arch="llama")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["pydoc"])
    w.add_uint32("imatrix.chunk_count", 4)
    w.add_uint32("imatrix.chunk_size", 32)
    for module in sorted(sums):
        if module.endswith("lm_head") or module in skip:
            continue
        name = gguf_name(module)
        w.add_tensor(name + ".in_sum2", sums[module].numpy().astype(np.float32).reshape(1, -1))
        w.add_tensor(name + ".counts", np.array([[counts[module]]], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def calibrated():
    tok = tiny_tokenizer()
    model = tiny_llama(vocab_size=len(tok))
    blocks = calibration_blocks(tok, n_blocks=4, seq_len=32)
    sums, counts = activation_sums(model, blocks)
    return model, tok, blocks, sums, counts


def test_imatrix_gguf_gives_the_same_awq_scales(calibrated, tmp_path):
    model, _, blocks, sums, counts = calibrated
    path = write_imatrix(tmp_path / "imatrix.gguf", sums, counts)
    consumers = [c[0] for _, c in awq_pairs(model)]
    assert len(consumers) == 8  # 4 pairs x 2 layers (heads == kv heads: v_proj -> o_proj included)
    read = imatrix_for_model(model, path, consumers)
    own = importance_matrix(model, blocks)
    for name in consumers:
        assert torch.equal(read[name], own[name]), name
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    stats_own = apply_awq(a, blocks)
    stats_gguf = apply_awq(b, None, imatrix=read)
    assert stats_own == stats_gguf
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)


def test_pooled_expert_rows(tmp_path):
    w = GGUFWriter(str(tmp_path / "moe.gguf"), arch="llama")
    w.add_type("imatrix")
    w.add_tensor("blk.0.ffn_down_exps.weight.in_sum2", np.array([[1, 2], [3, 6]], dtype=np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight.counts", np.array([[1], [3]], dtype=np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    assert read_imatrix(tmp_path / "moe.gguf")["blk.0.ffn_down_exps.weight"].tolist() == [1.0, 2.0]


def test_truncated_file_names_the_file(calibrated, tmp_path):
    _, _, _, sums, counts = calibrated
    path = write_imatrix(tmp_path / "imatrix.gguf", sums, counts)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="imatrix.gguf: not a readable GGUF"):
        read_imatrix(path)


def test_not_an_imatrix(tmp_path):
    w = GGUFWriter(str(tmp_path / "model.gguf"), arch="llama")
    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 2), dtype=np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    with pytest.raises(ValueError, match="model.gguf: a GGUF of general.type 'none'"):
        read_imatrix(tmp_path / "model.gguf")


def test_missing_tensor_cli_one_line(calibrated, tmp_path, capsys):
    model, tok, _, sums, counts = calibrated
    src = tmp_path / "fp"
    model.save_pretrained(src)
    tok.save_pretrained(src)
    bad = write_imatrix(tmp_path / "partial.gguf", sums, counts, skip={"model.layers.1.mlp.down_proj"})
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["export-mlx", str(src), "--out", str(tmp_path / "m"), "--awq", "--imatrix-path", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("mfqat export-mlx: error: ")
    assert "partial.gguf: no tensor blk.1.ffn_down.weight.in_sum2" in err and "model.layers.1.mlp.down_proj" in err
    assert not (tmp_path / "m").exists()


def test_a_missing_imatrix_is_named_before_anything_loads(calibrated, tmp_path, capsys):
    model, tok = calibrated[:2]
    model.save_pretrained(tmp_path / "fp")
    tok.save_pretrained(tmp_path / "fp")
    with pytest.raises(SystemExit) as e:
        main(["export-mlx", str(tmp_path / "fp"), "--out", str(tmp_path / "m"), "--imatrix-path", "x.gguf"])
    assert e.value.code == 2 and "--imatrix-path x.gguf: no such imatrix GGUF file" in capsys.readouterr().err


def test_wrong_width(calibrated, tmp_path):
    model, _, _, sums, counts = calibrated
    short = {k: (v[:32] if k == "model.layers.0.mlp.gate_proj" else v) for k, v in sums.items()}
    path = write_imatrix(tmp_path / "other.gguf", short, counts)
    with pytest.raises(ValueError, match="other.gguf: tensor blk.0.ffn_gate.weight.in_sum2 has 32 channels"):
        imatrix_for_model(model, path, [c[0] for _, c in awq_pairs(model)])


def test_export_mlx_awq_from_imatrix(calibrated, tmp_path):
    """The export path folds the same scales as AWQ on mfqat's own calibration of the same text."""
    from mfqat.export import to_mlx

    model, tok, blocks, sums, counts = calibrated
    model.save_pretrained(tmp_path / "fp")
    tok.save_pretrained(tmp_path / "fp")
    path = write_imatrix(tmp_path / "imatrix.gguf", sums, counts)
    rep = to_mlx(tmp_path / "fp", tmp_path / "m", recipe="uniform:mxint8", awq=True, imatrix_path=str(path),
                 verify=False)
    assert rep["imatrix"] == str(path) and rep["awq"] == apply_awq(copy.deepcopy(model), blocks)


def test_imatrix_search_reads_no_tensor_to_mark_a_lazy_anchor(calibrated, tmp_path):
    """``export-mlx HF --imatrix-path`` (no --awq) marks the lazily read anchor from its shapes: no tensor is
    built (quantized from the source, or read from an anchor's files) until the export asks for it, and every
    one it builds afterwards carries the imatrix importance."""
    from mfqat.anchor.stream import close_anchor, folder_anchor
    from mfqat.export.scale_search import imatrix_search

    model, tok, _, sums, counts = calibrated
    model.save_pretrained(tmp_path / "fp")
    anchor = folder_anchor(tmp_path / "fp", "mxint8")
    built = []
    build = anchor.quantized._build
    anchor.quantized._build = lambda name: built.append(name) or build(name)
    try:
        rep = imatrix_search(anchor, str(write_imatrix(tmp_path / "imatrix.gguf", sums, counts)))
        assert rep["tensors"] == 14 and built == []
        q = anchor.quantized["model.layers.0.mlp.down_proj.weight"]
        assert q.slice_rules["mxint4"] == "search" and q.importance is not None
    finally:
        close_anchor(anchor)
