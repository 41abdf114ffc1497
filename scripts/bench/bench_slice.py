#!/usr/bin/env python
"""Slice-and-Scale on SmolLM2-135M (PTQ anchors of the original weights), in one run:

* conversion time of every quantized tensor, reference path vs the default fast path;
* fraction of elements that differ from direct quantization of the full-precision weights
  (double rounding, docs/numerics.md, "Double rounding") and its effect on held-out perplexity;
* anchor size vs bf16.

    python scripts/bench/bench_slice.py [--blocks 8]
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

import mfqat
from mfqat.anchor.tensors import default_targets
from mfqat.data.sources import load_model, load_text, split_text, token_blocks
from mfqat.eval.elastic import evaluate_formats
from mfqat.eval.report import format_table
from mfqat.quant.slice import slice_and_scale


def convert_seconds(anchor, fmt: str, backend: str):
    os.environ["MFQAT_BACKEND"] = backend
    t = time.perf_counter()
    out = {k: slice_and_scale(q, fmt) for k, q in anchor.quantized.items()}
    dt = time.perf_counter() - t
    os.environ["MFQAT_BACKEND"] = "auto"
    return out, dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8, help="held-out blocks of 128 tokens")
    a = p.parse_args()
    model, tok = load_model()
    sd = model.state_dict()
    names = default_targets(model, 32)
    held = token_blocks(tok, split_text(load_text(None))[1], 128, max_blocks=a.blocks)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for anchor_fmt, targets in (("mxint8", ["mxint6", "mxint5", "mxint4", "mxint3", "mxint2"]),
                                    ("mxfp8", ["mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1"])):
            path = mfqat.save_anchor(model, Path(d) / anchor_fmt, anchor_fmt, tok)
            size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            bf16 = sum(v.numel() * 2 for v in sd.values())
            anchor = mfqat.read_anchor(path)
            print(f"{anchor_fmt} anchor: {size / 1e6:.1f} MB vs bf16 {bf16 / 1e6:.1f} MB ({len(names)} quantized tensors)")
            for fmt in targets:
                _, ref_s = convert_seconds(anchor, fmt, "reference")
                sliced, fast_s = convert_seconds(anchor, fmt, "auto")
                diff = total = 0
                direct_state, sliced_state = {}, {}
                for k, q in sliced.items():
                    direct = mfqat.quantize(sd[k].float(), fmt).dequantize()
                    sliced_state[k] = q.dequantize()
                    direct_state[k] = direct
                    diff += (sliced_state[k] != direct).sum().item()
                    total += direct.numel()
                ppl = {r["format"]: r["perplexity"] for r in evaluate_formats(
                    model, {"sliced": sliced_state, "direct": direct_state}, held)}
                rows.append({"anchor": anchor_fmt, "to": fmt, "reference s": ref_s, "fast s": fast_s,
                             "speed-up": ref_s / fast_s, "differs %": 100 * diff / total,
                             "ppl sliced": ppl["sliced"], "ppl direct": ppl["direct"]})
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
