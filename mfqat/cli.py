"""The `mfqat` command: train, mx-qlora, convert, eval, export-mlx, verify, demo, bench."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import List, Optional


def _convert(a) -> None:
    from transformers import AutoTokenizer

    from .anchor import load_anchor
    from .io import atomic_directory, write_json
    from .manifest import seal

    model = load_anchor(a.anchor, a.to)
    with atomic_directory(a.out, overwrite=a.overwrite, kind="convert", protect=[a.anchor]) as tmp:
        model.save_pretrained(tmp)
        try:
            AutoTokenizer.from_pretrained(a.anchor).save_pretrained(tmp)
        except Exception:
            print(f"[mfqat] {a.anchor}: no tokenizer saved with the anchor; wrote weights only")
        marker = {"source": str(Path(a.anchor).absolute()), "format": model.mfqat_format}
        write_json(tmp / "mfqat_convert.json", seal(marker, tmp, "mfqat_convert.json"))
    print(f"wrote {a.out} ({a.to or 'anchor format'}, dequantized, from_pretrained-loadable)")


def _verify(a) -> None:
    """Check every file of an anchor, MLX export or converted checkpoint against its manifest."""
    from .anchor import META_FILE, read_anchor
    from .manifest import verify_folder

    path = Path(a.path)
    for meta_name, what in ((META_FILE, "anchor"), ("mfqat_export.json", "MLX export"),
                            ("mfqat_convert.json", "converted checkpoint")):
        if (path / meta_name).is_file():
            if what == "anchor":
                read_anchor(path, verify=True)
            meta = verify_folder(path, meta_name)
            print(f"OK {path}: {what}, {len(meta['manifest']) + 1} files match the manifest")
            return
    raise SystemExit(f"mfqat verify: {path} is not an mfqat anchor, MLX export or converted checkpoint")


def _eval(a) -> None:
    from .anchor import read_anchor
    from .data import load_model, load_text, split_text, token_blocks
    from .eval.elastic import anchor_state, evaluate_formats, ptq_state
    from .eval.perplexity import perplexity
    from .eval.report import format_table, plot_ppl_vs_bpw

    formats = a.formats.split(",")
    is_anchor = (Path(a.model) / "mfqat.json").is_file()
    if is_anchor:
        from .anchor import load_anchor
        from transformers import AutoTokenizer
        model, tok = load_anchor(a.model), AutoTokenizer.from_pretrained(a.model)
    else:
        model, tok = load_model(a.model)
    text = load_text(a.text) if a.text else split_text(load_text(None))[1]
    blocks = token_blocks(tok, text, a.seq_len, max_blocks=a.blocks)
    base_ppl = perplexity(model, blocks, desc="ppl base")
    if is_anchor:
        anchor = read_anchor(a.model)
        rows = evaluate_formats(model, {f: anchor_state(anchor, f) for f in formats}, blocks)
    else:
        rows = evaluate_formats(model, {f: ptq_state(model, f) for f in formats}, blocks)
    for r in rows:
        r["delta vs base"] = f"{100 * (r['perplexity'] / base_ppl - 1):+.2f}%"
    series = {"Slice-and-Scale from anchor" if is_anchor else "PTQ": [(r["bits/weight"], r["perplexity"], r["format"]) for r in rows]}
    if a.compare:
        if not (is_anchor and a.fp_model):
            raise SystemExit("mfqat eval --compare: give an anchor and --fp-model (the full-precision model "
                             "whose direct quantization is compared with Slice-and-Scale)")
        fp_model, _ = load_model(a.fp_model)
        direct = evaluate_formats(fp_model, {f: ptq_state(fp_model, f) for f in formats}, blocks)
        for r, d in zip(rows, direct):
            r["direct ppl"] = d["perplexity"]
        series["direct quantization of fp model"] = [(d["bits/weight"], d["perplexity"], d["format"]) for d in direct]
    print(f"base ({'anchor format' if is_anchor else 'full precision'}) perplexity: {base_ppl:.3f}")
    cols = ["format", "bits/weight", "perplexity", "delta vs base"] + (["direct ppl"] if a.compare else [])
    print(format_table(rows, cols))
    png = plot_ppl_vs_bpw(series, Path(a.plot), fp_ppl=base_ppl)
    print(f"plot: {png}")


def _export(a) -> None:
    from .data import load_text
    from .export import to_mlx

    calib = load_text(a.calib_text) if a.calib_text else None
    rep = to_mlx(a.anchor, a.out, recipe=a.recipe, base_bits=a.base_bits, verify=not a.no_verify, calib_text=calib,
                 awq=a.awq, scale_dtype=a.scale_dtype, overwrite=a.overwrite, group_size=a.group_size)
    v = rep.get("verify", {})
    print(f"wrote {a.out}: recipe {a.recipe}, nominal {rep['bits_per_weight']:.3f} bits/weight, stored "
          f"{rep['stored_bits_per_weight']:.3f} bits/weight on disk ({rep['stored_bits_per_weight_quantized']:.3f} "
          f"for the quantized matrices, {rep['scale_dtype']} scales), "
          f"{rep['seconds']:.1f}s; weights bit-exact: {v.get('weights_bit_exact')}, "
          f"max |logit diff| {v.get('max_abs_logit_diff')}")


def _mlx() -> None:
    """Exit with a clear message when MLX / mlx-lm are not installed."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        sys.exit(f"mfqat: this command runs on MLX, which is not installed ({exc}). "
                 "Install it with: pip install 'mfqat[mlx]' (mlx[cpu] on Linux, mlx on macOS)")


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of the `mfqat` console script."""
    p = argparse.ArgumentParser(prog="mfqat", description="Multi-format QAT, anchors, Slice-and-Scale, MLX export")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="MF-QAT fine-tune (arguments of scripts/train.py)", add_help=False)
    c = sub.add_parser("convert", help="anchor -> plain HF checkpoint in a chosen format")
    c.add_argument("anchor")
    c.add_argument("--to", default=None)
    c.add_argument("--out", required=True)
    c.add_argument("--overwrite", action="store_true", help="replace an earlier convert output at --out")
    e = sub.add_parser("eval", help="perplexity table + PNG over formats")
    e.add_argument("model", help="anchor directory, HF folder, .gguf, or 'smollm2'")
    e.add_argument("--formats", default="mxint8,mxint6,mxint5,mxint4,mxint3,mxint2")
    e.add_argument("--text", default=None, help="default: held-out pydoc text")
    e.add_argument("--blocks", type=int, default=16)
    e.add_argument("--seq-len", type=int, default=128)
    e.add_argument("--compare", action="store_true", help="add direct quantization of --fp-model")
    e.add_argument("--fp-model", default=None, help="full-precision model for --compare")
    e.add_argument("--plot", default="ppl_vs_bpw.png")
    x = sub.add_parser("export-mlx", help="anchor (or HF model) -> MLX model directory")
    x.add_argument("anchor")
    x.add_argument("--out", required=True)
    x.add_argument("--recipe", default="uniform:mxint4",
                   help="uniform:FMT | seed[:FAMILY] | auto:BPW[:FAMILY] (e.g. auto:4.5, uniform:affine4, seed:affine)")
    x.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                   help="group of the affine formats derived from the anchor (uniform:affineK, seed:affine); "
                        "MX formats keep the anchor's block size")
    x.add_argument("--calib-text", default=None, help="auto/AWQ: calibration text file or folder (default: pydoc)")
    x.add_argument("--awq", action="store_true", help="AWQ pre-scaling (full-precision model input only)")
    x.add_argument("--scale-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="MLX affine scales/biases; auto: as mlx_lm.convert writes for the model (bfloat16 for a "
                        "bf16 model, float32 for a float32 one); all exact for MX power-of-two scales")
    x.add_argument("--base-bits", type=int, default=4)
    x.add_argument("--no-verify", action="store_true")
    x.add_argument("--overwrite", action="store_true", help="replace an earlier MLX export at --out")
    y = sub.add_parser("verify", help="check an anchor / MLX export / convert output against its manifest")
    y.add_argument("path")
    d = sub.add_parser("demo", help="the end-to-end demo on the embedded SmolLM2-135M")
    from .demo import build_parser as demo_parser
    demo_parser(d)
    sub.add_parser("bench", help="run scripts/bench_quant.py", add_help=False)
    sub.add_parser("mlx-train", help="MF-QAT or LoRA fine-tune on MLX (mfqat mlx-train --help)", add_help=False)
    sub.add_parser("mx-qlora", help="one LoRA adapter on a frozen MX anchor, for all its formats "
                   "(mfqat mx-qlora --help)", add_help=False)
    g = sub.add_parser("generate", help="complete a prompt with an MLX model directory (mlx-lm)")
    g.add_argument("model")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--adapter-path", default=None)
    v = sub.add_parser("serve", help="OpenAI-style HTTP server over an MLX model directory (mlx-lm)")
    v.add_argument("model")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8080)
    v.add_argument("--allow-origin", default=None, metavar="ORIGIN",
                   help="answer CORS requests from this origin (default: CORS off)")
    args, rest = p.parse_known_args(argv)
    from .progress import quiet_dependency_logs
    quiet_dependency_logs()  # transformers imports torchao, whose CUDA-only kernels complain on CPU
    if args.cmd == "train":
        from .integrations.train_loop import main as train_main
        train_main(rest)
    elif args.cmd == "mx-qlora":
        from .mxqlora_train import main as mx_qlora_main
        mx_qlora_main(rest)
    elif args.cmd == "mlx-train":
        _mlx()
        from .mlx.train import main as mlx_train_main
        mlx_train_main(rest)
    elif args.cmd == "bench":
        script = Path(__file__).resolve().parents[1] / "scripts" / "bench_quant.py"
        if not script.is_file():
            sys.exit(f"mfqat bench: {script} is missing: the benchmark scripts live in the source repository, "
                     "not in the installed package; clone the repository and run `python scripts/bench_quant.py`")
        sys.exit(subprocess.call([sys.executable, str(script), *rest]))
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    elif args.cmd in ("convert", "export-mlx", "verify"):
        from .guard import UnsafeOutputError, WriterBusyError
        from .manifest import AnchorError

        try:
            {"convert": _convert, "export-mlx": _export, "verify": _verify}[args.cmd](args)
        except (FileExistsError, AnchorError, WriterBusyError, UnsafeOutputError) as e:
            sys.exit(f"mfqat {args.cmd}: {e}")
    elif args.cmd == "eval":
        _eval(args)
    elif args.cmd == "generate":
        _mlx()
        from .mlx.serve import generate
        print(generate(args.model, args.prompt, args.max_tokens, args.adapter_path))
    elif args.cmd == "serve":
        _mlx()
        from .mlx.serve import check_model_dir, serve
        try:
            check_model_dir(args.model)
        except ValueError as exc:
            v.error(str(exc))  # exit status 2, before anything starts
        serve(args.model, args.host, args.port, args.allow_origin)
    elif args.cmd == "demo":
        from .demo import run_demo
        run_demo(args.out, args.steps, args.eval_blocks, model_name=args.model, force=args.force, skip_mlx=args.skip_mlx)


if __name__ == "__main__":
    main()
