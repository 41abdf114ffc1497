"""The end-to-end demo: fp perplexity -> PTQ -> MF-QAT fine-tune (the default recipe,
mxint_joint_search) -> anchor -> elastic formats by Slice-and-Scale (mxint4/mxint3 also with the
search recalibrated on text, mfqat.anchor.search)
-> Mac exports in MLX's affine layout, against mlx_lm.convert of the same fine-tuned weights at
the same bytes (mfqat.cli.demo_mac). Re-runs reuse finished stages (OUT/stages/*.json) unless --force."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import List, Optional


from mfqat.anchor.checkpoint import read_anchor
from mfqat.data.sources import load_model, load_text, model_label, split_text, token_blocks
from mfqat.eval.elastic import anchor_state, evaluate_formats, ptq_state
from mfqat.eval.perplexity import perplexity
from mfqat.eval.report import format_table, plot_ppl_vs_bpw
from mfqat.formats import get_format
from mfqat.progress import quiet_dependency_logs
from mfqat.cli.demo_args import build_parser

ELASTIC = ["mxint8", "mxint6", "mxint5", "mxint4", "mxint3", "mxint2"]
SEARCHED = ["mxint4", "mxint3"]  # where the scale search matters most (BENCHMARKS.md "Joint MF-QAT")
PROMPT = "The Python language is"


def _stage(out: Path, name: str, force: bool, fn):
    path = out / "stages" / f"{name}.json"
    if path.is_file() and not force:
        print(f"[demo] {name}: reusing {path}")
        return json.loads(path.read_text())
    t = time.perf_counter()
    result = fn()
    result["seconds"] = time.perf_counter() - t
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return result


def run_demo(out: str = "out/demo", steps: int = 40, eval_blocks: int = 24, seq_len: int = 128,
             model_name: Optional[str] = None, force: bool = False, skip_mlx: bool = False) -> dict:
    """Run every stage; print the final table; write OUT/ppl_vs_bpw.png and OUT/summary.json."""
    quiet_dependency_logs()  # see mfqat.progress
    out_dir = Path(out)
    if force and out_dir.exists():
        if any(out_dir.iterdir()) and not (out_dir / "stages").is_dir():
            raise SystemExit(f"mfqat demo --force: {out_dir} is not a demo output (no stages/); refusing to delete it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(model_name)
    _, held_text = split_text(load_text(None))
    held = token_blocks(tok, held_text, seq_len, max_blocks=eval_blocks)
    print(f"[demo] held-out: {held.numel()} tokens; model: {type(model).__name__} "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params")

    fp = _stage(out_dir, "fp", force, lambda: {"perplexity": perplexity(model, held, desc="ppl fp")})
    ptq = _stage(out_dir, "ptq", force, lambda: {"rows": evaluate_formats(
        model, {f: ptq_state(model, f) for f in ELASTIC}, held)})

    def train():
        from mfqat.train.loop import main as train_main
        argv = ["--steps", str(steps), "--seq-len", str(seq_len), "--out", str(out_dir / "train"),
                "--eval-blocks", str(eval_blocks), "--lr", "2e-5", "--save-master",
                "--overwrite"]  # a stage killed earlier left its own run there (never a user's file: the guard)
        if model_name:
            argv += ["--model", model_name]
        s = train_main(argv)
        return {"anchor": s["anchor"], "master": s["master"], "final_loss": s["final_loss"],
                "train_seconds": s["train_seconds"]}
    trained = _stage(out_dir, "train", force, train)
    anchor = read_anchor(trained["anchor"])
    mfqat_rows = _stage(out_dir, "elastic_whole", force, lambda: {"rows": evaluate_formats(
        model, {f: anchor_state(anchor, f) for f in ELASTIC}, held)})

    def searched():
        from mfqat.anchor.search import search_scales
        from mfqat.data.sources import calibration_blocks
        plan = read_anchor(trained["anchor"])  # calibrated on the training split, never the held-out text
        search_scales(plan, calibration_blocks(tok, n_blocks=8, seq_len=seq_len), SEARCHED)
        return {"rows": evaluate_formats(model, {f: anchor_state(plan, f) for f in SEARCHED}, held)}
    search_ppl = {r["format"]: r["perplexity"] for r in _stage(out_dir, "elastic_search_whole", force, searched)["rows"]}

    exports = {}
    if not skip_mlx:
        from mfqat.cli.demo_mac import mac_exports
        master = trained.get("master")
        if master is None:
            print("[demo] this training stage predates --save-master: no mlx_lm.convert rows (rerun with --force)")
        exports = _stage(out_dir, "mac", force, lambda: {"rows": mac_exports(
            Path(trained["anchor"]), master and Path(master), model, held, out_dir, PROMPT)})

    rows = []
    ptq_by = {r["format"]: r["perplexity"] for r in ptq["rows"]}
    for r in mfqat_rows["rows"]:
        f = r["format"]
        rows.append({"format": f, "bits/weight": get_format(f).bits_per_weight(32), "PTQ ppl": ptq_by[f],
                     "MF-QAT ppl": r["perplexity"], "+ scale search": search_ppl.get(f),
                     "MF-QAT vs PTQ": f"{100 * (r['perplexity'] / ptq_by[f] - 1):+.1f}%"})
    series = {
        "PTQ (direct, original model)": [(get_format(f).bits_per_weight(32), p, f) for f, p in ptq_by.items()],
        "MF-QAT anchor + Slice-and-Scale": [(get_format(r["format"]).bits_per_weight(32), r["perplexity"], r["format"])
                                            for r in mfqat_rows["rows"]],
        "MF-QAT anchor + scale search": [(get_format(f).bits_per_weight(32), p, f) for f, p in search_ppl.items()],
    }
    label = model_label(model_name)
    embedded = label != "full precision"
    title = ("SmolLM2-135M-Instruct (Q4_1 GGUF)" if embedded else Path(model_name).name) + " on held-out pydoc text"
    plot = plot_ppl_vs_bpw(series, out_dir / "ppl_vs_bpw.png", title=title, fp_ppl=fp["perplexity"],
                           fp_label="embedded model (Q4_1 GGUF -> float32)" if embedded else label)
    summary = {"fp_perplexity": fp["perplexity"], "fp_model": label, "rows": rows, "exports": exports,
               "plot": str(plot), "steps": steps}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print()
    print(f"{label} perplexity: {fp['perplexity']:.3f}")
    print(format_table(rows, ["format", "bits/weight", "PTQ ppl", "MF-QAT ppl", "+ scale search", "MF-QAT vs PTQ"]))
    if exports:
        from mfqat.cli.demo_mac import print_mac
        print_mac(exports["rows"], PROMPT)
    print(f"\nplot: {plot}\nsummary: {out_dir / 'summary.json'}")
    return summary


def main(argv: Optional[List[str]] = None) -> dict:
    a = build_parser().parse_args(argv)
    return run_demo(a.out, a.steps, a.eval_blocks, model_name=a.model, force=a.force, skip_mlx=a.skip_mlx)


if __name__ == "__main__":
    main()
