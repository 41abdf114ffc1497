#!/usr/bin/env python
"""Activation observers on SmolLM2-135M (no training): held-out perplexity at mxint8 / mxint4
weights with (a) weight-only, (b) dynamic MX activations (mxfp8_e4m3), (c) the static
``window_minmax`` int8 observer after W calibration forwards in training mode (no backward),
its held-out clip rate, and the eval time per block of each.

    python scripts/bench/bench_observers.py [--calib 16] [--blocks 8] [--window 64]
"""
import argparse
import copy
import time

import torch

import mfqat
from mfqat.data.sources import load_model, load_text, split_text, token_blocks
from mfqat.eval.perplexity import perplexity
from mfqat.eval.report import format_table
from mfqat.qat import mean_clip_rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calib", type=int, default=16, help="calibration blocks of 128 tokens (training forwards)")
    p.add_argument("--blocks", type=int, default=8, help="held-out blocks of 128 tokens")
    p.add_argument("--window", type=int, default=64, help="observer window")
    a = p.parse_args()
    base, tok = load_model()
    train, held = split_text(load_text(None))
    calib = token_blocks(tok, train, 128, max_blocks=a.calib)
    held = token_blocks(tok, held, 128, max_blocks=a.blocks)
    variants = {"weight-only": {}, "dynamic mxfp8_e4m3": {"quantize_activations": True},
                f"window_minmax W={a.window}": {"activation_observer": "window_minmax", "observer_window": a.window}}
    rows = []
    for name, extra in variants.items():
        model = mfqat.prepare(copy.deepcopy(base), mfqat.QATConfig(formats=["mxint8", "mxint4"], **extra))
        mfqat.set_format(model, "mxint8")
        if extra.get("activation_observer"):
            model.train()
            with torch.no_grad():
                for blk in calib.split(1):
                    model(input_ids=blk)
            mean_clip_rate(model, reset=True)
        model.eval()
        for fmt in ("mxint8", "mxint4"):
            mfqat.set_format(model, fmt)
            t = time.perf_counter()
            ppl = perplexity(model, held)
            dt = (time.perf_counter() - t) / len(held)
            rows.append({"activations": name, "weights": fmt, "perplexity": ppl, "s/block": dt,
                         "clip %": 100 * mean_clip_rate(model, reset=True) if extra.get("activation_observer") else None})
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
