#!/usr/bin/env python
"""Export an mfqat anchor (or a plain HF model) to MLX: `python scripts/export_to_mlx.py ANCHOR --out DIR`."""
import sys

from mfqat.cli import main

if __name__ == "__main__":
    main(["export-mlx", *sys.argv[1:]])
