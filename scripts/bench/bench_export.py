#!/usr/bin/env python
"""MLX export measurements on SmolLM2-135M, side by side in one run:

* per recipe: export time, bits per weight (MX nominal; stored: codes+scales+biases of the 2-D weights;
  file: 8 x safetensors bytes / parameter count), perplexity of the export run in MLX vs the PyTorch
  model holding the same weights (they must agree);
* generation tokens/s of our uniform:mxint4 export vs `mlx_lm.convert -q --q-bits 4
  --q-group-size 32` of the same full-precision weights;
* our auto:BPW against mlx-lm's own `mixed_3_6` recipe at the same size.

    python scripts/bench/bench_export.py [--anchor DIR] [--out out/bench_export] [--blocks 8]

Without --anchor, an MXINT8 anchor of the original model (post-training) is made first.
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import mlx.core as mx
import torch

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.sources import load_text, split_text, token_blocks
from mfqat.eval.perplexity import perplexity as torch_ppl
from mfqat.eval.report import format_table
from mfqat.export import to_mlx
from mfqat.export.mlx_export import plan_from_report, reference_state
from mfqat.export.mlx_sizes import anchor_parameters, stored_size
from mfqat.mlx.models import smollm2_mlx_dir
from mfqat.mlx.train import perplexity as mlx_ppl

PROMPT = "The Python language is"


def tokens_per_second(path: str, max_tokens: int = 64) -> float:
    from mlx_lm import load, stream_generate

    model, tok = load(path)
    last = None
    for last in stream_generate(model, tok, PROMPT, max_tokens=max_tokens):
        pass
    return float(last.generation_tps)


def storage_bpw(path: str) -> float:
    """Bits actually stored per weight of every 2-D weight (codes + scales + biases; 16-bit ones at 16)."""
    from mlx_lm import load

    model, _ = load(path)
    bits, count = 0, 0
    for _, m in model.named_modules():
        w = m.get("weight") if hasattr(m, "get") else None
        if w is None or w.ndim != 2:
            continue
        if hasattr(m, "bits") and "scales" in m:
            count += w.shape[0] * w.shape[1] * 32 // m.bits
            bits += 8 * (w.nbytes + m["scales"].nbytes + (m["biases"].nbytes if "biases" in m else 0))
        else:
            count += w.size
            bits += 8 * w.nbytes
    return bits / max(count, 1)


def file_bpw(folder: Path, n_params: int) -> float:
    """8 x bytes of the safetensors files / the whole model's parameter count (the export report's
    ``stored_bits_per_weight``), for any MLX folder."""
    return stored_size(folder, n_params, {})["stored_bits_per_weight"]


def mlx_perplexity(path: str, blocks: torch.Tensor) -> float:
    from mlx_lm import load

    model, _ = load(path)
    return mlx_ppl(model, mx.array(blocks.numpy()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchor", default=None, help="anchor to export (default: PTQ MXINT8 anchor of --fp-dir)")
    p.add_argument("--fp-dir", default=None, help="full-precision HF dir for mlx_lm.convert (default: SmolLM2)")
    p.add_argument("--out", default="out/bench_export")
    p.add_argument("--blocks", type=int, default=24, help="held-out blocks of 128 tokens for perplexity")
    p.add_argument("--recipes", default="uniform:mxint8,uniform:mxint4,seed")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"],
                   help="scales/biases dtype for both exporters (mlx_lm.convert --dtype); bfloat16 is very "
                        "slow on MLX's CPU backend (no bf16 GEMM), fine on Metal")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fp_dir = Path(a.fp_dir) if a.fp_dir else smollm2_mlx_dir()
    anchor_dir = Path(a.anchor) if a.anchor else out / "ptq-anchor"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not a.anchor and not anchor_dir.exists():
        model = AutoModelForCausalLM.from_pretrained(fp_dir, dtype=torch.float32)
        mfqat.save_anchor(model, anchor_dir, "mxint8", AutoTokenizer.from_pretrained(fp_dir))
    anchor = read_anchor(anchor_dir)
    n_params = anchor_parameters(anchor)
    tmodel = mfqat.load_anchor(anchor_dir)
    _, held_text = split_text(load_text(None))
    blocks = token_blocks(AutoTokenizer.from_pretrained(str(anchor_dir)), held_text, 128, max_blocks=a.blocks)

    from mlx_lm import convert
    rows = []
    for label, kw, name in (("mlx_lm.convert -q 4-bit g32", {}, "mlxlm-q4"),
                            ("mlx_lm mixed_3_6 g32", {"quant_predicate": "mixed_3_6"}, "mlxlm-mixed_3_6")):
        d = out / name
        shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        convert(str(fp_dir), str(d), quantize=True, q_group_size=32, q_bits=4, dtype=a.dtype, **kw)
        rows.append({"model": label, "bits/weight": float("nan"), "export s": time.perf_counter() - t,
                     "MLX ppl": mlx_perplexity(str(d), blocks), "PyTorch ppl": float("nan"),
                     "stored bits/weight": storage_bpw(str(d)), "file bits/weight": file_bpw(d, n_params),
                     "size MB": sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20})
    # auto at the size of mixed_3_6: affine storage adds 32 bits of scale+bias per group of 32 in
    # bf16 (64 in fp32) where the MX nominal counts 8, so budget = stored - (overhead - 0.25)
    overhead = (1.0 if a.dtype == "bfloat16" else 2.0) - 0.25
    recipes = a.recipes.split(",") + [f"auto:{rows[1]['stored bits/weight'] - overhead:.2f}"]
    for recipe in recipes:
        d = out / ("ours-" + recipe.replace(":", "-"))
        shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        rep = to_mlx(anchor_dir, d, recipe=recipe, scale_dtype=a.dtype)
        secs = time.perf_counter() - t
        tmodel.load_state_dict(reference_state(anchor, plan_from_report(rep)), strict=False)
        rows.append({"model": f"mfqat {recipe}", "bits/weight": rep["bits_per_weight"], "export s": secs,
                     "MLX ppl": mlx_perplexity(str(d), blocks), "PyTorch ppl": torch_ppl(tmodel, blocks),
                     "stored bits/weight": storage_bpw(str(d)), "file bits/weight": rep["stored_bits_per_weight"],
                     "size MB": sum(f.stat().st_size for f in d.glob("*.safetensors")) / 2**20})
    print(f"anchor={anchor_dir} fp={fp_dir} held-out tokens={blocks.numel()} dtype={a.dtype}")
    print(format_table(rows, ["model", "bits/weight", "stored bits/weight", "file bits/weight", "size MB", "export s", "MLX ppl",
                              "PyTorch ppl"]))

    ours, theirs = out / "ours-uniform-mxint4", out / "mlxlm-q4"
    if ours.exists():
        tps = {"mfqat uniform:mxint4": tokens_per_second(str(ours)), "mlx_lm.convert -q 4 g32": tokens_per_second(str(theirs))}
        tps.update({k + " (again)": tokens_per_second(str(p)) for k, p in
                    (("mfqat uniform:mxint4", ours), ("mlx_lm.convert -q 4 g32", theirs))})
        print(format_table([{"model": k, "tokens/s": v} for k, v in tps.items()], ["model", "tokens/s"]))


if __name__ == "__main__":
    main()
