#!/usr/bin/env python
"""Joint MF-QAT against dedicated single-format QAT, on the same weights, data and steps.

Every run uses the demo's settings (SmolLM2-135M, pydoc text, batch 4x128, lr 2e-5, AdamW, grad
clip 1.0, seed 0). Baseline: one *dedicated* QAT run per format (``--schedule fixed``), evaluated
in its own format by direct quantization of its master weights with the rule it trained with (its
best case; mxfp4 trains and is read with ceil, its default). Candidates: one joint MF-QAT model per recipe, saved as ONE anchor and evaluated at every format by
Slice-and-Scale (what is deployed). Two comparisons: equal optimizer steps, and equal compute
(the joint model at steps / K, K = formats per step, so it does as many forward+backward passes
as one dedicated run). Perplexity on two held-out texts: the pydoc split no run trains on, and
numpy's licence file (a different domain, so in-domain fine-tuning cannot hide a gap).

    python scripts/bench/bench_joint.py [--steps 60] [--family mxint|mxfp] [--lr 2e-5] [--out out/joint]
                                  [--seed 0] [--dedicated mxint6] [--diagnose]

``--dedicated`` trains dedicated models for some evaluated formats only; ``--diagnose`` also scores each
master unquantized and each joint master quantized directly to every format (not sliced from the
anchor), which separates a gap of the weights from a gap of the anchor's slicing.

Runs land in OUT/<name>/ and are reused when their summary.json exists. Prints one table (and the
gap of each joint model to the dedicated model per format), writes OUT/joint.json and OUT/joint.png.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Dict, List, Tuple

import torch

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.sources import heldout_blocks, load_model
from mfqat.eval.elastic import anchor_state, evaluate_formats, ptq_state
from mfqat.eval.report import format_table, plot_ppl_vs_bpw
from mfqat.quant.scale_rules import DEFAULT_SCALE_RULE
from bench_quality import run  # one training run, reused when OUT/name/summary.json exists

FAMILIES = {
    "mxint": {"train": ["mxint8", "mxint6", "mxint4"], "eval": ["mxint8", "mxint6", "mxint5", "mxint4", "mxint3"]},
    "mxfp": {"train": ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"], "eval": ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"]},
}


def recipes(fam: str, steps: int) -> Dict[str, List[str]]:
    """name -> extra train arguments of each joint MF-QAT candidate."""
    fmts = ",".join(FAMILIES[fam]["train"])
    low = FAMILIES[fam]["train"][-1]
    k = len(FAMILIES[fam]["train"])
    base = ["--formats", fmts, "--schedule", "joint"]
    out = {
        f"joint-{fam}": base + ["--steps", str(steps)],
        f"joint-{fam}-equal-compute": base + ["--steps", str(max(steps // k, 1))],
        f"joint-{fam}-low2x": base + ["--steps", str(steps), "--loss-weights", f"{low}=2"],
        f"joint-{fam}-distill": base + ["--steps", str(steps), "--distill-weight", "0.5"],
        f"joint-{fam}-low2x-distill": base + ["--steps", str(steps), "--loss-weights", f"{low}=2",
                                             "--distill-weight", "0.5"],
        # two passes a step: the anchor format and the lowest; the middle one is only sliced
        f"joint-{fam}-ends-distill": ["--formats", f"{FAMILIES[fam]['train'][0]},{low}", "--schedule", "joint",
                                      "--steps", str(steps), "--distill-weight", "0.5"],
        # every evaluated format, 3 passes a step: the highest, the lowest and one sampled between
        f"joint-{fam}-wide-sandwich": ["--formats", ",".join(FAMILIES[fam]["eval"]), "--schedule", "joint",
                                       "--joint-sample", "1", "--steps", str(steps)],
    }
    if fam == "mxint":  # the output-aware scale search inside training (mfqat/configs/mxint_joint_search.yaml)
        out[f"joint-{fam}-search"] = ["--qat-config", "mxint_joint_search", "--steps", str(steps)]
        out[f"joint-{fam}-search-equal-compute"] = ["--qat-config", "mxint_joint_search",
                                                    "--steps", str(max(steps // k, 1))]
        out[f"joint-{fam}-search-low2x-distill"] = ["--qat-config", "mxint_joint_search", "--steps", str(steps),
                                                    "--loss-weights", f"{low}=2", "--distill-weight", "0.5"]
        out[f"joint-{fam}-search-distill"] = ["--qat-config", "mxint_joint_search", "--steps", str(steps),
                                              "--distill-weight", "0.5"]
        # Matryoshka's (2, 2, 1): the 8- and 6-bit losses weigh twice the 4-bit one
        out[f"joint-{fam}-search-hi2x"] = ["--qat-config", "mxint_joint_search", "--steps", str(steps),
                                           "--loss-weights", "mxint8=2,mxint6=2"]
        # no 4-bit term: what serving mxint4 from the same weights costs at 8/6 bits
        out[f"joint-{fam}-search-86"] = ["--qat-config", "mxint_joint_search", "--steps", str(steps),
                                         "--formats", "mxint8,mxint6"]
    if fam == "mxfp":  # the same search for the float family (mfqat/configs/mxfp_joint_search.yaml)
        out[f"joint-{fam}-search"] = ["--qat-config", "mxfp_joint_search", "--steps", str(steps)]
        out[f"joint-{fam}-search-nodistill"] = ["--qat-config", "mxfp_joint_search", "--steps", str(steps),
                                                "--distill-weight", "0"]
    if fam == "mxint":  # the 2-bit slice trained too (Matryoshka's int8/int4/int2)
        out[f"joint-{fam}-842-distill"] = ["--formats", "mxint8,mxint4,mxint2", "--schedule", "joint",
                                           "--steps", str(steps), "--distill-weight", "0.5"]
    return out


def dedicated_runs(fmt: str, steps: int) -> Dict[str, Tuple[List[str], str]]:
    """name -> (train arguments, the scale rule it trains with) of the dedicated single-format run."""
    return {f"dedicated-{fmt}": (["--steps", str(steps), "--formats", fmt, "--schedule", "fixed"],
                                 DEFAULT_SCALE_RULE.get(fmt, "floor"))}


def evaluate(model, held: Dict[str, torch.Tensor], states: Dict[str, dict]) -> Dict[str, Dict[str, float]]:
    """{text: {format: perplexity}} for each state dict."""
    return {t: {r["format"]: r["perplexity"] for r in evaluate_formats(model, states, blocks)}
            for t, blocks in held.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--family", default="mxint", choices=sorted(FAMILIES))
    p.add_argument("--eval-blocks", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", default="0", help="training seed of every run (the order of the batches)")
    p.add_argument("--lr", default="2e-5", help="learning rate of every run, dedicated and joint")
    p.add_argument("--eval-formats", default="", help="comma list replacing the family's evaluated formats")
    p.add_argument("--only", default="", help="comma list of joint recipe names to run (default: all)")
    p.add_argument("--dedicated", default="",
                   help="comma list of the formats that get a dedicated run (default: every evaluated format)")
    p.add_argument("--diagnose", action="store_true",
                   help="also score each joint run's master unquantized ('fp') and directly quantized to each "
                        "format ('direct'), and each dedicated master unquantized: where a gap comes from")
    p.add_argument("--out", default="out/joint")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    fam = dict(FAMILIES[a.family])
    if a.eval_formats:
        fam["eval"] = a.eval_formats.split(",")
    common = ["--seq-len", str(a.seq_len), "--eval-blocks", "2", "--lr", a.lr, "--seed", a.seed, "--save-master"]
    model, tok = load_model(None)
    held = heldout_blocks(tok, a.seq_len, max_blocks=a.eval_blocks)
    cache_path = out / f"eval-{a.family}.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}

    def cached(name: str, fn):
        if name not in cache:
            cache[name] = fn()
            cache_path.write_text(json.dumps(cache, indent=2))
        return cache[name]

    dedicated: Dict[str, Dict[str, float]] = {t: {} for t in held}
    diag: Dict[str, Dict[str, Dict[str, float]]] = {}
    for f in (a.dedicated.split(",") if a.dedicated else fam["eval"]):
        for name, (extra, rule) in dedicated_runs(f, a.steps).items():
            s = run(out, name, common + extra)

            def evaluate_dedicated():  # its master, read with the rule it trained with
                master, _ = load_model(s["master"])
                return evaluate(master, held, {f: ptq_state(master, f, scale_rule=rule)})
            res = cached(name if rule == "floor" else f"{name}@{rule}", evaluate_dedicated)
            for t in held:
                dedicated[t][f] = res[t][f]
            if a.diagnose:
                diag[name] = cached(f"{name}@fp", lambda: evaluate(load_model(s["master"])[0], held, {"fp": {}}))
    joint: Dict[str, Dict[str, Dict[str, float]]] = {}
    only = [x for x in a.only.split(",") if x]
    for name, extra in recipes(a.family, a.steps).items():
        if only and name not in only:
            continue
        s = run(out, name, common + extra)
        anchor = read_anchor(s["anchor"])
        key = f"{name}@whole-anchor"  # before session 13 the anchor's embeddings and norms were left out
        if key in cache and any(f not in cache[key]["pydoc"] for f in fam["eval"]):
            del cache[key]  # evaluated before at other formats
        joint[name] = cached(key, lambda: evaluate(model, held, {f: anchor_state(anchor, f) for f in fam["eval"]}))
        if a.diagnose:
            def direct():  # the joint master itself: unquantized, and quantized directly (no anchor, no slicing)
                master, _ = load_model(s["master"])
                return evaluate(master, held, {"fp": {}, **{f: ptq_state(master, f, scale_rule=DEFAULT_SCALE_RULE.get(
                    f, "floor")) for f in fam["eval"]}})
            diag[name] = cached(f"{name}@direct", direct)
    report(out, a, fam["eval"], dedicated, joint)
    if diag:
        rows = [{"run": n, "text": t, **{f: f"{v:.3f}" for f, v in r[t].items()}} for n, r in diag.items() for t in held]
        print("\nmasters: unquantized (fp) and, for joint runs, quantized directly to each format (not sliced)")
        print(format_table(rows, sorted({k for r in rows for k in r}, key=lambda k: (k not in ("run", "text"), k))))
        (out / f"joint-{a.family}-diagnose.json").write_text(json.dumps(diag, indent=2))


def report(out: Path, a, formats: List[str], dedicated, joint) -> None:
    """Print the table and the gaps, write joint.json and the plot."""
    rows = []
    for t in dedicated:
        for f in formats:
            row = {"text": t, "format": f, "dedicated QAT": dedicated[t].get(f, float("nan"))}
            for name, res in joint.items():
                gap = f" ({100 * (res[t][f] / dedicated[t][f] - 1):+.1f}%)" if f in dedicated[t] else ""
                row[name] = f"{res[t][f]:.3f}{gap}"
            rows.append(row)
    print(f"\n{a.family}, {a.steps} steps; joint columns: perplexity (gap to the dedicated model)")
    print(format_table(rows, list(rows[0])))
    bpw = lambda f: mfqat.get_format(f).bits_per_weight(32)  # noqa: E731
    series = {"dedicated QAT (one model per format)": [(bpw(f), dedicated["pydoc"][f], f) for f in formats
                                                       if f in dedicated["pydoc"]]}
    series.update({f"{n} (one anchor)": [(bpw(f), r["pydoc"][f], f) for f in formats] for n, r in joint.items()})
    plot = plot_ppl_vs_bpw(series, out / f"joint-{a.family}.png",
                           title=f"SmolLM2-135M, {a.family}, {a.steps} steps, held-out pydoc")
    (out / f"joint-{a.family}.json").write_text(json.dumps({"steps": a.steps, "dedicated": dedicated,
                                                            "joint": joint}, indent=2))
    print(f"plot: {plot}")


if __name__ == "__main__":
    main()
