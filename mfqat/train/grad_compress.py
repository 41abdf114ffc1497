"""MX-compressed gradient all-reduce for DDP, with error feedback (``mfqat train --grad-compress``).

A DDP communication hook (the ``torch.distributed.algorithms.ddp_comm_hooks`` interface,
``hook(state, bucket) -> Future[Tensor]``). Each rank adds its carried residual to the bucket's
gradients, quantizes the sum to an MX format (``mfqat.quantize``: codes + E8M0 scales, blocks of
32 along the flat bucket), keeps ``sum - dequantize(codes)`` as the next step's residual (error
feedback) and all-gathers the packed codes + scales. Every rank then decodes all ranks' payloads
in rank order and averages them, so the ranks' gradients (and weights) stay bit-identical.

Bytes sent per rank and step are the packed codes plus one scale byte per block: 8.25 bits per
gradient for MXFP8/MXINT8, 4.25 for MXINT4/MXFP4, against 32 for the default fp32 all-reduce.

Residuals are kept per parameter (the flat bucket is cut along ``bucket.parameters()``), so the
bucket rebuild DDP does after its first step does not misplace them, and they travel in the
training checkpoint (``state_dict`` / ``load_state_dict``, one file per rank).
"""
# no `from __future__ import annotations`: DDP checks the hook's annotations as live objects
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from mfqat.formats import get_format
from mfqat.quant.api import quantize
from mfqat.quant.mxtensor import MXTensor

GRAD_COMPRESS_CHOICES = ("none", "mxfp8", "mxfp8_e5m2", "mxint8", "mxfp6", "mxint6", "mxint4", "mxfp4")


@dataclass
class GradCompressState:
    """State of the hook on one rank.

    Attributes:
        fmt: MX element format of the sent codes (``mxfp8``, ``mxint8``, ``mxint4``, ...).
        error_feedback: carry each step's quantization residual into the next step's gradient.
        names: parameter -> name (for the checkpointed residuals); filled by :func:`register`.
        residuals: parameter name -> residual (same shape as the parameter).
        bytes_sent: bytes this rank put on the wire since the last :meth:`pop_bytes`.
        fp32_bytes: bytes the fp32 all-reduce hook would have handed the backend for the same buckets.
        residual_ratio: max over buckets of ||new residual||_inf / ||bucket gradient||_inf (reset by the caller).
    """

    fmt: str
    error_feedback: bool = True
    group: Optional[dist.ProcessGroup] = None
    names: Dict[int, str] = field(default_factory=dict)
    residuals: Dict[str, torch.Tensor] = field(default_factory=dict)
    bytes_sent: int = 0
    fp32_bytes: int = 0
    residual_ratio: float = 0.0

    def __post_init__(self) -> None:
        f = get_format(self.fmt)
        if not f.is_mx:
            raise ValueError(f"--grad-compress {self.fmt}: gradients are sent in an MX format "
                             f"({', '.join(GRAD_COMPRESS_CHOICES[1:])}); '{f.name}' is not one")
        self.fmt = f.name

    def pop_bytes(self) -> Tuple[int, int]:
        """(compressed bytes sent, fp32 bytes) since the last call; resets both counters."""
        out = (self.bytes_sent, self.fp32_bytes)
        self.bytes_sent = self.fp32_bytes = 0
        return out

    def state_dict(self) -> Dict[str, object]:
        """The residuals (this rank's), format and error-feedback flag."""
        return {"fmt": self.fmt, "error_feedback": self.error_feedback,
                "residuals": {k: v.detach().cpu() for k, v in self.residuals.items()}}

    def load_state_dict(self, sd: Dict[str, object]) -> None:
        """Restore residuals saved by :meth:`state_dict` (the format must match)."""
        if sd["fmt"] != self.fmt:
            raise ValueError(f"checkpoint's gradient residuals are for --grad-compress {sd['fmt']}, "
                             f"this run uses {self.fmt}; resume with the same --grad-compress")
        self.residuals = dict(sd["residuals"])  # type: ignore[arg-type]


def encode(flat: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor, MXTensor]:
    """Quantize a flat fp32 gradient (zero-padded to whole blocks) -> (packed codes, E8M0 scales, MXTensor)."""
    f = get_format(fmt)
    bs = f.default_block_size
    pad = (-flat.numel()) % bs
    x = torch.nn.functional.pad(flat.float(), (0, pad)).reshape(-1, bs)
    q = quantize(x, f, bs)
    return q.pack().reshape(-1), q.scales.reshape(-1), q


def payload_size(numel: int, fmt: str) -> Tuple[int, int]:
    """(code bytes, scale bytes) of the payload of a flat gradient of ``numel`` elements."""
    f = get_format(fmt)
    blocks = -(-numel // f.default_block_size)
    return blocks * f.default_block_size * f.bits // 8, blocks


def decode(payload: torch.Tensor, numel: int, fmt: str) -> torch.Tensor:
    """Inverse of :func:`encode` on one rank's concatenated (codes, scales) bytes -> flat fp32 of ``numel``."""
    f = get_format(fmt)
    bs = f.default_block_size
    n_codes, n_scales = payload_size(numel, fmt)
    packed = payload[:n_codes].reshape(n_scales, bs * f.bits // 8)
    q = MXTensor.unpack(packed, payload[n_codes:].reshape(n_scales, 1), f, bs, (n_scales, bs))
    return q.dequantize(torch.float32).reshape(-1)[:numel]


def _bucket_residual(state: GradCompressState, params: List[torch.Tensor], numel: int,
                     like: torch.Tensor) -> torch.Tensor:
    """The bucket's carried residual, flat, in the bucket's parameter order (zeros where none)."""
    parts = [state.residuals.get(state.names.get(id(p), ""), None) for p in params]
    if sum(p.numel() for p in params) != numel:
        raise RuntimeError("DDP bucket layout is not the concatenation of its parameters' gradients; "
                           "--grad-compress cannot place the residuals (run with --grad-compress none)")
    return torch.cat([torch.zeros(p.numel(), dtype=like.dtype, device=like.device) if r is None
                      else r.reshape(-1).to(like) for p, r in zip(params, parts)])


def mx_compress_hook(state: GradCompressState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: MX-quantize (with error feedback), all-gather, decode, average."""
    group = state.group or dist.group.WORLD
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    params = bucket.parameters()
    grad = buf.detach().float()
    if state.error_feedback:
        grad = grad + _bucket_residual(state, params, buf.numel(), grad)
    codes, scales, q = encode(grad, state.fmt)
    if state.error_feedback:
        res = grad - q.dequantize(torch.float32).reshape(-1)[: buf.numel()]
        if not torch.isfinite(res).all():  # an overflowing step (fp16 loss scaling skips it): carry nothing
            res = torch.zeros_like(res)
        state.residual_ratio = max(state.residual_ratio,  # residual vs this step's own gradient
                                   float(res.abs().max() / buf.abs().max().clamp_min(1e-30)))
        offset = 0
        for p in params:
            name = state.names.get(id(p))
            if name is None:
                raise RuntimeError("mx_compress_hook: a bucket parameter is unknown to the hook's state; "
                                   "register the hook with mfqat.train.grad_compress.register(ddp_model, ...)")
            state.residuals[name] = res[offset: offset + p.numel()].reshape(p.shape).clone()
            offset += p.numel()
    mine = torch.cat([codes, scales.to(torch.uint8)])
    state.bytes_sent += mine.numel()
    state.fp32_bytes += buf.numel() * 4
    gathered = [torch.empty_like(mine) for _ in range(world)]
    fut = dist.all_gather(gathered, mine, group=group, async_op=True).get_future()

    def average(_: torch.futures.Future) -> torch.Tensor:
        total = decode(gathered[0], buf.numel(), state.fmt)
        for g in gathered[1:]:  # the same order on every rank: bit-identical sums
            total = total + decode(g, buf.numel(), state.fmt)
        buf.copy_((total / world).to(buf.dtype))
        return buf

    return fut.then(average)


def register(ddp_model: torch.nn.Module, fmt: str, error_feedback: bool = True,
             group: Optional[dist.ProcessGroup] = None) -> GradCompressState:
    """Register :func:`mx_compress_hook` on a DDP-wrapped model (before its first backward); return the state."""
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"--grad-compress {fmt}: the model is a {type(ddp_model).__name__}, not a DDP model; "
                        "gradient compression needs DDP (FSDP and single-process runs have no DDP buckets)")
    state = GradCompressState(fmt, error_feedback, group)
    inner = getattr(ddp_model, "module", ddp_model)
    state.names = {id(p): n for n, p in inner.named_parameters()}
    ddp_model.register_comm_hook(state, mx_compress_hook)
    return state


def setup(acc, model: torch.nn.Module, fmt: str, error_feedback: bool = True) -> Optional[GradCompressState]:
    """``mfqat train --grad-compress``: register the hook on accelerate's DDP model; None for ``none``.

    A single process has nothing to all-reduce (said on stdout, the run goes on uncompressed); FSDP
    reduce-scatters sharded gradients without DDP buckets, so it is refused rather than ignored.
    """
    if fmt == "none":
        return None
    GradCompressState(fmt)  # a bad format is an error even where compression would not run
    kind = str(getattr(acc, "distributed_type", "NO")).rsplit(".", 1)[-1]
    if kind == "FSDP":
        raise SystemExit(f"mfqat train: --grad-compress {fmt} works with DDP only; FSDP reduce-scatters its "
                         "sharded gradients without DDP communication hooks (drop --grad-compress or use DDP)")
    if acc.num_processes == 1:
        print(f"[mfqat] warning: --grad-compress {fmt} has no effect in a single process "
              "(no gradient all-reduce); launch with accelerate on 2+ processes")
        return None
    return register(model, fmt, error_feedback)


def residual_file(folder, rank: int):
    """Where a checkpoint keeps rank ``rank``'s gradient residuals."""
    from pathlib import Path

    return Path(folder) / f"mfqat_grad_residuals_rank{rank}.pt"
