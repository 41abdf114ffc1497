"""FSDP2 in `mfqat train`: sharding on CPU ranks, and an unsharded copy for the end of the run.

accelerate only runs FSDP on accelerators: a CPU-only machine launched with
``configs/accelerate/fsdp.yaml`` would become plain DDP (``cpu=True``) or N unrelated single
processes (``cpu=False``). On such a machine the training loop keeps accelerate's gloo ranks
(MULTI_CPU) and shards the model itself with torch's ``fully_shard`` (FSDP2: each decoder block,
then the root), as accelerate's FSDP2 plugin would on GPUs. Options such a run cannot honour are
refused (:func:`check_args`), never ignored.

After training, an MF-QAT run without LoRA or learned scales saves its anchor rank by rank
(:func:`per_rank_anchor`, :func:`mfqat.anchor.sharded_save.save_anchor_sharded`) and evaluates the
sharded model on every rank. Otherwise (and for ``--save-master``) every rank joins the gather of the
full state dict; rank 0 loads it into a fresh unsharded copy (:func:`unsharded_copy`) that the anchor,
``--save-master`` and the evaluation use.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

from torch import nn

from mfqat.qat.config import QATConfig
from mfqat.qat.prepare import prepare
from mfqat.storage.sharded import full_state_dict, is_sharded


def requested() -> bool:
    """True when ``accelerate launch`` was given an FSDP config (it exports ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def self_sharded(acc) -> bool:
    """True when this run must shard the model itself: FSDP asked for, accelerate running CPU ranks."""
    kind = str(acc.distributed_type).rsplit(".", 1)[-1]
    return requested() and kind == "MULTI_CPU"


def check_args(args, acc) -> None:
    """Refuse what a self-sharded CPU FSDP run cannot do (clear SystemExit naming the option)."""
    if os.environ.get("FSDP_VERSION", "2") != "2":
        raise SystemExit("mfqat train: FSDP on CPU ranks runs FSDP2 (torch fully_shard); set fsdp_version: 2 in the "
                         "accelerate config")
    if os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise SystemExit("mfqat train: fsdp_offload_params has no meaning on CPU ranks; set it to false")
    if args.mixed_precision != "no":
        raise SystemExit("mfqat train: FSDP on CPU ranks trains in float32; use --mixed-precision no")
    refused = {"--save-every": args.save_every, "--resume": args.resume,
               "--grad-compress": args.grad_compress != "none", "--optim (8-bit)": args.optim != "adamw"}
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise SystemExit(f"mfqat train: {', '.join(bad)} not supported with FSDP on CPU ranks (the model is sharded by "
                         "torch fully_shard, outside accelerate's checkpointing); run without them, or use "
                         "the packaged mfqat/configs/accelerate/ddp.yaml")


@contextlib.contextmanager
def no_sync(acc, model: nn.Module) -> Iterator[None]:
    """``accelerator.no_sync`` that also covers a self-sharded model: its backward passes keep
    unreduced gradients until the synchronising one (FSDP2 ``set_requires_gradient_sync``), so the
    gradient of several formats / micro-batches is reduced once, summed in the same order as DDP."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule) and self_sharded(acc):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with acc.no_sync(model):
            yield


def shard(model: nn.Module) -> nn.Module:
    """FSDP2-shard ``model`` in place: each block named in ``model._no_split_modules`` (the decoder
    layers of an HF model), then the root. Call before building the optimizer."""
    from torch.distributed.fsdp import fully_shard

    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true"
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    wrapped = [m for m in model.modules() if type(m).__name__ in blocks]
    if not wrapped:
        raise SystemExit(f"mfqat train: FSDP found no blocks to shard in {type(model).__name__} "
                         "(no _no_split_modules); use the packaged mfqat/configs/accelerate/ddp.yaml")
    for m in wrapped:
        fully_shard(m, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def per_rank_anchor(model: nn.Module, cfg: Optional[QATConfig], lora) -> bool:
    """True when the anchor of this run is saved rank by rank (:func:`mfqat.anchor.sharded_save.save_anchor_sharded`):
    a sharded MF-QAT model without LoRA (its merged copy needs the whole model) or learned scales (kept on the
    full-gather path: :func:`unsharded_copy`)."""
    return cfg is not None and lora is None and not cfg.learn_scales and is_sharded(model)


def unsharded_copy(model: nn.Module, cfg: Optional[QATConfig], is_main: bool) -> Optional[nn.Module]:
    """A collective: gathers the full state dict on every rank; rank 0 gets an unsharded model (same
    class and config, MF-QAT prepared alike) holding it; the other ranks get None."""
    from torch.distributed.fsdp import FSDPModule

    sd = full_state_dict(model)
    if not is_main:
        return None
    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    copy = cls(model.config)
    if cfg is not None:
        prepare(copy, cfg)
    copy.load_state_dict({k: v.to(p.dtype) for (k, v), p in zip(sd.items(), (copy.state_dict()[k] for k in sd))})
    return copy.train(model.training)
