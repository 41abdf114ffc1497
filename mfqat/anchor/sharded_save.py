"""The anchor of a sharded (FSDP2) model saved rank by rank: no full state dict on any rank.

:func:`save_anchor_sharded` is a collective (call it on every rank). Each tensor of the model's state
dict has an owner rank (the largest first, each to the least loaded rank by the bytes it takes in the
anchor; the same on every rank). The tensors are taken one at a time and only the owner receives the
whole tensor (a ``gather`` of the row shards, or of the replicated value), quantizes it exactly as
:func:`mfqat.anchor.checkpoint.save_anchor` would and writes it at once into its own weight file(s) in
rank 0's partial folder. So no rank holds more than one whole tensor (and its codes) beyond its own
shards. The files are then named ``model-0000i-of-0000n.safetensors``, numbered across ranks, and
rank 0, after a small gather of each rank's metadata (tensor entries, file names, sha256), writes the
index, config, tokenizer and ``mfqat.json`` and swaps the folder in. The result is the anchor
``save_anchor`` writes from the gathered state dict, tensor for tensor and entry for entry; only how
the tensors are split over files differs. The ranks must share the filesystem the anchor is written to.
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from mfqat._build import __version__
from mfqat.anchor.checkpoint import META_FILE, anchor_plan, check_state, write_side_files
from mfqat.anchor.meta import BASE_FORMAT_VERSION, SEARCH_FORMAT_VERSION
from mfqat.anchor.tensors import full_precision, quantize_targets, recorded_importance
from mfqat.qat.learned_scales import pop_learned
from mfqat.quant.scale_rules import SEARCH_RULE
from mfqat.storage.io import PathLike, atomic_directory, sha256_file, write_json
from mfqat.storage.manifest import seal
from mfqat.storage.shard_files import INDEX_FILE, MAX_SHARD_BYTES, shard_file_names, write_index
from mfqat.storage.sharded import unique_state_dict
from mfqat.storage.tensor_files import ShardWriter


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the whole tensor (of a DTensor: the global shape, not this rank's shard)."""
    return t.numel() * t.element_size()


def owners(sizes: Dict[str, int], world: int) -> Dict[str, int]:
    """{tensor: rank}, the same on every rank: the largest tensors first, each to the least loaded rank so
    far (ties: the earlier tensor, the lower rank); in ``sizes``' order."""
    load = [0] * world
    out: Dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: equal sizes keep their order
        rank = min(range(world), key=lambda r: (load[r], r))
        out[name] = rank
        load[rank] += sizes[name]
    return {name: out[name] for name in sizes}


def gather_to(value: torch.Tensor, owner: int) -> Optional[torch.Tensor]:
    """A collective: the whole ``value`` (a DTensor shard, or a replicated plain tensor) on CPU on rank
    ``owner``; None on the other ranks. A row-sharded DTensor (FSDP2's ``Shard(0)`` over all ranks) is
    gathered to the owner only; other layouts fall back to ``full_tensor()`` (on every rank, then dropped)."""
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    if not isinstance(value, DTensor):
        return value.detach().cpu() if rank == owner else None
    mesh = value.device_mesh
    rows = [len(c) for c in torch.arange(value.shape[0]).chunk(world)] if value.dim() else []
    rows += [0] * (world - len(rows))
    local = value.to_local().detach()
    simple = (tuple(value.placements) == (Shard(0),) and mesh.ndim == 1
              and mesh.mesh.tolist() == list(range(world)) and local.shape[0] == rows[rank])
    if not simple:  # the same decision on every rank: placements and the mesh are global
        full = value.full_tensor().detach()
        return full.cpu() if rank == owner else None
    padded = local.new_zeros((max(rows), *value.shape[1:]))
    padded[:local.shape[0]] = local
    whole = local.new_empty((max(rows) * world, *value.shape[1:])) if rank == owner else None
    dist.gather(padded, list(whole.split(max(rows))) if whole is not None else None, dst=owner,
                group=mesh.get_group())  # into one buffer: torch.chunk pads only after the last row
    return whole[:value.shape[0]].cpu() if whole is not None else None


def exchange(obj: dict) -> List[dict]:
    """A collective: every rank's small JSON-able ``obj``, in rank order, on every rank (as bytes in a
    tensor: nothing is pickled; on the GPU under NCCL, which moves no CPU tensor)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=device))
    longest = int(max(s.item() for s in sizes))
    parts = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(parts, torch.cat([data, data.new_zeros(longest - data.numel())]))
    return [json.loads(bytes(p[:int(s.item())].cpu().tolist()).decode()) for p, s in zip(parts, sizes)]


class RankError(ValueError):
    """An error one rank met, raised on every rank at the same point of the save."""


def _raise_first(reports: List[dict]) -> None:
    """Raise on every rank the first error any rank reported (``reports`` in rank order)."""
    bad = [(r, e["error"]) for r, e in enumerate(reports) if e.get("error")]
    if bad:
        rank, why = bad[0]
        raise RankError(why if rank == dist.get_rank() else f"save_anchor_sharded: rank {rank}: {why}")


def output_bytes(name: str, value: torch.Tensor, targets: List[str], f, block_size: int) -> int:
    """Bytes tensor ``name`` takes in the anchor: a target's codes and E8M0 scales, any other tensor as it is."""
    if name in targets:
        return value.numel() * f.bits // 8 + value.numel() // block_size
    return nbytes(value)


def _quantize_owned(model: nn.Module, own: Path, sd: Dict[str, torch.Tensor], targets: List[str], f,
                    block_size: int, scale_rule: str, recorded: Dict[str, str], max_shard_bytes: int) -> dict:
    """Gather, quantize and write (into ``own``, as each tensor is ready) the tensors this rank owns.
    Returns {"error": the first error or None, "peak": the largest tensor gathered in bytes, "bytes": bytes
    written, "entries": their mfqat.json entries, "files": [file names in ``own``], "groups": [[tensors of
    each file]]}. Every rank takes part in every gather, also after an error."""
    rank, error, writer = dist.get_rank(), None, None
    try:
        own.mkdir()
        writer = ShardWriter(own, max_shard_bytes)
    except OSError as e:
        error = (f"{own.parent} is not writable from rank {rank} ({e.strerror or e}): the ranks must share the "
                 "filesystem the anchor is written to")
    owner = owners({k: output_bytes(k, v, targets, f, block_size) for k, v in sd.items()}, dist.get_world_size())
    entries: Dict[str, dict] = {}
    peak = 0
    for k, v in sd.items():
        full = gather_to(v, owner[k])
        if full is None:
            continue
        peak = max(peak, nbytes(full))
        if error is None:
            try:
                tensors, e = quantize_targets({k: full}, targets, f, block_size, scale_rule)
                for name, value in tensors.items():
                    writer.add(name, value)
                entries.update(e)
            except (ValueError, OSError) as exc:
                error = str(exc)
        del full
    files: List[str] = []
    groups: List[List[str]] = []
    if error is None:
        try:
            for k, imp in recorded_importance(model, entries, recorded).items():
                writer.add(f"{k}.importance", imp)
            if writer.names:
                files = writer.close()
                groups = [[n for n, i in writer.names.items() if i == j] for j in range(len(files))]
                (own / INDEX_FILE).unlink(missing_ok=True)  # rank 0 writes the index of every rank's files
        except OSError as exc:
            error = str(exc)
    if error is not None and writer is not None:
        writer.abort()
    return {"error": error, "peak": peak, "bytes": writer.total if writer else 0, "entries": entries,
            "files": files, "groups": groups}


def save_anchor_sharded(model: nn.Module, path: PathLike, fmt: Optional[str] = None, tokenizer=None,
                        block_size: int = 32, scale_rule: str = "floor", targets: Optional[List[str]] = None,
                        step: Optional[int] = None, schedule: Optional[dict] = None,
                        max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = False,
                        scale_rules: Optional[Dict[str, str]] = None) -> dict:
    """Save the anchor of a sharded (FSDP2) model rank by rank (a collective; see the module docstring).

    The arguments are :func:`mfqat.anchor.checkpoint.save_anchor`'s. Returns, on every rank,
    ``{"path": the anchor, "ranks": n, "files": n, "max_gathered_bytes": the largest whole tensor any
    rank received, "rank_bytes": [bytes of weight files each rank wrote], "state_dict_bytes": the whole
    state dict's bytes}``. Refuses (ValueError, on every
    rank, before any gather) a model with learned scales (``QATConfig.learn_scales``): save those with
    ``full_state_dict`` + ``save_anchor``. An error on one rank is raised on every rank.
    """
    f, block_size, targets, recorded, scale_rule = anchor_plan(model, fmt, block_size, scale_rule, targets,
                                                               scale_rules)
    sd, tied = unique_state_dict(model, model.state_dict())  # this rank's shards; the ties from the parameters
    if pop_learned(sd, tied):
        raise ValueError("save_anchor_sharded: the model learned affine scales (learn_scales); gather it with "
                         "mfqat.storage.sharded.full_state_dict and save it with save_anchor(..., state_dict=sd)")
    check_state(model, sd, tied, targets, f, block_size)
    rank = dist.get_rank()
    stack, refused, failure = contextlib.ExitStack(), None, None
    opened: dict = {"tmp": None, "error": None}
    if rank == 0:
        try:  # the overwrite rules and the writer lock: rank 0 holds the partial folder every rank writes into
            opened["tmp"] = str(stack.enter_context(atomic_directory(path, overwrite=overwrite, kind="anchor")))
        except (OSError, ValueError) as e:
            refused, opened["error"] = e, str(e)
    opened = exchange(opened)[0]
    if refused is not None:
        raise refused
    _raise_first([opened])
    try:
        with stack:
            counts, names = _write_ranks(model, Path(opened["tmp"]), sd, targets, f, block_size, scale_rule,
                                         recorded, max_shard_bytes, tokenizer, tied, step, schedule, Path(path).name)
    except RankError:
        raise
    except Exception as e:  # noqa: BLE001 - rank 0's own step (the metadata, the swap): told to every rank
        if rank != 0:
            raise
        failure = e
    final = exchange({"error": f"{type(failure).__name__}: {failure}" if failure else None})
    if failure is not None:
        raise failure
    _raise_first(final[:1])  # every rank returns once the anchor is in place
    return {"path": str(Path(path)), "ranks": dist.get_world_size(), "files": len(names),
            "max_gathered_bytes": max(c["peak"] for c in counts), "rank_bytes": [c["bytes"] for c in counts],
            "state_dict_bytes": sum(nbytes(v) for v in sd.values())}


def _write_ranks(model: nn.Module, tmp: Path, sd: Dict[str, torch.Tensor], targets: List[str], f, block_size: int,
                 scale_rule: str, recorded: Dict[str, str], max_shard_bytes: int, tokenizer, tied: Dict[str, str],
                 step: Optional[int], schedule: Optional[dict], name: str) -> tuple:
    """Every rank quantizes and writes its part into ``tmp``; rank 0 then writes the rest. ([each rank's
    counts], [file names])."""
    rank = dist.get_rank()
    own = tmp / f".rank{rank}"
    mine = _quantize_owned(model, own, sd, targets, f, block_size, scale_rule, recorded, max_shard_bytes)
    counts = exchange({k: mine[k] for k in ("error", "peak", "bytes")} | {"files": len(mine["files"])})
    _raise_first(counts)
    names = shard_file_names(sum(c["files"] for c in counts))
    first = sum(c["files"] for c in counts[:rank])
    report = {"error": None, "entries": mine["entries"], "groups": mine["groups"], "files": {}, "bytes": mine["bytes"]}
    try:  # each file gets its name among every rank's files
        for local, final in zip(mine["files"], names[first:first + len(mine["files"])]):
            os.replace(own / local, tmp / final)
            report["files"][final] = sha256_file(tmp / final)
        own.rmdir()
    except OSError as e:
        report["error"] = f"{tmp}: {e}"
    reports = exchange(report)
    _raise_first(reports)
    if rank == 0:
        _finish(tmp, model, tokenizer, f.name, block_size, scale_rule, recorded, sd, tied, reports, step, schedule,
                name)
    return counts, names


def _finish(tmp: Path, model: nn.Module, tokenizer, fmt: str, block_size: int, scale_rule: str,
            recorded: Dict[str, str], sd: Dict[str, torch.Tensor], tied: Dict[str, str], reports: List[dict],
            step: Optional[int], schedule: Optional[dict], name: str) -> None:
    """Rank 0: the index, config, tokenizer, model card and sealed mfqat.json of the ranks' files."""
    found = {k: e for r in reports for k, e in r["entries"].items()}
    entries = {k: found[k] for k in sd if k in found}  # state-dict order, as save_anchor writes them
    files = {n: d for r in reports for n, d in r["files"].items()}
    names = sorted(files)
    shards = [g for r in reports for g in r["groups"]]
    write_index(tmp, names, shards, sum(r["bytes"] for r in reports))
    write_side_files(tmp, model, tokenizer, fmt, block_size, scale_rule, recorded, name)
    meta = {"format_version": SEARCH_FORMAT_VERSION if SEARCH_RULE in recorded.values() else BASE_FORMAT_VERSION,
            "mfqat_version": __version__, "anchor_format": fmt,
            "block_size": block_size, "scale_rule": scale_rule, "scale_rules": recorded,
            "tensors": entries, "tied": tied,
            "full_precision": full_precision(model, sd, entries, block_size), "schedule": schedule, "step": step,
            "files": {n: files[n] for n in names}}
    write_json(tmp / META_FILE, seal(meta, tmp, META_FILE))
