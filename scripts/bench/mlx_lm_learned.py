#!/usr/bin/env python
"""mlx-lm's learned quantizers (GPTQ, AWQ, DWQ, dynamic_quant) run offline, for scripts/bench/bench_pareto.py.

mlx-lm 0.32's command lines fetch their calibration data from the internet: ``mlx_lm.gptq``,
``mlx_lm.awq`` and ``mlx_lm.dynamic_quant`` read ``mlx_lm.quant.utils.load_data`` (a text file
downloaded into ~/.cache/mlx-lm on first use, no option names another file) and ``mlx_lm.dwq``
reads a Hugging Face dataset through the ``datasets`` library (not installed here, and a Hub name
in any case). None of them has an option for a local file, but each exposes the function its
``main()`` calls with the calibration tokens as an argument: ``gptq_quantize(model, data, ...)``,
``awq_quantize(model, inputs, ...)``, ``estimate_sensitivities(model, data, ...)`` +
``estimate_threshold`` + ``quantize_model``, and ``dwq_quantize(q_model, target_fn, opt,
train_data, valid_data, ...)``. This module calls those functions unpatched, with token blocks of
the pydoc *training* split (``mfqat.data.sources.calibration_blocks``; never the held-out texts
the benchmark scores), and saves the result with ``mlx_lm.utils.save`` exactly as each ``main()``
does.

Numerics, the same for every method: the float32 master is rounded to bfloat16 (what
``mlx_lm.convert --dtype bfloat16`` quantizes), the method computes in float32 (MLX's CPU backend is
~17x slower in bfloat16, and its quantized matmuls slower still), and the saved folder stores
scales, biases and norms in bfloat16 like ``mlx_lm.convert``'s (DWQ's own default ``dtype``).
The benchmark then scores the exact weights of the saved folder, so any rounding is charged to
the method.

Speed: MLX's CPU wheel (``mlx[cpu]``) links a reference BLAS (~2-4 GFLOP/s on this machine).
Debian's OpenBLAS (``apt-get install libopenblas0-pthread``) preloaded into the quantizing process
(``LD_PRELOAD``) replaces its GEMM (~20x faster). That is done here, for the child process that
quantizes, never in mfqat's runtime: ``blas_check()`` times one 1024x1024 float32 matmul in MLX
with and without it and checks that a small matmul agrees within float tolerance.

    python scripts/bench/mlx_lm_learned.py probe                       # one process's BLAS speed (JSON)
    python scripts/bench/mlx_lm_learned.py quantize gptq MASTER DEST   # one method, default settings
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

# Settings per method. Calibration is cut to what 2 shared CPU cores finish: MLX's CPU quantized
# matmul runs ~1 GFLOP/s in float32 (OpenBLAS does not help it), and AWQ (two passes of every
# quantized block over the calibration tokens) and DWQ (forward and backward through the quantized
# model every step) spend their time there. mlx-lm's CLI defaults are in the comments; everything
# else is at them unless noted. Group 64 and a 4-bit group-64 embedding put GPTQ, AWQ and DWQ at
# exactly mlx_lm.convert -q (q4 g64)'s stored size.
METHODS: Dict[str, dict] = {
    # CLI: every 512-token chunk of its calibration file; fallback (the embedding here) 6 bits
    "gptq": dict(bits=4, group_size=64, fallback_bits=4, fallback_group_size=64,
                 num_samples=32, sequence_length=512, batch_size=8, seed=123),
    # CLI: 128 x 512 tokens, n_grid 20 (its docs: 32 samples, n_grid 10), embedding 4 bits in groups of 32
    "awq": dict(bits=4, group_size=64, embed_bits=4, embed_group_size=64,
                num_samples=8, sequence_length=256, n_grid=10, seed=123),
    # CLI: every 512-token chunk of its file, target 5.0 bits (4.7: mixed_4_6's size)
    "dynamic": dict(low_bits=4, low_group_size=64, high_bits=5, high_group_size=64, target_bpw=4.7,
                    num_samples=16, sequence_length=512, batch_size=4, seed=123),
    # CLI: 2048 samples x 1025 tokens (512 steps of batch 4), lr 1e-6, 32 validation samples; here
    # 8 steps of 4 x 128 tokens, so the learning rate is 10x the default
    "dwq": dict(bits=4, group_size=64, num_samples=32, max_seq_length=129, batch_size=4,
                learning_rate=1e-5, num_valid_samples=4, temperature=2.0, seed=123),
}
SLOW = ("awq", "dwq")  # the two that refuse the reference BLAS without --allow-slow
FAST_GFLOPS = 10.0     # below this the process is on the reference BLAS


def parse_spec(spec: str) -> tuple:
    """``NAME[:key=value[:key=value...]]`` -> (name, settings): METHODS[name] with the overrides."""
    name, *pairs = spec.split(":")
    if name not in METHODS:
        raise SystemExit(f"unknown mlx-lm method {name!r}; known: {', '.join(METHODS)}")
    settings = dict(METHODS[name])
    for pair in pairs:
        k, _, v = pair.partition("=")
        if k not in settings:
            raise SystemExit(f"{spec}: {name} has no setting {k!r} (settings: {', '.join(settings)})")
        settings[k] = type(settings[k])(v)
    return name, settings


# ----------------------------------------------------------------------------------------------
# BLAS: OpenBLAS preloaded into the quantizing process, checked against the reference BLAS


def openblas_library() -> Optional[str]:
    """Debian's libopenblas (``libopenblas0-pthread`` or ``-openmp``/``-serial``), or None."""
    for pattern in ("/usr/lib/*-linux-gnu/libopenblas.so.0", "/usr/lib/*-linux-gnu/openblas-*/libopenblas.so.0",
                    "/usr/lib/libopenblas.so.0"):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def probe() -> dict:
    """This process's MLX float32 GEMM speed (best of 3, 1024x1024) and a small matmul's result."""
    import mlx.core as mx
    import numpy as np

    a, b = mx.random.normal((1024, 1024), key=mx.random.key(0)), mx.random.normal((1024, 1024), key=mx.random.key(1))
    mx.eval(a @ b)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((48, 96), dtype=np.float32), rng.standard_normal((96, 40), dtype=np.float32)
    small = np.array(mx.array(x) @ mx.array(y))
    return {"seconds": best, "gflops": 2 * 1024 ** 3 / best / 1e9, "small": small.tolist(),
            "exact": (x.astype(np.float64) @ y.astype(np.float64)).tolist()}


def _probe_in_child(preload: Optional[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    out = subprocess.run([sys.executable, __file__, "probe"], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def blas_check() -> dict:
    """Time MLX's 1024x1024 float32 matmul with the reference BLAS and with OpenBLAS preloaded, and
    check the two agree on a small matmul (both against a float64 product). ``preload`` is what the
    quantizing child gets: the OpenBLAS path when it is faster and agrees, else None."""
    import numpy as np

    ref = _probe_in_child(None)
    lib = openblas_library()
    res = {"reference_gflops": ref["gflops"], "openblas": lib, "openblas_gflops": None, "preload": None}
    if lib is None:
        res["note"] = "no libopenblas.so.0 (apt-get install -y libopenblas0-pthread)"
        return res
    fast = _probe_in_child(lib)
    a, b, exact = (np.array(ref["small"]), np.array(fast["small"]), np.array(fast["exact"]))
    scale = np.abs(exact).max()
    res.update(openblas_gflops=fast["gflops"], speedup=fast["gflops"] / ref["gflops"],
               max_rel_diff_openblas_vs_reference=float(np.abs(a - b).max() / scale),
               max_rel_err_reference=float(np.abs(a - exact).max() / scale),
               max_rel_err_openblas=float(np.abs(b - exact).max() / scale))
    agree = res["max_rel_diff_openblas_vs_reference"] < 1e-5 and res["max_rel_err_openblas"] < 1e-5
    res["agree"] = agree
    if agree and fast["gflops"] > ref["gflops"]:
        res["preload"] = lib
    return res


def require_fast_blas(names, check: dict, allow_slow: bool) -> None:
    """Refuse AWQ/DWQ on the reference BLAS (hours on this model) unless ``allow_slow``."""
    slow = [n for n in names if n in SLOW]
    gflops = check["openblas_gflops"] if check.get("preload") else check["reference_gflops"]
    if slow and gflops < FAST_GFLOPS and not allow_slow:
        raise SystemExit(f"{', '.join(slow)} on MLX's reference BLAS ({gflops:.1f} GFLOP/s) would take hours: "
                         "apt-get install -y libopenblas0-pthread (preloaded into the quantizing process "
                         f"automatically), or pass --allow-slow. BLAS check: {json.dumps(check)}")


# ----------------------------------------------------------------------------------------------
# The methods, run in a child process (OpenBLAS preloaded there)


def _load_float32(master: Path):
    """mlx_lm.load of the HF master, every float parameter rounded to bfloat16 (as convert
    --dtype bfloat16 stores it) and held in float32 for the computation."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import load

    model, tok, config = load(str(master), return_config=True)
    rnd = lambda p: p.astype(mx.bfloat16).astype(mx.float32) if mx.issubdtype(p.dtype, mx.floating) else p  # noqa: E731
    model.update(tree_map(rnd, model.parameters()))
    mx.eval(model.parameters())
    return model, tok, config


def _to_bfloat16(model) -> None:
    """Float parameters (scales, biases, norms, float weights) to bfloat16, as convert stores them."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    cast_predicate = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(mx.bfloat16) if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))


def calibration_tokens(master: Path, n: int, length: int):
    """(n, length) int32 token blocks of the pydoc training split, tokenized by the master's tokenizer."""
    import mlx.core as mx
    from transformers import AutoTokenizer

    from mfqat.data.sources import calibration_blocks

    tok = AutoTokenizer.from_pretrained(str(master))
    blocks = calibration_blocks(tok, None, n_blocks=n, seq_len=length)
    if blocks.shape[0] < n:
        raise SystemExit(f"the pydoc training split has only {blocks.shape[0]} blocks of {length} tokens (asked {n})")
    return mx.array(blocks.numpy().astype("int32"))


def _seeded_start(master: Path, s: dict):
    """mlx's random seed set from the settings, then (model in float32, tokenizer, config) of the master."""
    import mlx.core as mx

    mx.random.seed(s["seed"])
    return _load_float32(master)


def _save_bfloat16(dest: Path, master: Path, model, tok, config: dict) -> dict:
    """Save the quantized model with its non-quantized parameters in bfloat16 (as mlx-lm's commands do)."""
    from mlx_lm.utils import save

    _to_bfloat16(model)
    save(str(dest), str(master), model, tok, config)
    return {}


def run_gptq(master: Path, dest: Path, s: dict) -> dict:
    from mlx_lm.quant.gptq import gptq_quantize

    model, tok, config = _seeded_start(master, s)
    data = calibration_tokens(master, s["num_samples"], s["sequence_length"])
    model, config["quantization"] = gptq_quantize(model, data, s["bits"], s["group_size"], s["fallback_bits"],
                                                  s["fallback_group_size"], batch_size=s["batch_size"])
    return _save_bfloat16(dest, master, model, tok, config)


def run_awq(master: Path, dest: Path, s: dict) -> dict:
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

    model, tok, config = _seeded_start(master, s)
    awq_config = AWQ_MODEL_CONFIGS.get(config["model_type"])
    if awq_config is None:
        raise SystemExit(f"mlx_lm.awq has no config for model_type {config['model_type']!r}")
    data = calibration_tokens(master, s["num_samples"], s["sequence_length"])
    awq_quantize(model, data, awq_config, bits=s["bits"], group_size=s["group_size"], embed_bits=s["embed_bits"],
                 embed_group_size=s["embed_group_size"], n_grid=s["n_grid"])
    return _save_bfloat16(dest, master, model, tok, update_config(model, config))


def run_dynamic(master: Path, dest: Path, s: dict) -> dict:
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities, estimate_threshold
    from mlx_lm.utils import compute_bits_per_weight, quantize_model, save

    model, tok, config = _seeded_start(master, s)
    data = calibration_tokens(master, s["num_samples"], s["sequence_length"])
    sens = dict(estimate_sensitivities(model, data, s["low_bits"], s["low_group_size"], s["high_bits"],
                                       s["high_group_size"], batch_size=s["batch_size"]))
    _to_bfloat16(model)  # the threshold search counts bytes of the model as it will be stored
    threshold = estimate_threshold(model, sens, target_bpw=s["target_bpw"], low_bits=s["low_bits"],
                                   low_group_size=s["low_group_size"], high_bits=s["high_bits"],
                                   high_group_size=s["high_group_size"])

    def quant_predicate(p, m):  # dynamic_quant.main's predicate
        if not hasattr(m, "to_quantized"):
            return False
        if sens[p] > threshold:
            return {"bits": s["high_bits"], "group_size": s["high_group_size"]}
        return True

    model, config = quantize_model(model, config, group_size=s["low_group_size"], bits=s["low_bits"],
                                   quant_predicate=quant_predicate)
    high = sorted(p for p in sens if sens[p] > threshold)
    info = {"mlx_lm_bits_per_weight": compute_bits_per_weight(model), "high_precision_layers": len(high),
            "quantized_layers": len(sens)}
    save(str(dest), str(master), model, tok, config)
    return info


def run_dwq(master: Path, dest: Path, s: dict) -> dict:
    """dwq.main without its Hub dataset: the student is q4 g64 round-to-nearest of the master
    (``quantize_model``), the teacher the master (targets computed on the fly, no target dir)."""
    import copy

    import mlx.core as mx
    import mlx.optimizers as optimizers
    import numpy as np
    from mlx_lm.quant.dwq import dwq_quantize
    from mlx_lm.utils import quantize_model, save

    np.random.seed(s["seed"])
    mx.random.seed(s["seed"])
    model, tok, config = _load_float32(master)
    n, nv, length = s["num_samples"], s["num_valid_samples"], s["max_seq_length"]
    blocks = np.array(calibration_tokens(master, n + nv, length)).tolist()
    train = [(b, 0) for b in blocks[:n]]  # dwq.load_data's items: (tokens, prompt offset)
    valid = [(b, 0) for b in blocks[n:]]
    q_model = copy.deepcopy(model)
    _, config = quantize_model(q_model, config, group_size=s["group_size"], bits=s["bits"])
    opt = optimizers.Adam(learning_rate=s["learning_rate"], bias_correction=True)
    losses = []
    log = _capture_validation(losses)
    dwq_quantize(q_model, lambda batch, idx, split: model(batch), opt, train, valid, batch_size=s["batch_size"],
                 max_seq_length=length, seed=s["seed"], dtype=mx.float32, temperature=s["temperature"])
    log()
    del model
    _to_bfloat16(q_model)
    save(str(dest), str(master), q_model, tok, config)
    return {"steps": n // s["batch_size"], "validation_kl": losses}


def _capture_validation(losses: list):
    """Collect dwq_quantize's 'Validation: it=.., loss=..' lines (it prints them through tqdm.write)."""
    import re

    import tqdm

    original = tqdm.tqdm.write

    def write(msg, *a, **k):
        m = re.search(r"Validation: it=(\d+), loss=([0-9.]+)", str(msg))
        if m:
            losses.append([int(m.group(1)), float(m.group(2))])
        return original(msg, *a, **k)

    tqdm.tqdm.write = write
    return lambda: setattr(tqdm.tqdm, "write", original)


RUNNERS = {"gptq": run_gptq, "awq": run_awq, "dynamic": run_dynamic, "dwq": run_dwq}


def quantize(name: str, master: Path, dest: Path, settings: dict) -> dict:
    """Run one method in this process and record what it did in DEST/mlx_lm_learned.json."""
    import mlx_lm

    t = time.time()
    extra = RUNNERS[name](Path(master), Path(dest), settings)
    record = {"method": f"mlx_lm.{'dynamic_quant' if name == 'dynamic' else name}", "settings": settings,
              "mlx_lm": mlx_lm.__version__, "seconds": round(time.time() - t, 1),
              "blas": os.environ.get("LD_PRELOAD") or "reference (mlx[cpu]'s own)",
              "calibration": "pydoc training split (mfqat.data.sources.calibration_blocks)", **extra}
    (Path(dest) / "mlx_lm_learned.json").write_text(json.dumps(record, indent=2))
    return record


def quantize_in_child(spec: str, master: Path, dest: Path, preload: Optional[str], log: Optional[Path] = None) -> dict:
    """``quantize`` in a fresh process (OpenBLAS preloaded when ``preload``); reuses a finished dest."""
    import shutil

    name, settings = parse_spec(spec)
    dest = Path(dest)
    if (dest / "mlx_lm_learned.json").is_file():
        return json.loads((dest / "mlx_lm_learned.json").read_text())
    shutil.rmtree(dest, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if preload:
        env["LD_PRELOAD"] = preload
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH")]))
    if log:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, __file__, "quantize", name, str(master), str(dest), "--settings", json.dumps(settings)]
    with open(log, "a") if log else open(os.devnull, "w") as fh:
        if log:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
        subprocess.run(cmd, env=env, check=True, stdout=fh if log else None, stderr=subprocess.STDOUT if log else None)
    return json.loads((dest / "mlx_lm_learned.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("probe", help="print this process's MLX GEMM speed and a small matmul (JSON)")
    sub.add_parser("check", help="the BLAS check: reference vs OpenBLAS preloaded")
    q = sub.add_parser("quantize", help="run one method in this process")
    q.add_argument("method", choices=sorted(METHODS))
    q.add_argument("master")
    q.add_argument("dest")
    q.add_argument("--settings", default="", help="JSON settings (default: METHODS[method])")
    a = p.parse_args()
    if a.cmd == "probe":
        print(json.dumps(probe()))
    elif a.cmd == "check":
        print(json.dumps(blas_check(), indent=2))
    else:
        settings = json.loads(a.settings) if a.settings else dict(METHODS[a.method])
        print(json.dumps(quantize(a.method, Path(a.master), Path(a.dest), settings), indent=2))


if __name__ == "__main__":
    main()
