#!/usr/bin/env python
"""Training memory of `mfqat train` (joint MF-QAT) against plain training of the same model with the same
settings (issue 44 item 3): each run its own process, its peak resident memory (its own VmHWM, read as it
exits, as scripts/bench/bench_scale.py measures) and seconds per optimizer step.

For each size, master dtype (--dtypes) and activation checkpointing setting (--checkpointing) it runs:

* plain: a plain PyTorch loop over ``AutoModelForCausalLM`` (no mfqat module imported; the child checks):
  ``from_pretrained(dtype=D)``, optional ``gradient_checkpointing_enable(use_reentrant=False)``, torch
  AdamW, next-token loss on random token ids, gradient clipping at 1.0, ``zero_grad(set_to_none=True)``;
* mfqat: ``mfqat train --model SRC --dtype D`` with the default joint recipe (mxint_joint_search: one
  forward + backward per format, mxint8/6/4, per step), the same batch, sequence length, steps and AdamW,
  ``--eval-blocks 1``; it ends by saving its anchor, which the plain loop does not do;
* mfqat --no-qat (``--variants plain,mfqat,no-qat``): the same command without MF-QAT, which separates the cost of mfqat's
  loop (accelerate, data, the final eval and save) from that of the MF-QAT wrappers.

The sources are the random bfloat16 Llama checkpoints of bench_scale.py (its builder: SmolLM2's tokenizer,
vocabulary 49152), in --src-root/src-SIZEB, built there when missing:

    python scripts/bench/bench_train_memory.py [--sizes 0.1,0.5] [--dtypes float32,bfloat16]
        [--checkpointing off,on] [--batch-size 2] [--seq-len 128] [--steps 3] [--out out/bench_train_memory]

Prints one table with the ratios mfqat / plain (peak and s/step) and writes train_memory.json. The peak of
an mfqat run is its whole process (training, final eval, anchor save); ``train peak`` is its own
summary's ``peak_memory_mib`` (ru_maxrss when the training steps end, before the eval and the save).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scale import PY, build, measure  # noqa: E402  (the builder and the VmHWM wrapper, not copies)

HERE = Path(__file__).resolve().parent
# The plain child: this file's plain_train, imported without mfqat (bench_scale imports only the stdlib).
PLAIN = f"import sys; sys.path.insert(0, {str(HERE)!r}); from bench_train_memory import plain_train; plain_train(sys.argv[1:])"


def plain_train(argv) -> None:
    """The plain training child: ``SRC DTYPE BATCH SEQ STEPS CHECKPOINTING LR OUT_JSON`` (module docstring)."""
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    src, dtype, batch, seq, steps, ckpt, lr, out = argv
    batch, seq, steps, lr = int(batch), int(seq), int(steps), float(lr)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    if ckpt == "on":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    vocab = model.config.vocab_size
    t0 = time.perf_counter()
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    leaked = sorted(m for m in sys.modules if m == "mfqat" or m.startswith("mfqat."))
    assert not leaked, f"the plain run imported mfqat: {leaked}"
    dtypes = sorted({str(p.dtype) for p in model.parameters()} | {str(t.dtype) for s in opt.state.values()
                                                                  for t in s.values() if t.dim()})
    Path(out).write_text(json.dumps({"seconds_per_step": seconds / steps, "losses": losses, "dtypes": dtypes,
                                     "train_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def commands(src: Path, work: Path, dtype: str, ckpt: str, a) -> dict:
    """{variant: (command, the file its seconds per step and training peak are read from)}."""
    tag = f"{dtype}-gc{ckpt}"
    plain_json = work / f"plain-{tag}.json"
    shared = ["--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
              "--lr", str(a.lr), "--dtype", dtype, "--eval-blocks", "1", "--overwrite",
              *(["--gradient-checkpointing"] if ckpt == "on" else []), *a.mfqat_args.split()]
    out = {"plain": ([PY, "-c", PLAIN, str(src), dtype, str(a.batch_size), str(a.seq_len), str(a.steps), ckpt,
                      str(a.lr), str(plain_json)], plain_json),
           "mfqat": ([PY, "-m", "mfqat", "train", "--model", str(src), *shared, "--out", str(work / f"mfqat-{tag}")],
                     work / f"mfqat-{tag}" / "summary.json")}
    out["mfqat --no-qat"] = ([PY, "-m", "mfqat", "train", "--model", str(src), *shared, "--no-qat", "--out",
                              str(work / f"noqat-{tag}")], work / f"noqat-{tag}" / "summary.json")
    wanted = {"plain": "plain", "mfqat": "mfqat", "no-qat": "mfqat --no-qat"}
    return {wanted[v]: out[wanted[v]] for v in a.variants.split(",")}


def run_one(cmd, result: Path, log: Path, limit_gib: float) -> dict:
    """Measure ``cmd``; add its seconds per step and training peak (GiB) from ``result``."""
    r = measure(cmd, log, limit_gib)
    if r["rc"] == 0 and result.is_file():
        data = json.loads(result.read_text())
        r["s_per_step"] = data["seconds_per_step"]
        r["train_peak_gib"] = data.get("train_peak_mib", data.get("peak_memory_mib", 0.0)) / 1024
    return r


def table(rows) -> str:
    """The markdown table: each run, and mfqat / plain ratios of its configuration."""
    plain = {(r["size"], r["dtype"], r["checkpointing"]): r for r in rows if r["variant"] == "plain"}
    lines = ["| size | master | checkpointing | run | peak GiB | train peak GiB | s/step | peak / plain | "
             "s/step / plain | rc |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = plain.get((r["size"], r["dtype"], r["checkpointing"]))
        ok = p is not None and p["rc"] == 0 and r["rc"] == 0 and "s_per_step" in r and "s_per_step" in p
        ratio = f"{r['peak_gib'] / p['peak_gib']:.2f}" if ok else "-"
        tratio = f"{r['s_per_step'] / p['s_per_step']:.2f}" if ok else "-"
        lines.append(f"| {r['size']}B | {r['dtype']} | {r['checkpointing']} | {r['variant']} | {r['peak_gib']:.2f} | "
                     f"{r.get('train_peak_gib', float('nan')):.2f} | {r.get('s_per_step', float('nan')):.1f} | "
                     f"{ratio} | {tratio} | {r['rc']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.1,0.5", help="comma list of bench_scale.py sizes (0.1, 0.5, 1.2, 3)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="master dtypes (mfqat train --dtype)")
    ap.add_argument("--checkpointing", default="off,on", help="activation checkpointing: off, on or off,on")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--variants", default="plain,mfqat", help="comma list of plain, mfqat, no-qat (mfqat train "
                    "--no-qat: mfqat's loop without MF-QAT)")
    ap.add_argument("--mfqat-args", default="", help="more `mfqat train` flags, e.g. \"--qat-config mxint_joint\" "
                    "(default: its default recipe)")
    ap.add_argument("--out", default="out/bench_train_memory")
    ap.add_argument("--src-root", default=None, help="folder of the src-SIZEB checkpoints (default: --out; "
                    "bench_scale.py's out/bench_scale holds the same ones)")
    ap.add_argument("--limit-gib", type=float, default=12.0, help="address-space cap of each run")
    ap.add_argument("--merge", action="store_true", help="add to the rows of an earlier --out/train_memory.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = ("size", "dtype", "checkpointing", "variant")
    rows = json.loads((out / "train_memory.json").read_text())["rows"] if a.merge and (out / "train_memory.json").is_file() else []
    for size in a.sizes.split(","):
        src = Path(a.src_root or out) / f"src-{size}B"
        gib = build(size, src) / 1024 ** 3
        work = out / f"work-{size}B"
        work.mkdir(parents=True, exist_ok=True)
        for dtype in a.dtypes.split(","):
            for ckpt in a.checkpointing.split(","):
                for variant, (cmd, result) in commands(src, work, dtype, ckpt, a).items():
                    r = run_one(cmd, result, work / f"{variant.replace(' ', '')}-{dtype}-gc{ckpt}.log", a.limit_gib)
                    row = {"size": size, "bf16_gib": gib, "dtype": dtype, "checkpointing": ckpt, "variant": variant,
                           **r}
                    rows = [x for x in rows if tuple(x[k] for k in keys) != tuple(row[k] for k in keys)] + [row]
                    print(f"{size}B {dtype} checkpointing {ckpt} {variant}: peak {r['peak_gib']:.2f} GiB, "
                          f"{r.get('s_per_step', float('nan')):.1f} s/step, rc {r['rc']}", flush=True)
                    (out / "train_memory.json").write_text(json.dumps({"rows": rows, "settings": {
                        "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps, "lr": a.lr}}, indent=1))
    print()
    print(table(rows))
    print(f"\nwrote {out / 'train_memory.json'}")


if __name__ == "__main__":
    main()
