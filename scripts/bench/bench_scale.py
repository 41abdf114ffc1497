#!/usr/bin/env python
"""Memory and time at the sizes users ship: each command as its own process, its peak resident memory
(the child's own VmHWM, read as it exits; ru_maxrss would also count this script's memory at the fork) and
wall time, next to `mlx_lm.convert -q` on the same folder.

Random-weight Llama checkpoints saved in bfloat16 (sharded safetensors with an index, SmolLM2's
tokenizer, vocabulary 49152) are built tensor by tensor (never a whole model in memory). Size ``moe2`` is
a Qwen3.5-MoE-shaped release instead (``Qwen3_5MoeForConditionalGeneration``: 2.1B parameters, hidden 2048,
8 layers of 3 Gated DeltaNet + 1 gated attention, 64 experts of 512 (8 active) + a shared expert, a small
vision tower, the experts one by one on disk as ``save_pretrained`` writes them); it is left out of the
growth laws, which are fitted over the Llama sizes:

    python scripts/bench/bench_scale.py [--sizes 0.1,0.5,1.2,3,moe2] [--out out/bench_scale] [--commands ...]

Prints one table (peak GiB, x the bf16 bytes, seconds, ratio to mlx_lm.convert), fits each command's
growth law peak = a + b x bf16 GiB over the sizes, and writes scale.json and scale_memory.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# name: (hidden, layers, intermediate, heads, kv heads, tied)
SHAPES = {
    "0.1": (576, 30, 1536, 9, 3, True),      # SmolLM2-135M's shape
    "0.5": (1024, 24, 4096, 16, 4, False),
    "1.2": (2048, 16, 8192, 32, 8, False),
    "3": (3072, 26, 8192, 24, 8, False),
}
VOCAB = 49152
SHARD_BYTES = 2 * 1024 ** 3  # sources in 2 GiB shards, as released checkpoints come
PY = sys.executable
COMMANDS = {
    "mlx_lm.convert -q": lambda src, out: [PY, "-m", "mlx_lm", "convert", "--hf-path", str(src), "--mlx-path",
                                           str(out / "mlx_lm"), "-q"],
    "export-mlx HF uniform:affine4": lambda src, out: [PY, "-m", "mfqat", "export-mlx", str(src), "--out",
                                                       str(out / "mfqat"), "--recipe", "uniform:affine4",
                                                       "--no-refine"],  # round to nearest, as mlx_lm.convert -q
    "PTQ anchor (anchor_from_folder)": lambda src, out: [PY, "-c", "import sys; from mfqat.anchor.stream import "
                                                         "anchor_from_folder as a; a(sys.argv[1], sys.argv[2])",
                                                         str(src), str(out / "anchor")],
    "export-mlx ANCHOR uniform:affine4": lambda src, out: [PY, "-m", "mfqat", "export-mlx", str(out / "anchor"),
                                                           "--out", str(out / "mfqat-a"), "--recipe",
                                                           "uniform:affine4", "--no-refine"],
    "export-mlx HF auto:4.5": lambda src, out: [PY, "-m", "mfqat", "export-mlx", str(src), "--out", str(out / "auto"),
                                                "--recipe", "auto:4.5"],  # MX widths: the sensitivity pass, no refine
    "export-mlx HF auto:4.5:affine": lambda src, out: [PY, "-m", "mfqat", "export-mlx", str(src), "--out",
                                                       str(out / "auto-affine"), "--recipe", "auto:4.5:affine"],
    # (the default: the sensitivity pass, then refine with steps by model size)
    "export-mlx ANCHOR auto:4.5:affine --refine-steps 2": lambda src, out: [
        PY, "-m", "mfqat", "export-mlx", str(out / "anchor"), "--out", str(out / "auto-affine-a"), "--recipe",
        "auto:4.5:affine", "--refine-steps", "2"],  # the sensitivity pass and a short refine (its memory, not its time)
    "convert ANCHOR --to mxint4": lambda src, out: [PY, "-m", "mfqat", "convert", str(out / "anchor"), "--to", "mxint4",
                                                    "--out", str(out / "converted"), "--overwrite"],
    "eval ANCHOR --formats mxint4 --dtype bfloat16": lambda src, out: [PY, "-m", "mfqat", "eval", str(out / "anchor"), "--formats",
                                                      "mxint4", "--blocks", "2", "--seq-len", "128", "--dtype", "bfloat16", "--plot",
                                                      str(out / "eval.png")],
}


MOE_TEXT = dict(hidden_size=2048, num_hidden_layers=8, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
                num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False)
MOE_VISION = dict(depth=4, hidden_size=512, intermediate_size=1536, num_heads=8, out_hidden_size=2048, patch_size=16,
                  temporal_patch_size=2)


def _llama(size: str):
    """(config, {name: shape} as stored) of the Llama of ``size``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, inter, heads, kv, tied = SHAPES[size]
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
                      max_position_embeddings=2048, dtype="bfloat16")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return cfg, {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied: the embedding once


def _qwen35_moe():
    """(config, {name: shape} as stored) of the Qwen3.5-MoE-shaped release: the names save_pretrained writes
    (transformers' own conversion reverted on meta tensors: the experts one by one)."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    cfg = transformers.Qwen3_5MoeConfig(text_config=MOE_TEXT, vision_config=MOE_VISION, tie_word_embeddings=False,
                                        dtype="bfloat16")
    with torch.device("meta"):
        model = transformers.Qwen3_5MoeForConditionalGeneration(cfg)
    stored = revert_weight_conversion(model, dict(model.state_dict()))
    return cfg, {n: tuple(t.shape) for n, t in stored.items()}


def _norm_init(size: str, name: str) -> float:
    """A norm weight as the model's own initialisation sets it: Qwen3.5's RMSNorms scale by ``1 + w`` (0),
    its gated linear-attention norm by ``w`` (1), Llama's by ``w`` (1)."""
    return 1.0 if size != "moe2" or "linear_attn.norm" in name else 0.0


def build(size: str, folder: Path) -> int:
    """A random bf16 checkpoint of ``size`` in ``folder`` (skipped when present); its bf16 bytes."""
    import torch

    from mfqat.data.sources import load_model
    from mfqat.storage.tensor_files import ShardWriter

    done = folder / "config.json"
    cfg, names = _qwen35_moe() if size == "moe2" else _llama(size)
    nbytes = 2 * sum(torch.Size(s).numel() for s in names.values())
    if done.is_file():
        return nbytes
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    writer = ShardWriter(folder, SHARD_BYTES)
    for n, shape in names.items():
        t = torch.full(shape, _norm_init(size, n)) if "norm" in n and len(shape) == 1 else \
            torch.randn(shape, generator=gen) * 0.02
        writer.add(n, t.to(torch.bfloat16))
    writer.close()
    load_model(None)[1].save_pretrained(folder)  # SmolLM2's tokenizer (vocabulary 49152)
    cfg.save_pretrained(folder)
    return nbytes


# Runs `python -m MOD ...` / `python -c CODE ...` in this process and writes its VmHWM (kB) at exit.
PEAK_WRAPPER = """
import atexit, os, runpy, sys
def _report():
    with open('/proc/self/status') as f:
        hwm = next(line for line in f if line.startswith('VmHWM:')).split()[1]
    with open(os.environ['BENCH_PEAK_FILE'], 'w') as f:
        f.write(hwm)
atexit.register(_report)
kind, target, *rest = sys.argv[1:]
if kind == '-m':
    sys.argv = [target, *rest]
    runpy.run_module(target, run_name='__main__', alter_sys=True)
else:
    sys.argv = ['-c', *rest]
    exec(compile(target, '<bench>', 'exec'), {'__name__': '__main__'})
"""


def measure(cmd, log: Path, limit_gib: float) -> dict:
    """Run ``cmd`` (``[python, -m|-c, ...]``) as a child; its peak RSS (GiB: its own VmHWM; ru_maxrss if it
    died before reporting), wall seconds and exit status."""
    peak_file = log.with_suffix(".peak")
    env = {**os.environ, "MFQAT_PROGRESS": "0", "PYTHONPATH": str(ROOT), "BENCH_PEAK_FILE": str(peak_file)}
    t0 = time.perf_counter()
    with open(log, "w") as out:
        def cap():
            import resource
            lim = int(limit_gib * 1024 ** 3)
            resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
        proc = subprocess.Popen([cmd[0], "-c", PEAK_WRAPPER, *cmd[1:]], stdout=out, stderr=subprocess.STDOUT,
                                env=env, preexec_fn=cap)
        _, status, usage = os.wait4(proc.pid, 0)
    kib = int(peak_file.read_text()) if peak_file.is_file() else usage.ru_maxrss
    return {"peak_gib": kib / 1024 ** 2, "seconds": time.perf_counter() - t0,
            "rc": os.waitstatus_to_exitcode(status)}


def fit(points):
    """Least-squares (a, b) of peak = a + b x size over [(size, peak)]."""
    n = len(points)
    if n < 2:
        return None
    mx_ = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx_) ** 2 for p in points)
    b = sum((p[0] - mx_) * (p[1] - my) for p in points) / var if var else 0.0
    return my - b * mx_, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.1,0.5,1.2")
    ap.add_argument("--out", default="out/bench_scale")
    ap.add_argument("--commands", default=",".join(COMMANDS), help="comma-separated names from: " + ", ".join(COMMANDS))
    ap.add_argument("--limit-gib", type=float, default=20.0, help="address-space cap of each command")
    ap.add_argument("--keep", action="store_true", help="keep the outputs (default: removed after each size)")
    ap.add_argument("--merge", action="store_true", help="add to the rows of an earlier --out/scale.json "
                    "(its rows of the sizes and commands run now are replaced)")
    a = ap.parse_args()
    out = Path(a.out)
    sizes = a.sizes.split(",")
    rows = []
    if a.merge and (out / "scale.json").is_file():
        rows = [r for r in json.loads((out / "scale.json").read_text())["rows"]
                if r["size"] not in sizes or r["command"] not in a.commands.split(",")]
    for size in sizes:
        src = out / f"src-{size}B"
        gib = build(size, src) / 1024 ** 3
        work = out / f"work-{size}B"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for name in a.commands.split(","):
            r = measure(COMMANDS[name](src, work), work / f"{name.split()[0]}-{len(rows)}.log", a.limit_gib)
            rows.append({"size": size, "bf16_gib": gib, "command": name, **r})
            print(f"{size}B ({gib:.2f} GiB bf16) {name}: peak {r['peak_gib']:.2f} GiB ({r['peak_gib'] / gib:.2f}x), "
                  f"{r['seconds']:.0f} s, rc {r['rc']}", flush=True)
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    ref = {r["size"]: r for r in rows if r["command"].startswith("mlx_lm")}
    print("\n| size | bf16 GiB | command | peak GiB | x bf16 | s | peak / mlx_lm | time / mlx_lm | rc |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = ref.get(r["size"])
        ok = m is not None and m["rc"] == 0
        ratio = f"{r['peak_gib'] / m['peak_gib']:.2f}" if ok else ("mlx_lm failed" if m else "-")
        tratio = f"{r['seconds'] / m['seconds']:.2f}" if ok else "-"
        print(f"| {r['size']}B | {r['bf16_gib']:.2f} | {r['command']} | {r['peak_gib']:.2f} | "
              f"{r['peak_gib'] / r['bf16_gib']:.2f} | {r['seconds']:.0f} | {ratio} | {tratio} | {r['rc']} |")
    print("\ngrowth law, peak GiB = a + b x bf16 GiB:")
    laws = {}
    for name in dict.fromkeys(r["command"] for r in rows):
        law = fit([(r["bf16_gib"], r["peak_gib"]) for r in rows
                   if r["command"] == name and r["rc"] == 0 and r["size"] in SHAPES])  # the Llama sizes
        if law:
            laws[name] = law
            print(f"  {name}: {law[0]:.2f} + {law[1]:.2f} x")
    (out / "scale.json").write_text(json.dumps({"rows": rows, "laws": laws}, indent=1))
    plot(rows, out / "scale_memory.png")
    print(f"wrote {out / 'scale.json'} and {out / 'scale_memory.png'}")


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["command"] for r in rows):
        pts = sorted((r["bf16_gib"], r["peak_gib"]) for r in rows if r["command"] == name and r["rc"] == 0
                     and r["size"] in SHAPES)  # by size: --merge appends rows out of order
        if pts:
            line, = ax.plot(*zip(*pts), marker="o", label=name)
            moe = [(r["bf16_gib"], r["peak_gib"]) for r in rows if r["command"] == name and r["rc"] == 0
                   and r["size"] not in SHAPES]
            if moe:
                ax.plot(*zip(*moe), marker="*", markersize=12, linestyle="none", color=line.get_color())
    sizes = sorted({r["bf16_gib"] for r in rows})
    ax.plot(sizes, sizes, "k:", label="1x the bf16 bytes")
    ax.set_xlabel("model size (GiB in bfloat16)")
    ax.set_ylabel("peak resident memory (GiB)")
    ax.set_title("Peak memory: mfqat vs mlx_lm.convert (stars: a Qwen3.5-MoE release)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
