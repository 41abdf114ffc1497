#!/usr/bin/env python
"""mfqat's MLX exports against every mlx_lm option at equal stored bytes, on the same fine-tuned weights.

Each --run is a `mfqat train --save-master` output (anchor/ + master/, e.g. from scripts/bench/bench_joint.py).
For every run: `mlx_lm.convert` of its full-precision master (bfloat16, as a Mac user converts) at
q2/q3/q4/q5/q6/q8 x group 32/64, `--q-mode mxfp4` / `mxfp8`, and the mixed_3_4 / mixed_3_6 / mixed_4_6
recipes; and mfqat's exports of its anchor (the recipes given per run). Perplexity in MLX on held-out
text no run trains on (pydoc held-out split and numpy's licence), stored bits/weight = 8 x bytes of the
safetensors files / parameter count, generation tokens/s of the --speed points. MLX's CPU backend is
slow (bfloat16 quantized matmuls ~100x more), so perplexity runs the exactly dequantized MLX weights in
PyTorch (float32 activations) and tokens/s the quantized model with float32 scales, alike for every method. One table, one plot
(perplexity vs stored bits/weight, every method a line), and the Pareto verdict: for each mlx_lm
point, the best mfqat point of the same run at equal or fewer bytes.

--mlx-lm-methods adds mlx-lm's learned quantizers on the same master (gptq, awq, dwq, dynamic; each
``NAME[:setting=value...]``, settings in scripts/bench/mlx_lm_learned.py's METHODS and recorded in every
row): run offline through their own functions on the pydoc *training* split, in a child process
with Debian's OpenBLAS preloaded after a BLAS check (AWQ and DWQ refuse MLX's reference BLAS unless
--allow-slow); their rows are the exact weights of the folder mlx-lm saved, scored like every other.

    python scripts/bench/bench_pareto.py --run out/joint/joint-affine:uniform:affine8,uniform:affine6,uniform:affine4,uniform:affine3
    python scripts/bench/bench_pareto.py --mlx-lm "q4 g64" --mlx-lm-methods gptq,dynamic --run out/joint-affine:uniform:affine4
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import torch

from mfqat.data.sources import heldout_blocks, load_model
from mfqat.eval.report import format_table, plot_ppl_vs_bpw
from mfqat.export import to_mlx
from mfqat.eval.mlx_weights import mlx_folder_perplexity, mlx_lm_convert as convert_with_mlx_lm, stored_bits as stored_bpw

import mlx_lm_learned  # scripts/bench/ (this script's folder) is on sys.path

MLX_LM_OPTIONS = ([(f"q{b} g{g}", dict(q_bits=b, q_group_size=g)) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64)]
                  + [("mxfp4", dict(q_mode="mxfp4", q_bits=4, q_group_size=32)),
                     ("mxfp8", dict(q_mode="mxfp8", q_bits=8, q_group_size=32)),
                     ("nvfp4", dict(q_mode="nvfp4", q_bits=4, q_group_size=16))]
                  + [(r, dict(quant_predicate=r)) for r in ("mixed_3_4", "mixed_3_6", "mixed_4_6")])
PROMPT = "The Python language is"
SAME_SIZE = 1e-3  # bits/weight (17 KB on 135M weights): the same tensors, safetensors headers differ


def as_float32(model) -> None:
    """bfloat16 parameters (scales, biases, norms) -> float32 in place: MLX's CPU backend runs bfloat16
    quantized matmuls ~100x slower than float32 (a Mac's GPU does not)."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))


def tokens_per_second(folder: Path) -> float:
    """Generation speed of the quantized model (float32 scales on CPU, the same for every method)."""
    from mlx_lm import load, stream_generate

    model, tok = load(str(folder))
    as_float32(model)
    last = None
    for last in stream_generate(model, tok, PROMPT, max_tokens=48):
        pass
    return float(last.generation_tps)


def evaluate(folder: Path, model, held: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Perplexity of the exact MLX weights, run in PyTorch (mfqat.eval.mlx_weights says why)."""
    return mlx_folder_perplexity(folder, model, held)


def mlx_lm_convert(master: Path, dest: Path, opts: dict) -> None:
    convert_with_mlx_lm(master, dest, **opts)


def measure_each_probe_once(store: Path) -> None:
    """auto:BPW recipes of one anchor that share a probe format and calibration tokens share its sensitivity
    pass (the pass does not depend on the budget): measured once, kept in ``store`` (a folder) for later
    runs of this script (the key holds the anchor's path and its manifest's mtime, the probe, levels, group,
    tensors and the calibration tokens)."""
    import hashlib
    import pickle

    import mfqat.export.sensitivity as sensitivity

    measure = sensitivity.measure
    store.mkdir(parents=True, exist_ok=True)

    def once(anchor, names, probe, blocks, levels=None, derived_group=64):
        key = repr((str(Path(anchor.path).resolve()), (Path(anchor.path) / "mfqat.json").stat().st_mtime_ns, probe,
                    tuple(levels or ()), derived_group, tuple(names), blocks.flatten().tolist()))
        path = store / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.pkl"
        if path.is_file():
            print(f"[pareto] sensitivity pass (probe {probe}) reused from {path}")
            return pickle.loads(path.read_bytes())
        sens = measure(anchor, names, probe, blocks, levels, derived_group)
        path.write_bytes(pickle.dumps(sens))
        return sens

    sensitivity.measure = once


def mfqat_export(anchor: Path, dest: Path, recipe: str, calib: str = "") -> None:
    """``RECIPE[@gN[/M...]][+sensN][+gptq][+refineSTEPS]``: @gN sets the group of derived affine formats (default 64);
    @g64/128 gives an ``auto:BPW:affine`` plan levels in groups of 128 too (``export-mlx --group-size 64,128``);
    +sensN scores ``auto:``'s sensitivity pass on N calibration blocks (``--sensitivity-blocks``, default 4);
    +gptq gives their matrices GPTQ's error-compensated codes (``export-mlx --gptq``; +gptq/bBLOCKS/dDAMP/s/g sets
    GPTQConfig.n_blocks, .damp, .sequential (``/s``: on the quantized model's inputs) and .grid_search (``/g``);
    +refineSTEPS learns their scales and biases for STEPS steps (``export-mlx --refine``, default 64);
    +refineSTEPS/bBLOCKS/tTEMP/lLR on BLOCKS calibration blocks (RefineConfig.n_blocks, default 32), at KL
    temperature TEMP (default 1) and learning rate LR (default 1e-3), each optional.
    ``calib``: export-mlx's --calib-text spec for the sensitivity pass and the refine (default: pydoc)."""
    from mfqat.data.mix import mixed_text
    from mfqat.export.gptq import GPTQConfig
    from mfqat.export.mlx_export import calibration_blocks_needed
    from mfqat.export.sensitivity import SENSITIVITY_BLOCKS

    recipe, refined, steps = recipe.partition("+refine")
    recipe, gptq, gptq_opts = recipe.partition("+gptq")
    flag = lambda v: v in ("", "1")  # noqa: E731
    gptq_kw = {{"b": "n_blocks", "d": "damp", "s": "sequential", "g": "grid_search"}[o[0]]:
               {"b": int, "d": float, "s": flag, "g": flag}[o[0]](o[1:]) for o in gptq_opts.split("/") if o}
    recipe, sens, sens_blocks = recipe.partition("+sens")
    sens_blocks = int(sens_blocks) if sens else SENSITIVITY_BLOCKS
    recipe, _, group = recipe.partition("@g")
    refine = None
    if refined:
        from mfqat.export.refine import RefineConfig
        steps, *opts = steps.split("/")
        names = {"b": "n_blocks", "t": "temperature", "l": "lr"}  # lr: the affine / nvfp4 scales (not MX exponents)
        bad = [o for o in opts if o and o[0] not in names]
        if bad:
            raise ValueError(f"{recipe}+refine{steps}: unknown refine option {bad[0]!r}; use /bBLOCKS, /tTEMP or /lLR")
        kw = {names[o[0]]: (int if o[0] == "b" else float)(o[1:]) for o in opts if o}
        refine = RefineConfig(steps=int(steps or 64), **kw)
    gptq_cfg = GPTQConfig(**gptq_kw) if gptq else None
    if not (dest / "mfqat_export.json").is_file():
        groups = tuple(int(g) for g in (group or "64").split("/"))
        to_mlx(anchor, dest, recipe=recipe, scale_dtype="bfloat16", overwrite=True,
               group_size=groups[0] if len(groups) == 1 else groups,
               refine=refine, gptq=gptq_cfg,
               calib_text=mixed_text(calib, model=str(anchor),
                                     n_blocks=calibration_blocks_needed(refine, gptq_cfg, sens_blocks))
               if calib else None, sensitivity_blocks=sens_blocks)


def measure_run(run: Path, recipes: List[str], out: Path, model, held, n_params: int, cache: dict, save,
                options: List[str], speed: List[str] = (), methods: List[str] = (), preload=None,
                calib: str = "") -> List[dict]:
    """Rows for one run: every mlx_lm option on its master, every mfqat recipe on its anchor, every
    mlx-lm learned method (``methods``) on its master."""
    rows = []
    jobs = [("mlx_lm", name, lambda d, o=opts: mlx_lm_convert(run / "master", d, o))
            for name, opts in MLX_LM_OPTIONS if not options or name in options]
    learned = {}

    def learn(dest: Path, spec: str) -> None:
        learned[spec] = mlx_lm_learned.quantize_in_child(spec, run / "master", dest, preload,
                                                         log=out / run.name / "mlx_lm_learned.log")
    jobs += [("mlx_lm", spec, lambda d, m=spec: learn(d, m)) for spec in methods]
    tag = f"~calib={calib}" if calib else ""  # in the row's name and cache key: another text, another export
    jobs += [("mfqat", r + tag, lambda d, r=r: mfqat_export(run / "anchor", d, r, calib)) for r in recipes]
    for method, name, make in jobs:
        key = f"{run.name}|{method}|{name}"
        timed = name not in speed or "tokens/s" in cache.get(key, {})
        if key not in cache or not timed:
            dest = out / run.name / f"{method}-{re.sub(r'[^A-Za-z0-9.+=-]', '_', name)}"
            print(f"[pareto] {key}")
            try:
                make(dest)
            except subprocess.CalledProcessError as e:  # one mlx-lm method failing (e.g. GPTQ at 3 bits) is a row lost, not the run
                print(f"[pareto] {key} FAILED ({e}); see {out / run.name / 'mlx_lm_learned.log'}")
                continue
            row = cache.get(key) or {"run": run.name, "method": method, "option": name,
                                     "stored bits/w": stored_bpw(dest, n_params), **evaluate(dest, model, held)}
            if name in learned:  # what mlx-lm ran: settings, seconds, BLAS, DWQ's validation KL
                row["learned"] = {k: v for k, v in learned[name].items() if k not in ("calibration",)}
            if method == "mfqat":  # the plan: how many weights each format holds
                report = json.loads((dest / "mfqat_export.json").read_text())
                shutil.copy(dest / "mfqat_export.json", dest.with_name(dest.name + ".mfqat_export.json"))  # per tensor
                tensors = report["tensors"]
                if "refine" in report:  # what --refine did: KL to the anchor before / after, steps, seconds
                    row["refine"] = report["refine"]
                row["plan"] = {f: sum(1 for t in tensors.values() if t.get("source") == f)
                               for f in sorted({t.get("source") for t in tensors.values()})}
            if name in speed:
                row["tokens/s"] = tokens_per_second(dest)
            cache[key] = row
            save()
            shutil.rmtree(dest)  # keep the disk small: the numbers are cached
        rows.append(cache[key])
    return rows


def verdict(rows: List[dict], text: str) -> List[dict]:
    """For each mlx_lm point: the best mfqat point of the same run with <= its stored bytes."""
    out = []
    for r in [r for r in rows if r["method"] == "mlx_lm"]:
        ours = [o for o in rows if o["method"] == "mfqat" and o["run"] == r["run"]
                and o["stored bits/w"] <= r["stored bits/w"] + SAME_SIZE]
        best = min(ours, key=lambda o: o[text]) if ours else None
        out.append({"run": r["run"], "mlx_lm": r["option"], "bits/w": round(r["stored bits/w"], 3), "mlx_lm ppl": r[text],
                    "best mfqat (<= bytes)": best["option"] if best else "-", "mfqat ppl": best[text] if best else None,
                    "win": (best[text] <= r[text]) if best else False})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True,
                   help="RUN_DIR:RECIPE,RECIPE,... (repeatable); RECIPE@g32 exports derived affine formats in groups of 32")
    p.add_argument("--blocks", type=int, default=8, help="held-out blocks of --seq-len tokens per text")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out", default="out/pareto")
    p.add_argument("--speed", default="", help="comma list of options / recipes to time generation for")
    p.add_argument("--mlx-lm", default="", help="comma list of mlx_lm options to run (default: all), e.g. 'q4 g64,mxfp4'")
    p.add_argument("--mlx-lm-methods", default="",
                   help="comma list of mlx-lm learned quantizers to add: gptq, awq, dwq, dynamic, each "
                        "NAME[:setting=value...] (scripts/bench/mlx_lm_learned.py METHODS), e.g. 'gptq,dynamic:target_bpw=5.0'")
    p.add_argument("--calib-text", default="",
                   help="export-mlx --calib-text for every mfqat export of this call (the auto: sensitivity pass and "
                        "the refine), e.g. 'pydoc:1,generated:1'; the rows are named RECIPE~calib=SPEC (default: pydoc)")
    p.add_argument("--allow-slow", action="store_true",
                   help="run awq/dwq on MLX's reference BLAS when OpenBLAS is missing (hours)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    methods = [m for m in a.mlx_lm_methods.split(",") if m]
    preload = None
    if methods:
        names = [mlx_lm_learned.parse_spec(m)[0] for m in methods]
        check = mlx_lm_learned.blas_check()
        print(f"[pareto] BLAS check: {json.dumps(check)}")
        mlx_lm_learned.require_fast_blas(names, check, a.allow_slow)
        preload = check["preload"]
    measure_each_probe_once(out / "sensitivity")
    model, tok = load_model(None)
    n_params = sum(t.numel() for t in model.parameters())
    held = heldout_blocks(tok, a.seq_len, max_blocks=a.blocks)
    cache_path = out / "pareto.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    save = lambda: cache_path.write_text(json.dumps(cache, indent=2))  # noqa: E731
    rows = []
    for spec in a.run:
        run, _, recipes = spec.partition(":")
        rows += measure_run(Path(run), [r for r in recipes.split(",") if r], out, model, held, n_params, cache, save,
                            [o for o in a.mlx_lm.split(",") if o], [o for o in a.speed.split(",") if o], methods, preload, a.calib_text)
    rows.sort(key=lambda r: (r["run"], r["stored bits/w"]))
    cols = ["run", "method", "option", "stored bits/w", "pydoc", "licence", "tokens/s"]
    print(format_table([{c: r.get(c, "") for c in cols} for r in rows], cols))
    for r in [r for r in rows if "learned" in r]:
        print(f"{r['run']} {r['option']}: {json.dumps(r['learned'])}")
    for text in ("pydoc", "licence"):
        v = verdict(rows, text)
        print(f"\nPareto verdict, {text}: mfqat wins {sum(x['win'] for x in v)}/{len(v)} mlx_lm points")
        print(format_table(v, list(v[0])))
    for run in sorted({r["run"] for r in rows}):
        series: Dict[str, list] = {}
        for r in [r for r in rows if r["run"] == run and r["pydoc"] < 100]:  # q2 points off the chart
            series.setdefault(line_of(r), []).append((r["stored bits/w"], r["pydoc"], r["option"]))
        plot = plot_ppl_vs_bpw(series, out / f"pareto-{run}.png",
                               title=f"{run}: MLX perplexity (held-out pydoc) vs stored bits/weight")
        print(f"plot: {plot}")


def line_of(row: dict) -> str:
    """The plot line a point belongs to: one per mlx_lm kind, one per mfqat anchor family."""
    opt = row["option"]
    if row["method"] == "mlx_lm" and opt.split(":")[0] in mlx_lm_learned.METHODS:
        return "mlx_lm " + opt.split(":")[0]
    if row["method"] == "mlx_lm":
        return "mlx_lm " + ("mixed" if "mixed" in opt else "mxfp" if "mxfp" in opt else "nvfp4" if opt == "nvfp4"
                            else "affine " + opt.split()[-1])
    if "+refine" in opt:
        return "mfqat refined (" + ("auto" if opt.startswith("auto") else "uniform") + ")"
    return "mfqat " + ("seed/auto" if not opt.startswith("uniform") else re.sub(r"\d.*$", "", opt.split(":")[1]))


if __name__ == "__main__":
    main()
