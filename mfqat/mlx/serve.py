"""Serving on MLX: `mfqat generate DIR --prompt ...` and `mfqat serve DIR` over mlx-lm.

``mfqat serve`` runs mlx-lm's OpenAI-style server (``mlx_lm.server``: its command line, its request
handling, its generation thread) with two restrictions on top, made by subclassing it:

* only the model directory given on the command line is served. mlx-lm loads whatever path or
  Hub id a request names in ``"model"`` (and ``"adapters"``, ``"draft_model"``); here a request
  naming anything else is refused with 404 before it reaches the model loader, and the loader
  itself refuses too. The names a client may use for the served model are ``default_model``,
  the directory as given, its absolute path (what ``/v1/models`` lists) and its base name;
* CORS is off unless ``--allow-origin ORIGIN`` is given (mlx-lm answers every origin with ``*``):
  without it no ``Access-Control-*`` header is sent, with it only that origin is echoed.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any, List, Optional, Set

from mlx_lm import server as mlx_server


def generate(model_dir: str, prompt: str, max_tokens: int = 64, adapter_path: Optional[str] = None,
             verbose: bool = False, temp: float = 0.0, top_p: float = 1.0, seed: Optional[int] = None,
             system_prompt: Optional[str] = None, chat_template: bool = True) -> str:
    """Load an MLX model directory (an mfqat export, optionally with LoRA adapters) and complete ``prompt``.

    As ``mlx_lm.generate``: the prompt goes through the tokenizer's chat template when it has one
    (``chat_template=False``: raw text), sampling by ``mlx_lm.sample_utils.make_sampler`` (``temp`` 0: greedy).
    """
    import mlx.core as mx
    from mlx_lm import generate as mlx_generate
    from mlx_lm import load
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    model, tok = load(model_dir, adapter_path=adapter_path)
    use_template = chat_template and tok.has_chat_template
    if use_template:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
        messages.append({"role": "user", "content": prompt})
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=not use_template)  # what mlx_lm.generate's command line does
    return mlx_generate(model, tok, prompt=ids, max_tokens=max_tokens, verbose=verbose,
                        sampler=make_sampler(temp=temp, top_p=top_p))


def check_model_dir(model_dir: str) -> Path:
    """The served directory, or ValueError when it is not an MLX model directory (config.json)."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model directory '{model_dir}' does not exist (mfqat serve takes a local MLX model "
                         "directory, e.g. one written by mfqat export-mlx)")
    if not (path / "config.json").is_file():
        raise ValueError(f"'{model_dir}' is not an MLX model directory: it has no config.json")
    return path


def model_aliases(model_dir: str) -> Set[str]:
    """The names under which requests may address the served model."""
    path = Path(model_dir)
    return {"default_model", model_dir, str(path.resolve()), path.resolve().name}


class ServedModelProvider(mlx_server.ModelProvider):
    """mlx-lm's model provider that loads the command line's model only, whatever a request names."""

    def refusal(self, model: Any, adapters: Any = None, draft_model: Any = "default_model") -> Optional[str]:
        """Why a request for (model, adapters, draft_model) is refused, or None when it is served."""
        if model not in model_aliases(self.cli_args.model):
            return f"model {model!r} is not served here; this server serves only {self.cli_args.model!r}"
        if adapters is not None and adapters != self.cli_args.adapter_path:
            return "this server does not load adapters named in requests (start it with --adapter-path)"
        if draft_model not in ("default_model", self.cli_args.draft_model):
            return "this server does not load draft models named in requests (start it with --draft-model)"
        return None

    def load(self, model_path, adapter_path=None, draft_model_path=None):  # type: ignore[override]
        """Load the served model; any other request is a PermissionError (the handler refuses it first)."""
        why = self.refusal(model_path, adapter_path, draft_model_path)
        if why:
            raise PermissionError(why)
        return super().load("default_model", None, "default_model")


class ServedModelHandler(mlx_server.APIHandler):
    """mlx-lm's request handler with the served-model check and CORS off unless an origin is allowed."""

    def _allowed_origin(self) -> Optional[str]:
        """The value of Access-Control-Allow-Origin for this request, or None (no CORS headers)."""
        allowed = [o for o in self.response_generator.cli_args.allowed_origins if o]
        origin = self.headers.get("Origin")
        if "*" in allowed:
            return "*"
        return origin if origin and origin in allowed else None

    def _set_cors_headers(self) -> None:
        origin = self._allowed_origin()
        if origin is None:
            return
        self.send_header("Access-Control-Allow-Origin", origin)
        self.send_header("Vary", "Origin")
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "Content-Type, Authorization")

    def _send_error(self, status: int, message: str) -> None:
        self._set_completion_headers(status)
        self.end_headers()
        self.wfile.write(json.dumps({"error": message}).encode())

    def do_POST(self) -> None:
        """Refuse requests for other models (404), then let mlx-lm handle the request as usual."""
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return super().do_POST()  # mlx-lm answers a missing or bad Content-Length
        if length < 0:
            return self._send_error(400, "Invalid Content-Length header")
        raw = self.rfile.read(length)
        self.rfile = io.BytesIO(raw)  # mlx-lm reads the body again
        try:
            body = json.loads(raw.decode())
        except ValueError:
            return super().do_POST()  # mlx-lm answers invalid JSON
        if isinstance(body, dict):
            why = self.response_generator.model_provider.refusal(
                body.get("model", "default_model"), body.get("adapters"), body.get("draft_model", "default_model"))
            if why:
                return self._send_error(404, why)
        return super().do_POST()

    def handle_models_request(self) -> None:
        """``/v1/models`` lists the served model only (mlx-lm also lists the Hugging Face cache)."""
        self._set_completion_headers(200)
        self.end_headers()
        model_id = str(Path(self.response_generator.cli_args.model).resolve())
        data = [{"id": model_id, "object": "model", "created": self.created}]
        self.wfile.write(json.dumps({"object": "list", "data": data}).encode())


def _run(host: str, port: int, model_provider: mlx_server.ModelProvider, *args: Any, **kwargs: Any) -> None:
    """mlx_lm.server.run with mfqat's provider and handler (mlx-lm's run ignores its handler_class)."""
    provider = ServedModelProvider(model_provider.cli_args)
    generator = mlx_server.ResponseGenerator(provider, mlx_server.LRUPromptCache(provider.cli_args.prompt_cache_size))
    mlx_server._run_http_server(host, port, generator, handler_class=ServedModelHandler)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8080, allow_origin: Optional[str] = None,
          extra: Optional[List[str]] = None) -> None:
    """Serve ``model_dir`` with mlx-lm's OpenAI-style server (``/v1/completions``, ``/v1/chat/completions``).

    Only that model is served and CORS is off unless ``allow_origin`` is given (see the module
    docstring). mlx-lm parses the command line (``extra`` takes any other mlx_lm.server option).
    """
    check_model_dir(model_dir)
    argv = ["mlx_lm.server", "--model", model_dir, "--host", host, "--port", str(port),
            "--allowed-origins", allow_origin or ""] + list(extra or [])
    old_argv, old_run = sys.argv, mlx_server.run
    sys.argv, mlx_server.run = argv, _run
    try:
        mlx_server.main()
    finally:
        sys.argv, mlx_server.run = old_argv, old_run
