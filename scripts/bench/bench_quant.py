#!/usr/bin/env python
"""Fake-quant speed per format, as ratios to x.clone() and to torchao measured in the same run: the code of
`mfqat bench` (mfqat/quant/kernels/bench.py, which ships in the package), run from a source checkout.

    python scripts/bench/bench_quant.py [--size 4096] [--backends reference,cpp] [--repeats 7] [--dtype bfloat16]
                                        [--device cuda --backends triton,cuda,reference]
                                        [--through mxint8:mxint4,mxfp8_e4m3:mxfp4_e2m1] [--formats ""]

`--help` gives the flags and the columns of its tables.
"""
from mfqat.quant.kernels.bench import main

if __name__ == "__main__":
    main()
