"""Command-line arguments of `mfqat demo` (kept apart from mfqat.cli.demo so `--help` does not import torch)."""
from __future__ import annotations

import argparse
from typing import Optional

DEMO_DOC = """The end-to-end demo on the embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to
float32; every number starts from its weights): its perplexity -> PTQ -> MF-QAT fine-tune -> anchor -> elastic formats
by Slice-and-Scale -> Mac exports in MLX's affine layout, against mlx_lm.convert of the same
fine-tuned weights at the same bytes. Re-runs reuse finished
stages (OUT/stages/*.json) unless --force."""


def build_parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    """The demo's flags, added to ``p`` (a new parser when None)."""
    p = p or argparse.ArgumentParser(description=DEMO_DOC)
    p.add_argument("--out", "--output-dir", dest="out", default="out/demo")
    p.add_argument("--steps", type=int, default=40, help="joint MF-QAT steps (mxint_joint_search: mxint8/6/4 in each, about 16 s a step on 2 cores)")
    p.add_argument("--eval-blocks", type=int, default=24, help="held-out blocks of 128 tokens")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct "
                   "(Q4_1 GGUF, dequantized to float32)")
    p.add_argument("--force", action="store_true", help="redo every stage")
    p.add_argument("--skip-mlx", action="store_true")
    return p
