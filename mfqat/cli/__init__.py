"""The `mfqat` command: parsing, up-front checks, the commands, and the end-to-end demo.

Owns: ``app`` (parsers and dispatch; imports nothing heavy), ``checks`` (user mistakes as one-line
errors, exit 2), ``commands`` (convert, eval, export-mlx, verify), ``demo`` / ``demo_args`` /
``demo_mac`` (`mfqat demo`).

The top layer: may import any other; nothing imports it. ``python -m mfqat`` and
``python -m mfqat.cli`` run it.
"""
from mfqat.cli.app import main

__all__ = ["main"]
