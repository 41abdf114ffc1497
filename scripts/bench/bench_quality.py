#!/usr/bin/env python
"""Quality baselines for the MF-QAT claims, all with the demo's settings (SmolLM2-135M, pydoc text,
same steps, lr, batch, seed and held-out blocks), in one run:

* PTQ of the original model (no training);
* the fair baseline: the same fine-tune in full precision (`--no-qat`), then PTQ;
* single-format QAT, one run per format (`--schedule fixed`), evaluated in its own format;
* MF-QAT (progressive mxint2->4->6->8), one MXINT8 anchor, every MXINT format by Slice-and-Scale;
* the same without the 2-bit phase (mfqat/configs/mxint_468.yaml), and with self-distillation from the
  full-precision master (`--distill 0.5`), and {4,6,8} cycled per step (`--schedule cyclic`);
* MF-QAT over the MXFP family (mfqat/configs/mxfp_468.yaml), MXFP8 anchor, MXFP formats by Slice-and-Scale.

    python scripts/bench/bench_quality.py [--steps 60] [--out out/quality] [--single mxint4,mxfp4_e2m1]

Each run lands in OUT/<name>/ and is reused when its summary.json exists (delete it to redo).
Prints one table and writes OUT/quality.png and OUT/quality.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import mfqat
from mfqat.anchor.checkpoint import read_anchor
from mfqat.formats import canonical_name
from mfqat.data.sources import load_model, load_text, split_text, token_blocks
from mfqat.eval.elastic import anchor_state, evaluate_formats, ptq_state
from mfqat.eval.report import format_table, plot_ppl_vs_bpw
from mfqat.train.loop import main as train_main

MXINT = ["mxint8", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2"]
MXFP = ["mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1"]
ROOT = Path(__file__).resolve().parents[2]


def run(out: Path, name: str, argv: list) -> dict:
    """One training run (reused when OUT/name/summary.json exists)."""
    d = out / name
    if (d / "summary.json").is_file():
        print(f"[quality] {name}: reusing {d / 'summary.json'}")
        return json.loads((d / "summary.json").read_text())
    print(f"[quality] {name}: training")
    return train_main(argv + ["--out", str(d)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-blocks", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out", default="out/quality")
    p.add_argument("--single", default=",".join(MXINT + ["mxfp4_e2m1"]),
                   help="formats that get their own single-format QAT run")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    common = ["--steps", str(a.steps), "--seq-len", str(a.seq_len), "--eval-blocks", str(a.eval_blocks),
              "--lr", "2e-5"]
    singles = [canonical_name(f) for f in a.single.split(",") if f]

    fair = run(out, "fp-finetune", common + ["--no-qat", "--eval-formats", ",".join(MXINT + MXFP)])
    single = {}
    for f in singles:
        s = run(out, f"qat-{f}", common + ["--formats", f, "--schedule", "fixed", "--eval-formats", f])
        single[f] = next(r["perplexity"] for r in s["eval"] if r["format"] == f)
    mf_int = run(out, "mfqat-mxint", common + ["--qat-config", str(ROOT / "mfqat/configs/mxint_2468.yaml")])
    mf_468 = run(out, "mfqat-mxint-468", common + ["--qat-config", str(ROOT / "mfqat/configs/mxint_468.yaml")])
    mf_cyc = run(out, "mfqat-mxint-468-cyclic", common + ["--qat-config", str(ROOT / "mfqat/configs/mxint_468.yaml"),
                                                          "--schedule", "cyclic"])
    mf_kd = run(out, "mfqat-mxint-distill", common + ["--qat-config", str(ROOT / "mfqat/configs/mxint_2468.yaml"),
                                                      "--distill", "0.5"])
    mf_fp = run(out, "mfqat-mxfp", common + ["--qat-config", str(ROOT / "mfqat/configs/mxfp_468.yaml"),
                                             "--anchor-format", "mxfp8_e4m3"])

    model, tok = load_model(None)
    _, held_text = split_text(load_text(None))
    held = token_blocks(tok, held_text, a.seq_len, max_blocks=a.eval_blocks)
    cache = out / "elastic-whole.json"  # elastic.json: anchors scored without their embeddings and norms
    if cache.is_file():
        ev = json.loads(cache.read_text())
    else:
        # OCP's floor rule for every format, as the recorded PTQ numbers were measured
        ptq = {f: ptq_state(model, f, scale_rule="floor") for f in MXINT + MXFP}
        ev = {"ptq": evaluate_formats(model, ptq, held)}
        cache.write_text(json.dumps(ev, indent=2))
    for key, summary, fmts in (("mfqat-mxint", mf_int, MXINT), ("mfqat-mxfp", mf_fp, MXFP),
                               ("mfqat-mxint-468", mf_468, MXINT), ("mfqat-mxint-distill", mf_kd, MXINT),
                               ("mfqat-mxint-468-cyclic", mf_cyc, MXINT)):
        if key not in ev:
            anchor = read_anchor(summary["anchor"])
            ev[key] = evaluate_formats(model, {f: anchor_state(anchor, f) for f in fmts}, held)
            cache.write_text(json.dumps(ev, indent=2))

    by = lambda rows: {r["format"]: r["perplexity"] for r in rows}  # noqa: E731
    ptq, fair_ptq = by(ev["ptq"]), by(fair["eval"])
    mf = {**by(ev["mfqat-mxint"]), **by(ev["mfqat-mxfp"])}
    mf468 = by(ev["mfqat-mxint-468"])
    mfkd = by(ev["mfqat-mxint-distill"])
    mfcyc = by(ev["mfqat-mxint-468-cyclic"])
    rows = []
    for f in MXINT + MXFP:
        s = single.get(f)
        rows.append({"format": f, "bits/weight": mfqat.get_format(f).bits_per_weight(32),
                     "PTQ (original)": ptq[f], "fp fine-tune + PTQ": fair_ptq[f],
                     "single-format QAT": s if s is not None else float("nan"), "MF-QAT (S&S)": mf[f],
                     "MF-QAT {4,6,8}": mf468.get(f, float("nan")),
                     "MF-QAT + distill": mfkd.get(f, float("nan")),
                     "MF-QAT {4,6,8} cyclic": mfcyc.get(f, float("nan")),
                     "MF-QAT vs fair PTQ": f"{100 * (mf[f] / fair_ptq[f] - 1):+.1f}%",
                     "MF-QAT vs single": f"{100 * (mf[f] / s - 1):+.1f}%" if s else "-"})
    cols = list(rows[0])
    print(f"\nfp fine-tune master perplexity: {by(fair['eval']).get('fp (master)'):.3f}; steps={a.steps}")
    print(format_table(rows, cols))
    bpw = lambda f: mfqat.get_format(f).bits_per_weight(32)  # noqa: E731
    shown = [f for f in MXINT if f != "mxint2"]  # mxint2 (ppl 1e4..1e6) would flatten the plot; it is in the table
    plot = plot_ppl_vs_bpw({
        "PTQ (original model)": [(bpw(f), ptq[f], f) for f in shown],
        "fp fine-tune + PTQ": [(bpw(f), fair_ptq[f], f) for f in shown],
        "single-format QAT (one run per format)": [(bpw(f), v, f) for f, v in single.items() if f in shown],
        "MF-QAT 2->4->6->8, anchor + Slice-and-Scale": [(bpw(f), mf[f], f) for f in shown],
        "MF-QAT {4,6,8} cyclic, anchor + Slice-and-Scale": [(bpw(f), mfcyc[f], f) for f in shown],
    }, out / "quality.png", title=f"SmolLM2-135M, MXINT family, {a.steps} steps each",
        fp_ppl=by(fair["eval"]).get("fp (master)"))
    (out / "quality.json").write_text(json.dumps({"rows": rows, "steps": a.steps}, indent=2))
    print(f"plot: {plot}\nsummary: {out / 'quality.json'}")


if __name__ == "__main__":
    main()
