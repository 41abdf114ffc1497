#!/usr/bin/env python
"""Slice-and-Scale on SmolLM2-135M: fraction of elements differing from direct quantization of the
full-precision weights (double rounding), conversion time, anchor size vs bf16.

    python scripts/bench_slice.py
"""
import tempfile
import time
from pathlib import Path


import mfqat
from mfqat.anchor import default_targets
from mfqat.data import load_model
from mfqat.slice import slice_and_scale


def main() -> None:
    model, tok = load_model()
    sd = model.state_dict()
    names = default_targets(model, 32)
    with tempfile.TemporaryDirectory() as d:
        for anchor_fmt, targets in (("mxint8", ["mxint6", "mxint5", "mxint4", "mxint3", "mxint2"]),
                                    ("mxfp8", ["mxfp6_e2m3", "mxfp6_e3m2", "mxfp4"])):
            path = mfqat.save_anchor(model, Path(d) / anchor_fmt, anchor_fmt, tok)
            size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
            bf16 = sum(v.numel() * 2 for v in sd.values())
            a = mfqat.read_anchor(path)
            print(f"{anchor_fmt} anchor: {size / 1e6:.1f} MB vs bf16 {bf16 / 1e6:.1f} MB "
                  f"(targets {len(names)} tensors)")
            for fmt in targets:
                t = time.perf_counter()
                sliced = {k: slice_and_scale(q, fmt) for k, q in a.quantized.items()}
                dt = time.perf_counter() - t
                diff = total = 0
                for k, q in sliced.items():
                    direct = mfqat.quantize(sd[k].float(), fmt).dequantize()
                    diff += (q.dequantize() != direct).sum().item()
                    total += direct.numel()
                print(f"  -> {fmt:<11} convert {dt:5.2f}s  differs from direct: {100 * diff / total:.3f}%")


if __name__ == "__main__":
    main()
