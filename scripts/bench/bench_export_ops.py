#!/usr/bin/env python
"""The two CPU ops an export spends its time in, C++ against the PyTorch reference, measured side by
side in one run: MLX's affine quantization (every derived-affine tensor: ``quantize_affine``) and MX
dequantization (every anchor tensor read back: ``dequantize_mx``), on a bf16 matrix of the size of a
3B model's MLP projection.

    python scripts/bench/bench_export_ops.py [--rows 8192] [--cols 3072] [--repeats 5]

Prints median milliseconds per op and path, the speed-up, and checks the two paths give the same bits.
"""
from __future__ import annotations

import argparse
import torch

import mfqat
from mfqat.quant.kernels import cpp
from mfqat.quant.kernels.bench import best_ms as median_ms
from mfqat.quant.reference import affine_quantize_blocks, mx_dequantize_blocks, to_blocks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=3072)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if not (cpp.AFFINE_AVAILABLE and cpp.DEQUANT_AVAILABLE):
        print(f"the C++ extension lacks the ops ({cpp.LOAD_ERROR or 'an older build'}); rebuild it")
        return 1
    torch.manual_seed(0)
    w = torch.randn(a.rows, a.cols).to(torch.bfloat16)
    affine4 = mfqat.get_format("affine4")
    q8 = mfqat.quantize(w, "mxint8")
    mxint8 = q8.fmt
    cases = {
        "affine4 g64 quantize": (lambda: affine_quantize_blocks(to_blocks(w, 64), affine4, torch.bfloat16),
                                 lambda: cpp.quantize_affine_cpp(w, affine4, 64)),
        "mxint8 dequantize": (lambda: mx_dequantize_blocks(q8.codes.reshape(a.rows, -1, 32), q8.scales, mxint8),
                              lambda: cpp.dequantize_mx_cpp(q8.codes, q8.scales, mxint8, 32)),
    }
    ref_c, ref_s, _ = cases["affine4 g64 quantize"][0]()
    got_c, got_s, _, _ = cases["affine4 g64 quantize"][1]()
    same = torch.equal(ref_c.reshape(w.shape), got_c) and torch.equal(ref_s, got_s.to(torch.bfloat16).float())
    same &= torch.equal(cases["mxint8 dequantize"][0]().reshape(w.shape), cases["mxint8 dequantize"][1]())
    print(f"{a.rows}x{a.cols} bfloat16, {torch.get_num_threads()} threads; same bits: {same}")
    print(f"| op | reference ms | C++ ms | speed-up |\n|---|---|---|---|")
    for name, (ref, fast) in cases.items():
        r, f = median_ms(ref, a.repeats), median_ms(fast, a.repeats)
        print(f"| {name} | {r:.1f} | {f:.1f} | {r / f:.1f}x |")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
