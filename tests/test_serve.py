"""`mfqat serve`: the real mlx-lm server on 127.0.0.1, serving only its model, CORS off by default."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from mfqat.data.sources import tiny_llama, tiny_tokenizer

from .conftest import free_port

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

START_TIMEOUT_S = 600  # a hang guard only: the wait ends when the server answers or exits


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny HF Llama directory mlx-lm loads, and a copy of it elsewhere (another loadable model)."""
    d = tmp_path_factory.mktemp("serve")
    tok = tiny_tokenizer()
    tiny_llama(vocab_size=len(tok), tie=True).save_pretrained(d / "served", safe_serialization=True)
    tok.save_pretrained(d / "served")
    shutil.copytree(d / "served", d / "other")
    return d / "served", d / "other"


def _request(port: int, method: str, path: str, body=None, headers=None):
    """(status, headers, body) of one request; HTTP errors are answers too."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def _start(model_dir, port: int, *extra: str) -> subprocess.Popen:
    """Start `mfqat serve` and wait (bounded) until it answers /health."""
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-m", "mfqat.cli", "serve", str(model_dir), "--port", str(port), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _request(port, "GET", "/health")[0] == 200:
                return proc
        except OSError:
            time.sleep(0.3)
    code = proc.poll()
    proc.kill()
    pytest.fail(f"mfqat serve exited with status {code} before it answered" if code is not None
                else f"mfqat serve did not answer within {START_TIMEOUT_S} s (hung)")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_serve_refuses_other_models_and_cors_by_default(model_dirs):
    served, other = model_dirs
    port = free_port()
    proc = _start(served, port)
    try:
        ask = {"prompt": "def f", "max_tokens": 2}
        status, _, body = _request(port, "POST", "/v1/completions", {**ask, "model": str(other)})
        assert status == 404 and b"not served" in body, (status, body)
        status, _, body = _request(port, "POST", "/v1/completions", {**ask, "adapters": str(other)})
        assert status == 404, (status, body)
        status, _, body = _request(port, "POST", "/v1/completions", {**ask, "model": str(served)})
        assert status == 200 and json.loads(body)["choices"], (status, body)
        status, headers, _ = _request(port, "OPTIONS", "/v1/completions", headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        cors = {k: v for k, v in headers.items() if k.lower().startswith("access-control")}
        assert not cors, cors  # no Access-Control-Allow-Origin: * (nor any other CORS grant)
        models = json.loads(_request(port, "GET", "/v1/models")[2])["data"]
        assert [m["id"] for m in models] == [str(served.resolve())]
    finally:
        _stop(proc)


def test_serve_allow_origin_echoes_only_that_origin(model_dirs):
    port = free_port()
    proc = _start(model_dirs[0], port, "--allow-origin", "http://app.example")
    try:
        pre = {"Access-Control-Request-Method": "POST"}
        _, headers, _ = _request(port, "OPTIONS", "/v1/completions", headers={"Origin": "http://app.example", **pre})
        assert headers["Access-Control-Allow-Origin"] == "http://app.example"
        _, headers, _ = _request(port, "OPTIONS", "/v1/completions", headers={"Origin": "http://evil.example", **pre})
        assert headers.get("Access-Control-Allow-Origin") is None
    finally:
        _stop(proc)


def test_serve_missing_directory_fails_at_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-m", "mfqat.cli", "serve", str(tmp_path / "does/not/exist"),
                           "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr
    assert "does not exist" in done.stderr


def test_serve_passes_mlx_lm_server_flags(model_dirs):
    """Flags mfqat does not define go to mlx_lm.server: --max-tokens sets the default completion length."""
    port = free_port()
    proc = _start(model_dirs[0], port, "--max-tokens", "3")
    try:
        status, _, body = _request(port, "POST", "/v1/completions", {"prompt": "def f"})
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] <= 3
    finally:
        _stop(proc)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    done = subprocess.run([sys.executable, "-m", "mfqat.cli", "serve", str(model_dirs[0]), "--no-such-flag"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "--no-such-flag" in done.stderr
