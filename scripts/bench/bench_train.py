#!/usr/bin/env python
"""MF-QAT training step time vs plain training of the same model, same batch, same run.

    python scripts/bench/bench_train.py [--rounds 6] [--batch-size 4] [--seq-len 128] [--format mxint4]
                                  [--backends reference,auto] [--joint mxint8,mxint6,mxint4]
                                  [--two-pass] [--search] [--keep-quantized]
    python scripts/bench/bench_train.py --memory [--keep-quantized]  # peak RSS of plain / MF-QAT / joint steps
    python scripts/bench/bench_train.py --components # where the joint search step's quantizer time goes
    python scripts/bench/bench_train.py --device cuda --dtype bfloat16 --backends auto,cuda   # on a GPU

The joint MF-QAT step (K formats, one forward+backward each) is reported against K plain
forward+backward passes plus one optimizer step ("per-format overhead") and against one plain step
of K accumulated passes ("plain xK accumulated": the same structure without fake-quant, so the
ratio to it is what fake-quant adds). ``--two-pass`` also times
the joint step with the fused train-through-anchor op switched off (two quantize-dequantize passes
per weight for each format below the anchor, as before the fused op). ``--memory`` runs each
configuration in its own process and reports its peak resident set after 3 steps. ``--components``
times 3 joint steps with the ``search`` rule and prints the seconds a step spends in each quantizer
function (importance record, search, decode of the kept exponents, fake-quant): the
parts the search adds, robust to the noise that swings whole-step ratios here. ``--search`` also
times the joint step with the ``search`` scale rule for its formats below the anchor
(mfqat/configs/mxint_joint_search.yaml, mxfp_joint_search.yaml: the per-block exponent search inside
training); ``--joint mxfp8_e4m3,mxfp6_e2m3,mxfp4_e2m1 --format mxfp4_e2m1`` times the float family.
``--keep-quantized`` also times each joint step with ``QATConfig.keep_quantized_weights`` (the
backward uses the forward's quantized weight instead of recomputing it; rows ``[keep]``, the same
model and optimizer with the flag switched on for that step), and with ``--memory`` adds a
``joint-keep`` process.

Steps are interleaved (plain, then MF-QAT with each backend, round after round) and the median per
configuration is reported, so slow drifts of the machine hit every configuration alike. The joint
steps also get a paired ratio: the median over rounds of joint / plain xK accumulated, both timed in
the same round (the joint rows right after it, their order rotated each round so that none always
runs first), which cancels drifts slower than a round. Also prints
the time of fake-quantizing every targeted weight once (the part MF-QAT adds to a step).
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import mfqat
from mfqat.data.sources import load_model, pydoc_text, token_blocks
from mfqat.qat.prepare import qat_modules
from mfqat.quant.kernels import cpp


def timed_step(model, passes) -> Callable[[], Tuple[float, float]]:
    """An optimizer step (AdamW) after ``passes()`` ran the forward+backward passes -> a function
    returning its (wall, process CPU) seconds (on a GPU: synchronized before and after)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cuda = next(model.parameters()).device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step() -> Tuple[float, float]:
        sync()
        t, c = time.perf_counter(), time.process_time()
        passes()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t, time.process_time() - c
    return step


def make_step(model, batch, k: int = 1):
    """A plain step over ``k`` accumulated forward+backward passes of the batch (k > 1: the joint
    step's structure without fake-quant, its fair baseline)."""
    def passes() -> None:
        for _ in range(k):
            (model(input_ids=batch, labels=batch).loss / k).backward()
    return timed_step(model, passes)


def make_joint_step(model, batch, formats):
    """One joint MF-QAT optimizer step over ``formats`` (mfqat.qat.joint)."""
    from mfqat.qat.joint import joint_backward

    return timed_step(model, lambda: joint_backward(model, model, {"input_ids": batch, "labels": batch}, formats,
                                                    lambda f: 1.0, lambda loss: loss.backward()))


def keeping(model, step, keep: bool):
    """``step`` with every MFQATLinear's ``keep_quantized_weights`` set to ``keep`` while it runs."""
    from mfqat.qat.modules import MFQATLinear

    def run() -> Tuple[float, float]:
        layers = [m for _, m in qat_modules(model) if isinstance(m, MFQATLinear)]
        for m in layers:
            m.keep_quantized_weights = keep
        try:
            return step()
        finally:
            for m in layers:
                m.keep_quantized_weights = False
    return run


def memory_child(kind: str, a) -> None:
    """Run 3 steps of one configuration and print this process's peak RSS (MiB)."""
    model, tok = load_model()
    model.train()
    batch = token_blocks(tok, pydoc_text()[:200000], a.seq_len, max_blocks=a.batch_size)
    after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if kind == "plain":
        step = make_step(model, batch)
    elif kind in ("joint", "joint-keep"):
        formats = a.joint.split(",")
        mfqat.prepare(model, mfqat.QATConfig(formats=formats, schedule="joint",
                                             keep_quantized_weights=kind == "joint-keep"))
        step = make_joint_step(model, batch, formats)
    else:
        mfqat.prepare(model, mfqat.QATConfig(formats=[a.format], schedule="fixed"))
        step = make_step(model, batch)
    for _ in range(3):
        step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"MEMORY {kind} {peak:.0f} {after_load:.0f}")


def memory_report(a) -> None:
    """Peak RSS per configuration, each in a fresh process."""
    rows = {}
    for kind in ("plain", "qat", "joint") + (("joint-keep",) if a.keep_quantized else ()):
        cmd = [sys.executable, __file__, "--memory-child", kind, "--format", a.format, "--joint", a.joint,
               "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        line = next(x for x in out.splitlines() if x.startswith("MEMORY"))
        _, _, peak, loaded = line.split()
        rows[kind] = (float(peak), float(loaded))
    base = rows["plain"][0] - rows["plain"][1]
    for kind, (peak, loaded) in rows.items():
        print(f"{kind:<10} peak RSS {peak:.0f} MiB (after loading {loaded:.0f}; training adds {peak - loaded:.0f}, "
              f"{(peak - loaded) / base:.2f}x plain's)")


def component_report(a) -> None:
    """Seconds per joint ``search`` step in each quantizer function MFQATLinear calls (3 timed steps
    after one warm-up), and the whole step."""
    import mfqat.qat.modules as modules
    from mfqat.quant.scale_rules import SEARCH_RULE_FORMATS

    spent: Dict[str, float] = {}
    calls: Dict[str, int] = {}

    def timed(owner, name: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t
                calls[name] = calls.get(name, 0) + 1
        setattr(owner, name, wrapper)

    timed(modules.MFQATLinear, "_record_importance")
    for name in ("search_through_anchor", "dequantize_through_with_exponents", "fake_quantize",
                 "fake_quantize_through"):
        timed(modules, name)
    model, tok = load_model()
    model.train()
    batch = token_blocks(tok, pydoc_text()[:200000], a.seq_len, max_blocks=a.batch_size)
    formats = a.joint.split(",")
    rules = {f: "search" for f in formats if f in SEARCH_RULE_FORMATS}
    mfqat.prepare(model, mfqat.QATConfig(formats=formats, schedule="joint", scale_rules=rules))
    step = make_joint_step(model, batch, formats)
    step()
    spent.clear()
    calls.clear()
    walls = [step()[0] for _ in range(3)]
    print(f"joint {'+'.join(formats)}, search on {'+'.join(rules)}: step {statistics.median(walls):.3f} s "
          f"(median of 3)")
    for name, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<36} {sec / 3:.3f} s/step  ({calls[name] // 3} calls)")


def report(samples: Dict[str, List[float]], formats: List[str], unit: str) -> None:
    """Median per configuration, its ratio to plain, and for the joint step the ratio per format
    and to the plain step of as many accumulated passes."""
    plain = statistics.median(samples["plain"])
    acc_name = f"plain x{len(formats)} accumulated"
    accum: Optional[float] = statistics.median(samples[acc_name]) if acc_name in samples else None
    for name, ts in samples.items():
        med = statistics.median(ts)
        k = len(formats) if name.startswith("joint") else 1
        line = f"{name:<24} median {med:.3f} {unit} (min {min(ts):.3f}, max {max(ts):.3f}) | ratio to plain {med / plain:.3f}x"
        if k > 1:
            line += f" | per format {med / (k * plain):.3f}x"
            if accum:
                line += f" | to plain x{k} accumulated {med / accum:.3f}x"
                paired = [t / b for t, b in zip(ts, samples[acc_name])]  # timed in the same round
                line += f" (paired median {statistics.median(paired):.3f}x)"
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--format", default="mxint4")
    p.add_argument("--backends", default="reference,auto", help="MFQAT_BACKEND values to time")
    p.add_argument("--joint", default="mxint8,mxint6,mxint4", help="formats of the joint step (empty: skip)")
    p.add_argument("--two-pass", action="store_true", help="also time the joint step without the fused op")
    p.add_argument("--search", action="store_true", help="also time the joint step with the search scale rule")
    p.add_argument("--keep-quantized", action="store_true",
                   help="also time each joint step with keep_quantized_weights (rows [keep])")
    p.add_argument("--model", default=None, help="a local HF model folder (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the steps' timings synchronize the GPU)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the model's parameters (bfloat16: the plain step is a bf16 step)")
    p.add_argument("--memory", action="store_true", help="peak RSS per configuration (separate processes)")
    p.add_argument("--components", action="store_true",
                   help="seconds a joint search step spends per quantizer function")
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.memory_child:
        return memory_child(a.memory_child, a)
    if a.memory:
        return memory_report(a)
    if a.components:
        return component_report(a)
    model, tok = load_model(a.model)
    model.to(device=a.device, dtype=getattr(torch, a.dtype)).train()
    batch = token_blocks(tok, pydoc_text()[:200000], a.seq_len, max_blocks=a.batch_size).to(a.device)
    qat = copy.deepcopy(model)
    mfqat.prepare(qat, mfqat.QATConfig(formats=[a.format], schedule="fixed"))
    runs = {"plain": (make_step(model, batch), None, True)}
    qat_step = make_step(qat, batch)
    for backend in a.backends.split(","):
        runs[f"MF-QAT [{backend}]"] = (qat_step, backend, True)
    formats = [f for f in a.joint.split(",") if f]
    if formats:
        joint = copy.deepcopy(model)
        mfqat.prepare(joint, mfqat.QATConfig(formats=formats, schedule="joint"))
        joint_step = make_joint_step(joint, batch, formats)
        runs[f"plain x{len(formats)} accumulated"] = (make_step(model, batch, len(formats)), None, True)
        runs[f"joint x{len(formats)} [auto]"] = (joint_step, "auto", True)
        if a.keep_quantized:
            runs[f"joint x{len(formats)} [keep]"] = (keeping(joint, joint_step, True), "auto", True)
        if a.two_pass:
            runs[f"joint x{len(formats)} [two-pass]"] = (joint_step, "auto", False)
        if a.search:
            from mfqat.quant.scale_rules import SEARCH_RULE_FORMATS

            searched = copy.deepcopy(model)
            rules = {f: "search" for f in formats if f in SEARCH_RULE_FORMATS}
            mfqat.prepare(searched, mfqat.QATConfig(formats=formats, schedule="joint", scale_rules=rules))
            search_step = make_joint_step(searched, batch, formats)
            runs[f"joint x{len(formats)} [search]"] = (search_step, "auto", True)
            if a.keep_quantized:
                runs[f"joint x{len(formats)} [search, keep]"] = (keeping(searched, search_step, True), "auto", True)
    fused_built = cpp.THROUGH_AVAILABLE
    times = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    joints = [n for n in runs if n.startswith("joint")]
    for r in range(a.rounds + 1):  # round 0 warms up
        shift = r % max(len(joints), 1)
        order = [n for n in runs if n not in joints] + joints[shift:] + joints[:shift]
        for name in order:
            step, backend, fused = runs[name]
            if backend:
                os.environ["MFQAT_BACKEND"] = backend
            cpp.THROUGH_AVAILABLE = fused_built and fused
            dt, dc = step()
            if r:
                times[name].append(dt)
                cpu[name].append(dc)
    os.environ["MFQAT_BACKEND"] = "auto"
    cpp.THROUGH_AVAILABLE = fused_built
    n_weights = sum(m.weight.numel() for _, m in qat_modules(qat))
    print(f"device={a.device} dtype={a.dtype} batch={a.batch_size}x{a.seq_len} threads={torch.get_num_threads()} format={a.format} "
          f"rounds={a.rounds} quantized weights={n_weights / 1e6:.1f}M")
    report(times, formats, "s/step")
    print("CPU time (all threads; robust to time stolen by other tenants of the machine):")
    report(cpu, formats, "CPU-s/step")
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    for backend in a.backends.split(","):
        os.environ["MFQAT_BACKEND"] = backend
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            for _, m in qat_modules(qat):
                m.quantized_weight()
        sync()
        print(f"fake-quant of every targeted weight once [{backend}]: {1000 * (time.perf_counter() - t):.0f} ms")
    if formats and formats[-1] != joint.mfqat_controller.config.anchor_format:
        anchor, low = joint.mfqat_controller.config.anchor_format, formats[-1]
        for fused in (True, False):
            cpp.THROUGH_AVAILABLE = fused_built and fused
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                for _, m in qat_modules(joint):
                    m.quantized_weight(low)
            sync()
            print(f"{low} through the {anchor} anchor, every targeted weight once "
                  f"[{'fused' if fused else 'two passes'}]: {1000 * (time.perf_counter() - t):.0f} ms")
        cpp.THROUGH_AVAILABLE = fused_built


if __name__ == "__main__":
    main()
