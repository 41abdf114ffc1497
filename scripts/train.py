#!/usr/bin/env python
"""MF-QAT training for `accelerate launch` (see `python scripts/train.py --help`)."""
from mfqat.train.loop import main

if __name__ == "__main__":
    main()
