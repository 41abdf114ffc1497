"""Serving on MLX: `mfqat generate DIR --prompt ...` and `mfqat serve DIR` over mlx-lm."""
from __future__ import annotations

import sys
from typing import List, Optional


def generate(model_dir: str, prompt: str, max_tokens: int = 64, adapter_path: Optional[str] = None,
             verbose: bool = False) -> str:
    """Load an MLX model directory (an mfqat export, optionally with LoRA adapters) and complete ``prompt``."""
    from mlx_lm import generate as mlx_generate
    from mlx_lm import load

    model, tok = load(model_dir, adapter_path=adapter_path)
    return mlx_generate(model, tok, prompt=prompt, max_tokens=max_tokens, verbose=verbose)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8080, extra: Optional[List[str]] = None) -> None:
    """Run mlx-lm's OpenAI-style HTTP server (``/v1/completions``, ``/v1/chat/completions``) on the model."""
    from mlx_lm import server

    argv = ["mlx_lm.server", "--model", model_dir, "--host", host, "--port", str(port)] + list(extra or [])
    old, sys.argv = sys.argv, argv
    try:
        server.main()
    finally:
        sys.argv = old
