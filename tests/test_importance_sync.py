"""The search rule's importance across processes and across resumes.

* Under DDP (2 gloo ranks, different data per rank) ``sync_importance`` before each optimizer step
  makes every rank search with the same importance - the sum over both ranks' inputs - so the searched
  low-bit weights agree across ranks, as the weights themselves do.
* An HF ``Trainer`` run with ``MFQATCallback`` resumed from a checkpoint gives the uninterrupted run's
  anchor bit for bit: the callback saves and restores the importance statistic.
"""
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mfqat
from mfqat.data.sources import tiny_llama
from mfqat.qat.joint import joint_backward
from mfqat.qat.prepare import qat_modules

from .conftest import free_port

FORMATS = ["mxint8", "mxint6", "mxint4"]
SEARCH = {"mxint6": "search", "mxint4": "search"}


def _ddp_worker(rank: int, port: int, out: str, sync: bool = True) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = mfqat.prepare(tiny_llama(vocab_size=320), mfqat.QATConfig(formats=FORMATS, schedule="joint",
                                                                       scale_rules=SEARCH))
    model.train()
    wrapped = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7 + rank)  # each rank its own data
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            batch = torch.randint(0, 320, (2, 32), generator=g)
            joint_backward(wrapped, model, {"input_ids": batch, "labels": batch}, FORMATS, lambda f: 1.0,
                           lambda loss: loss.backward())
            if sync:
                mfqat.sync_importance(model)
            opt.step()
            opt.zero_grad()
    report = {"warned": any("sync_importance" in str(w.message) for w in caught)}
    if not sync:
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
        return dist.destroy_process_group()
    for name, lin in qat_modules(model):
        report[name] = {"tokens": lin.importance_tokens, "importance": lin.importance().tolist(),
                        "mxint4": lin.quantized_weight("mxint4").sum().item()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def test_ddp_ranks_search_with_the_same_summed_importance(tmp_path):
    mp.spawn(_ddp_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0.pop("warned") is False and r1.pop("warned") is False
    assert r0.keys() == r1.keys() and len(r0) > 0
    for name in r0:
        # 3 steps x 2 ranks x 64 tokens, all folded (the last sync ran before the last step)
        assert r0[name]["tokens"] == r1[name]["tokens"] == 3 * 2 * 64, name
        assert r0[name]["importance"] == r1[name]["importance"], name
        assert r0[name]["mxint4"] == r1[name]["mxint4"], name


def test_ddp_without_sync_warns_that_the_importance_is_stale(tmp_path):
    """An own DDP loop that never calls sync_importance is told so (from the second step on)."""
    mp.spawn(_ddp_worker, args=(free_port(), str(tmp_path), False), nprocs=2, join=True)
    for r in (0, 1):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["warned"] is True, f"rank {r}"


@pytest.mark.slow
def test_trainer_resume_keeps_the_importance_statistic(tmp_path):
    from transformers import TrainingArguments

    from mfqat.integrations.hf import MFQATTrainer

    ids = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(3))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def run(out: Path, steps: int, resume=None):
        torch.manual_seed(0)
        model = mfqat.prepare(tiny_llama(), mfqat.QATConfig(formats=FORMATS, schedule="joint", scale_rules=SEARCH))
        args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-3,
                                 save_steps=2, report_to=[], use_cpu=True, seed=0, data_seed=0,
                                 dataloader_drop_last=True, lr_scheduler_type="constant")
        trainer = MFQATTrainer(model=model, args=args, train_dataset=data)
        trainer.train(resume_from_checkpoint=resume)
        trainer.save_model(str(out / "final"))
        return mfqat.read_anchor(out / "final" / "mfqat_anchor")

    whole = run(tmp_path / "whole", 4)
    run(tmp_path / "part", 2)
    assert (tmp_path / "part" / "checkpoint-2" / "mfqat_importance_rank0.pt").is_file()
    resumed = run(tmp_path / "part", 4, resume=str(tmp_path / "part" / "checkpoint-2"))
    for k, q in whole.quantized.items():
        assert torch.equal(q.importance, resumed.quantized[k].importance), k
        assert torch.equal(q.codes, resumed.quantized[k].codes), k


def _recorded_model():
    torch.manual_seed(5)
    model = mfqat.prepare(tiny_llama(), mfqat.QATConfig(formats=FORMATS, schedule="joint", scale_rules=SEARCH))
    ids = torch.randint(0, 256, (2, 16))
    joint_backward(model, model, {"input_ids": ids, "labels": ids}, FORMATS, lambda f: 1.0, lambda l: l.backward())
    mfqat.set_format(model, "mxint8")
    model(ids)  # one more anchor-format forward: pending records
    return model


def test_checkpointed_importance_keeps_pending_records_and_a_new_rank_takes_rank0s(tmp_path):
    from mfqat.qat import importance_state

    model = _recorded_model()
    _, lin = next(qat_modules(model))
    assert lin.importance_tokens > 0 and lin.pending_tokens > 0
    importance_state.save_state(model, tmp_path, 0)
    for rank, pending in ((0, lin.pending_tokens), (3, 0)):  # rank 3 of a run resumed on more processes
        other = mfqat.prepare(tiny_llama(), mfqat.QATConfig(formats=FORMATS, schedule="joint", scale_rules=SEARCH))
        assert importance_state.load_state(other, tmp_path, rank)
        _, lin2 = next(qat_modules(other))
        assert lin2.importance_tokens == lin.importance_tokens and lin2.pending_tokens == pending
        assert torch.equal(lin2.importance_sum, lin.importance_sum)
    assert not importance_state.load_state(model, tmp_path / "empty", 0)
