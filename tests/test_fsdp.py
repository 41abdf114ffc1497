"""FSDP2 on 2 CPU gloo ranks: MF-QAT steps run sharded, the anchor is written from the gathered full
state dict and equals the DDP anchor of the same seed; a sharded model without it gets a clear error.
The anchor saved rank by rank (save_anchor_sharded, what mfqat train uses) equals the full-gather one."""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mfqat

from .conftest import free_port


def _worker(rank: int, port: int, out: str, tie: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mfqat.data.sources import tiny_llama
    from mfqat.storage.sharded import full_state_dict, is_sharded

    report = {}
    for mode in ("ddp", "fsdp"):
        model = tiny_llama(vocab_size=320, tie=tie)
        mfqat.prepare(model, mfqat.QATConfig(formats=["mxint8", "mxint4"], schedule="cyclic"))
        model.train()
        if mode == "fsdp":
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            wrapped = model
        else:
            wrapped = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(7 + rank)
        for step in range(4):
            model.mfqat_controller.set_step(model, step, 4)
            batch = torch.randint(0, 320, (2, 32), generator=g)
            wrapped(input_ids=batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
        if mode == "fsdp":
            report["sharded"] = is_sharded(model)
            if rank == 0:
                with pytest.raises(ValueError, match="full_state_dict"):
                    mfqat.save_anchor(model, Path(out) / "refused")
                report["refused"] = True
        sd = full_state_dict(model)  # every rank
        if rank == 0:
            mfqat.save_anchor(model, Path(out) / mode, "mxint8", state_dict=sd if mode == "fsdp" else None)
        dist.barrier()
    if rank == 0:
        (Path(out) / "report.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _assert_same_tensors(a, b) -> None:
    """Two anchors hold the same quantized tensors (codes, scales) and plain tensors (dtype, values)."""
    assert a.quantized.keys() == b.quantized.keys() and len(a.quantized) > 0
    assert a.plain.keys() == b.plain.keys() and len(a.plain) > 0
    for k in a.quantized:
        assert torch.equal(a.quantized[k].codes, b.quantized[k].codes), k
        assert torch.equal(a.quantized[k].scales, b.quantized[k].scales), k
    for k in a.plain:
        assert a.plain[k].dtype == b.plain[k].dtype and torch.equal(a.plain[k], b.plain[k]), k


@pytest.mark.parametrize("tie", [False, True])
def test_fsdp_anchor_equals_ddp_anchor(tmp_path, tie):
    mp.spawn(_worker, args=(free_port(), str(tmp_path), tie), nprocs=2, join=True)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report == {"sharded": True, "refused": True}
    a, b = mfqat.read_anchor(tmp_path / "ddp"), mfqat.read_anchor(tmp_path / "fsdp")
    meta_a, meta_b = (json.loads((tmp_path / m / "mfqat.json").read_text()) for m in ("ddp", "fsdp"))
    assert meta_a["tied"] == meta_b["tied"] and bool(meta_a["tied"]) == tie
    _assert_same_tensors(a, b)
    from mfqat.data.sources import tiny_llama
    init = tiny_llama(vocab_size=320, tie=tie).state_dict()["model.embed_tokens.weight"]
    assert not torch.equal(b.plain["model.embed_tokens.weight"], init)  # the sharded steps trained it


def _launch(config: str, out: Path, *extra: str):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(root / "mfqat" / "configs" / "accelerate" / f"{config}.yaml"), "--main_process_port", str(free_port()),
           str(root / "scripts" / "train.py"), "--model", "tiny", "--steps", "3", "--seq-len", "32",
           "--eval-blocks", "1", "--out", str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)


def test_train_with_the_fsdp_config_shards_and_saves_the_ddp_anchor(tmp_path):
    """`accelerate launch --config_file fsdp.yaml scripts/train.py` on CPU: really sharded (not the DDP
    fallback), joint MF-QAT steps reduced once per step, the anchor byte-identical to the DDP run's."""
    for config in ("fsdp", "ddp"):
        r = _launch(config, tmp_path / config, "--grad-clip", "0", "--eval-formats", "mxint4")
        assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "fsdp" / "summary.json").read_text())
    assert summary["fsdp"].startswith("fully_shard") and "fsdp" not in json.loads(
        (tmp_path / "ddp" / "summary.json").read_text())
    assert summary["formats"] == ["mxint8+mxint6+mxint4"] * 3  # the joint step: 3 backwards per step
    saved = summary["anchor_save"]  # each rank wrote its part; none received more than one whole tensor at a time
    assert saved["path"] == "per-rank" and saved["ranks"] == 2 and all(n > 0 for n in saved["rank_bytes"])
    assert 0 < saved["max_gathered_bytes"] < saved["state_dict_bytes"] / 2
    ddp_eval = json.loads((tmp_path / "ddp" / "summary.json").read_text())["eval"]
    assert [r["format"] for r in summary["eval"]] == [r["format"] for r in ddp_eval]  # evaluated sharded
    for r, d in zip(summary["eval"], ddp_eval):
        assert abs(r["perplexity"] - d["perplexity"]) < 1e-3 * d["perplexity"], (r, d)
    a, b = (mfqat.read_anchor(tmp_path / c / "anchor") for c in ("ddp", "fsdp"))
    assert a.quantized.keys() == b.quantized.keys() and a.plain.keys() == b.plain.keys()
    assert all(torch.equal(a.quantized[k].codes, b.quantized[k].codes) for k in a.quantized)
    assert all(torch.equal(a.plain[k], b.plain[k]) for k in a.plain)
    for k in a.quantized:  # the default recipe's search rule: the gathered copy keeps rank 0's importance
        assert b.quantized[k].importance is not None, k
        torch.testing.assert_close(a.quantized[k].importance, b.quantized[k].importance)
    r = _launch("fsdp", tmp_path / "master", "--grad-clip", "0", "--save-master")  # the master keeps the gather
    assert r.returncode == 0, r.stderr[-3000:]
    master = json.loads((tmp_path / "master" / "summary.json").read_text())
    assert master["anchor_save"]["path"] == "per-rank" and (tmp_path / "master" / "master" / "config.json").is_file()
    (fp,), top = master["eval"], summary["eval"][-1]  # evaluated on rank 0's gathered copy: the same perplexity
    assert fp["format"] == top["format"] and abs(fp["perplexity"] - top["perplexity"]) < 1e-3 * top["perplexity"]
    c = mfqat.read_anchor(tmp_path / "master" / "anchor")
    assert all(torch.equal(a.quantized[k].codes, c.quantized[k].codes) for k in a.quantized)
    r = _launch("fsdp", tmp_path / "refused", "--save-every", "1")
    assert r.returncode != 0 and "--save-every" in r.stderr and "not supported with FSDP" in r.stderr


VOCAB = 128  # embeddings of a size that spreads the quantized tensors over both ranks


def _per_rank_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.fsdp import fully_shard

    from mfqat.anchor.sharded_save import RankError, save_anchor_sharded
    from mfqat.data.sources import byte_tokenizer, tiny_llama
    from mfqat.storage.sharded import full_state_dict

    tok = byte_tokenizer()
    model = tiny_llama(vocab_size=VOCAB, tie=True)
    mfqat.prepare(model, mfqat.QATConfig(formats=["mxint8", "mxint4"], schedule="cyclic"))
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7 + rank)
    for step in range(2):
        model.mfqat_controller.set_step(model, step, 2)
        batch = torch.randint(0, VOCAB, (2, 32), generator=g)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
    sd = full_state_dict(model)  # the full-gather save, as before
    if rank == 0:
        mfqat.save_anchor(model, Path(out) / "gather", "mxint8", tok, step=2, schedule={"s": 1}, state_dict=sd)
    del sd
    dist.barrier()
    info = save_anchor_sharded(model, Path(out) / "per-rank", "mxint8", tok, step=2, schedule={"s": 1},
                               max_shard_bytes=16 * 1024)  # several files per rank
    try:  # rank 0 refuses to overwrite without overwrite=True: every rank hears of it, none hangs
        save_anchor_sharded(model, Path(out) / "per-rank", "mxint8")
        info["refused"] = None
    except (RankError, FileExistsError, ValueError) as e:
        info["refused"] = str(e)
    with torch.no_grad():  # a NaN in rank 1's shard of one weight: its owner refuses, every rank raises, nothing is left
        if rank == 1:
            model.model.layers[1].mlp.down_proj.weight.to_local()[0, 0] = float("nan")
    try:
        save_anchor_sharded(model, Path(out) / "nan", "mxint8")
        info["nan"] = None
    except ValueError as e:
        info["nan"] = str(e)
    (Path(out) / f"report{rank}.json").write_text(json.dumps(info))
    dist.destroy_process_group()


def test_per_rank_anchor_equals_the_full_gather_anchor(tmp_path):
    """Each rank quantizes and writes its own part: the anchor holds the same tensors, codes and metadata
    as the full-gather save; no rank received more than one whole tensor at a time; it loads."""
    mp.spawn(_per_rank_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    infos = [json.loads((tmp_path / f"report{r}.json").read_text()) for r in range(2)]
    info = infos[0]
    assert info["refused"] and "rank 0" in infos[1]["refused"]  # rank 1 raised rank 0's refusal
    assert all("down_proj.weight" in i["nan"] and "NaN" in i["nan"] for i in infos), infos
    assert not (tmp_path / "nan").exists() and not [p for p in tmp_path.iterdir() if "nan" in p.name]
    a, b = mfqat.read_anchor(tmp_path / "gather"), mfqat.read_anchor(tmp_path / "per-rank")
    _assert_same_tensors(a, b)
    meta_a, meta_b = (json.loads((tmp_path / m / "mfqat.json").read_text()) for m in ("gather", "per-rank"))
    for m in (meta_a, meta_b):
        for k in ("files", "manifest", "digest"):
            m.pop(k)
    assert json.dumps(meta_a) == json.dumps(meta_b)  # the same entries, in the same order; ties, step, schedule
    assert meta_b["tied"] and meta_b["step"] == 2
    index = json.loads((tmp_path / "per-rank" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(b.meta["files"])
    assert len(b.meta["files"]) == info["files"] > 2  # several files per rank
    assert all(n > 0 for n in info["rank_bytes"]) and len(info["rank_bytes"]) == 2  # both ranks wrote a part
    largest = max(v.numel() * v.element_size() for v in tiny_state().values())
    assert info["max_gathered_bytes"] == largest < info["state_dict_bytes"]
    x, y = (mfqat.load_anchor(tmp_path / m, fmt="mxint4").state_dict() for m in ("gather", "per-rank"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    from mfqat.export import to_mlx

    from safetensors.torch import load_file

    for m in ("gather", "per-rank"):  # the MLX export reads it unchanged: the same tensors, bit for bit (the
        # full-precision ones in the anchor's file order, which differs)
        to_mlx(tmp_path / m, tmp_path / f"mlx-{m}", recipe="uniform:affine4", verify=False)
    x, y = (load_file(tmp_path / f"mlx-{m}" / "model.safetensors") for m in ("gather", "per-rank"))
    assert x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)


def tiny_state() -> dict:
    """The unique (untied) tensors of the tied tiny model the worker saves."""
    from mfqat.data.sources import tiny_llama

    model = tiny_llama(vocab_size=VOCAB, tie=True)
    mfqat.prepare(model, mfqat.QATConfig(formats=["mxint8", "mxint4"], schedule="cyclic"))
    return {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
