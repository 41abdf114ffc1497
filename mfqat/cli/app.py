"""The `mfqat` command: train, mx-qlora, convert, eval, export-mlx, verify, demo, bench, mlx-train, generate, serve.

Parsing imports nothing heavy (``--help`` and ``--version`` never load torch). User mistakes
(missing paths, unknown formats, bad flag combinations, unreadable anchors) end in one line,
``mfqat <cmd>: error: ...``, with exit status 2; ``MFQAT_DEBUG=1`` shows the traceback instead.
HF Trainer / mlx-lm spellings are accepted as aliases (``--output-dir``/``--save-path`` for
``--out``, ``--max-steps``/``--iters`` for ``--steps``, ``--learning-rate`` for ``--lr``,
``--model`` for the positional model).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, NoReturn, Optional

from mfqat._build import __version__
from mfqat.cli.checks import UsageError, check

OUT_FLAGS = ("--out", "--output-dir", "--save-path")


class CommandError(SystemExit):
    """Exit status 2 after a one-line message (``str()`` gives the message, e.g. to pytest.raises(match=...))."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


CALIB_HELP = ("calibration text: FILE, FOLDER, pydoc or generated, or a mix PATH:WEIGHT,... in proportion from the "
              "first block (pydoc: its training split, never the held-out text; generated: text sampled from the model "
              "itself, as many tokens as the command reads (at least 4096), e.g. pydoc:1,generated:1; default: pydoc)")

def fail(cmd: str, message: str) -> NoReturn:
    """Print ``mfqat <cmd>: error: message`` on stderr and exit with status 2."""
    line = f"mfqat {cmd}: error: {message}" if cmd else f"mfqat: error: {message}"
    print(line, file=sys.stderr)
    raise CommandError(line)


def _is_user_error(exc: BaseException) -> bool:
    """Mistakes a user can fix from the message: bad paths, names, values, anchors, busy/unsafe outputs."""
    from mfqat.storage.guard import WriterBusyError

    return isinstance(exc, (OSError, ValueError, WriterBusyError))


def _model_arg(p: argparse.ArgumentParser, dest: str, help: str) -> None:
    p.add_argument(dest, nargs="?", default=None, help=help)
    p.add_argument("--model", dest="model_flag", default=None, metavar=dest.upper(), help=f"same as {dest}")


def _mlx_flags(p: argparse.ArgumentParser) -> None:
    _model_arg(p, "model", "MLX model directory (an mfqat export or any mlx-lm model)")
    p.add_argument("--adapter-path", default=None, help="LoRA adapters (mfqat mlx-train --lora-rank, mlx_lm.lora)")


class _Version(argparse.Action):
    """``--version``: the version and the backends (C++ kernels, Triton, MLX), found without importing them."""

    def __call__(self, parser, namespace, values, option_string=None):
        from mfqat.cli.backends import version_text
        print(version_text(__version__))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The `mfqat` parser (train / mlx-train / bench take their own flags: see main)."""
    p = argparse.ArgumentParser(prog="mfqat", description="Multi-format QAT, anchors, Slice-and-Scale, MLX export")
    p.add_argument("--version", action=_Version, nargs=0, help="the version and which backends are active")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="MF-QAT fine-tune with accelerate (mfqat train --help)", add_help=False)
    c = sub.add_parser("convert", help="anchor -> plain HF checkpoint holding one format's dequantized weights",
                       description="Write a from_pretrained-loadable HF checkpoint whose weights hold exactly the "
                       "values of one format of the anchor, dequantized to float32: as large as a full-precision "
                       "checkpoint (for packed low-bit weights use export-mlx).")
    _model_arg(c, "anchor", "anchor directory")
    c.add_argument("--to", default=None, help="format to convert to (default: the anchor's)")
    c.add_argument(*OUT_FLAGS, dest="out", required=True)
    c.add_argument("--overwrite", action="store_true", help="replace an earlier convert output at --out")
    c.add_argument("--scale-search", action="store_true", help="lower to mxint6..mxint3 with the output-aware "
                   "per-block scale choice, calibrated on --calib-text with the anchor's tokenizer (docs/numerics.md)")
    c.add_argument("--calib-text", default=None, help="--scale-search: " + CALIB_HELP)
    c.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="a family convert must load whole (printed) is refused up front when its float32 state "
                        "dict and model need more than this (default: the memory available now)")
    e = sub.add_parser("eval", help="perplexity table + PNG over formats")
    _model_arg(e, "model", "anchor directory, HF folder, .gguf, or 'smollm2'")
    e.add_argument("--formats", default="mxint8,mxint6,mxint5,mxint4,mxint3,mxint2")
    e.add_argument("--text", default=None, help="default: held-out pydoc text")
    e.add_argument("--blocks", type=int, default=16)
    e.add_argument("--seq-len", type=int, default=128)
    e.add_argument("--compare", action="store_true", help="add direct quantization of --fp-model")
    e.add_argument("--fp-model", default=None, help="full-precision model for --compare")
    e.add_argument("--tokenizer", default=None, help="tokenizer folder for an anchor saved without one")
    e.add_argument("--bnb", default="", help="comma list of bitsandbytes baselines to add as rows: nf4 (NF4 + double "
                   "quant, bf16 compute), int8 (LLM.int8, threshold 6.0); of MODEL, or of --fp-model for an anchor")
    e.add_argument("--scale-search", action="store_true", help="anchor: lower to mxint6..mxint3 with the "
                   "output-aware per-block scale choice, calibrated on --calib-text (as export-mlx --scale-search)")
    e.add_argument("--calib-text", default=None, help="--scale-search: " + CALIB_HELP)
    e.add_argument("--plot", default="ppl_vs_bpw.png", help="the perplexity-vs-bits PNG written")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the evaluated model's dtype (bfloat16: half the memory; an anchor is loaded tensor by tensor)")
    e.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="an anchor's model is held in --dtype when it fits this budget (default: the memory available "
                        "now), else run module by module: each format's weights rebuilt on every forward (slower, a "
                        "module's weights in memory); an HF model, which is loaded whole, is refused up front past it")
    e.add_argument("--overwrite", action="store_true", help="replace an existing --plot file")
    x = sub.add_parser("export-mlx", help="anchor (or HF model) -> MLX model directory")
    _model_arg(x, "anchor", "anchor directory or full-precision HF folder")
    x.add_argument(*OUT_FLAGS, dest="out", required=True)
    x.add_argument("--recipe", default="uniform:mxint4",
                   help="uniform:FMT | seed[:FAMILY] (alias unsloth) | dynamic2[:FAMILY] | auto:BPW[:FAMILY] (e.g. "
                        "auto:4.5, uniform:affine4, seed:affine, dynamic2)")
    x.add_argument("--group-size", type=group_sizes, default=64, metavar="{32,64,128}[,...]",
                   help="group of the affine formats derived from the anchor (uniform:affineK, seed:affine); "
                        "MX formats keep the anchor's block size. auto:BPW:affine takes several (e.g. 64,128): the "
                        "first is every tensor's, each other one a level of its own (affine3@g128) for the tensors "
                        "whose rows divide into it")
    x.add_argument("--tokenizer", default=None, help="tokenizer folder copied into the export (needed when the "
                   "anchor was saved without a tokenizer)")
    x.add_argument("--calib-text", default=None, help="auto/AWQ/--refine/--scale-search: " + CALIB_HELP)
    x.add_argument("--awq", action="store_true", help="AWQ pre-scaling (full-precision model input only)")
    x.add_argument("--imatrix-path", default=None, help="a llama.cpp importance-matrix GGUF (llama-imatrix -o "
                   "imatrix.gguf, as Unsloth publishes), instead of calibrating on --calib-text: with --awq AWQ's "
                   "importance, else the --scale-search importance (mxint6..mxint3 blocks)")
    x.add_argument("--scale-search", action="store_true", help="output-aware per-block MX scale choice when "
                   "lowering the anchor to mxint6..mxint3 (importance-weighted error, calibrated on --calib-text; "
                   "docs/numerics.md)")
    x.add_argument("--gptq", action="store_true", help="GPTQ codes for the derived affine matrices: each rounding "
                   "error is pushed onto the columns not yet rounded, weighted by the matrix's inputs on --calib-text "
                   "(256 x 128 tokens), the derived scales and biases kept, before the refine learns them "
                   "(mfqat.export.gptq; holds those matrices' codes in memory, a byte a weight)")
    x.add_argument("--sensitivity-blocks", type=int, default=None, help="auto:BPW: calibration blocks of 128 tokens "
                   "the sensitivity pass scores each tensor on (default 4; its time grows with them)")
    x.add_argument("--gptq-blocks", type=int, default=None, help="--gptq: calibration blocks of 128 tokens "
                   "(default 256; fewer fitted the calibration text and raised another text's perplexity)")
    x.add_argument("--gptq-damp", type=float, default=None, help="--gptq: relative dampening of the inputs' second "
                   "moment (default 0.01; 0.1 was better on both held-out texts at 3.79 bits on SmolLM2-135M, one "
                   "run: BENCHMARKS.md, 'A size class down')")
    x.add_argument("--gptq-grid-search", action="store_true", help="--gptq: choose each group's scale and bias "
                   "among clipped ranges of its weights (the lowest input-weighted rounding error) before GPTQ's codes "
                   "(mfqat.export.gptq.GPTQConfig.grid_search; same bytes)")
    how = x.add_mutually_exclusive_group()
    how.add_argument("--refine", action="store_true", help="the default for a plan with affine tensors, required "
                     "for nvfp4 and MX plans: learn the affine tensors' group scales and biases, the nvfp4 tensors' "
                     "E4M3 block scales (codes and bytes unchanged) and the E8M0 exponent of each block of an MX "
                     "tensor lowered from the anchor (one of its derived exponent and the two neighbours; codes "
                     "encoded again) so the export's next-token distribution matches the anchor's on --calib-text "
                     "(KL, Adam; mlx-lm DWQ's lever, run in PyTorch; mfqat.export.refine.RefineConfig); an error "
                     "when the plan has none of these")
    how.add_argument("--no-refine", action="store_true", help="export the derived affine scales and biases (nvfp4 "
                     "scales) as they are (round to nearest, as mlx_lm.convert): no calibration, seconds instead of "
                     "minutes")
    x.add_argument("--refine-steps", type=int, default=None, help="refine: Adam steps of 4 x 128 calibration "
                   "tokens (default by model size: 64 up to 0.3B parameters, 32 up to 1B, 16 up to 4B, then 8)")
    x.add_argument("--refine-blocks", type=int, default=None, help="refine: calibration blocks of 128 tokens it "
                   "learns on (default 32, plus 4 to validate; more were better on both held-out texts at 3.79 bits, "
                   "BENCHMARKS.md)")
    x.add_argument("--refine-lr", type=float, default=1e-3, help="refine: learning rate of the relative scale / bias")
    x.add_argument("--refine-exponent-lr", type=float, default=5e-2, help="refine: learning rate of an MX block's "
                   "exponent parameter (a block moves to a neighbouring exponent after about 0.5 / this many steps "
                   "of one sign)")
    x.add_argument("--scale-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="MLX affine scales/biases; auto: as mlx_lm.convert writes for the model (bfloat16 for a "
                        "bf16 model, float32 for a float32 one); all exact for MX power-of-two scales")
    x.add_argument("--base-bits", type=int, default=4)
    x.add_argument("--no-verify", action="store_true")
    x.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory budget of the export check, e.g. 8GB: when the whole check fits (default 2GB), every "
                        "tensor is dequantized by MLX from the files and the whole model's logits compared; past it, "
                        "every written byte is compared with what the export computed (sha256), sampled rows go "
                        "through MLX and the logits of the first layers are compared; an HF source that does not map "
                        "tensor by tensor, loaded whole in float32, is refused up front past it (default there: the "
                        "memory available)")
    x.add_argument("--overwrite", action="store_true", help="replace an earlier MLX export at --out")
    r = sub.add_parser("refine", help="learn affine widths' group scales and biases against the anchor and store "
                       "them in it (export-mlx and load_anchor then use them)")
    r.add_argument("anchor", help="anchor directory (changed in place: one file per width, mfqat.json re-sealed)")
    r.add_argument("--formats", default="affine4", help="comma list of affine widths to learn (affine2..affine8)")
    r.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                   help="the affine group the widths are learned for (export-mlx --group-size must match)")
    r.add_argument("--calib-text", default=None, help=CALIB_HELP)
    r.add_argument("--steps", type=int, default=None, help="Adam steps of 4 x 128 calibration tokens per width "
                   "(default by model size: 64 up to 0.3B parameters, 32 up to 1B, 16 up to 4B, then 8)")
    r.add_argument("--lr", type=float, default=1e-3, help="learning rate of the relative scale / bias")
    r.add_argument("--overwrite", action="store_true", help="learn again a width the anchor already holds")
    y = sub.add_parser("verify", help="check an anchor / MLX export / convert output against its manifest")
    y.add_argument("path")
    d = sub.add_parser("demo", help="the end-to-end demo on the embedded SmolLM2-135M "
                           "(Q4_1 GGUF, dequantized)")
    from mfqat.cli.demo_args import build_parser as demo_parser
    demo_parser(d)
    sub.add_parser("bench", help="fake-quant speed per format and backend, against clone() and torchao",
                   add_help=False)
    sub.add_parser("mlx-train", help="MF-QAT or LoRA fine-tune on MLX (mfqat mlx-train --help)", add_help=False)
    sub.add_parser("mx-qlora", help="one LoRA adapter on a frozen MX anchor, for all its formats "
                   "(mfqat mx-qlora --help)", add_help=False)
    g = sub.add_parser("generate", help="complete a prompt with an MLX model directory (mlx-lm), chat template "
                       "applied as mlx_lm.generate does")
    _mlx_flags(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("--max-tokens", "-m", type=int, default=64)
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    g.add_argument("--seed", type=int, default=None, help="PRNG seed")
    g.add_argument("--system-prompt", default=None, help="system message for the chat template")
    g.add_argument("--ignore-chat-template", action="store_true", help="use the prompt as raw text")
    v = sub.add_parser("serve", help="OpenAI-style HTTP server over an MLX model directory (mlx-lm); other "
                       "flags go to mlx_lm.server (e.g. --max-tokens, --chat-template-args)")
    _mlx_flags(v)
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8080)
    v.add_argument("--allow-origin", default=None, metavar="ORIGIN",
                   help="answer CORS requests from this origin (default: CORS off)")
    return p


def _mlx(cmd: str = "") -> None:
    """Exit with a clear message when MLX / mlx-lm are not installed."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as exc:
        fail(cmd, f"this command runs on MLX, which is not installed ({exc}). "
                  "Install it with: pip install 'mfqat[mlx]' (mlx[cpu] on Linux, mlx on macOS)")


def _bench(rest: List[str]) -> NoReturn:
    """`mfqat bench`: the fake-quant speed tables, from the package (mfqat.quant.kernels.bench)."""
    from mfqat.quant.kernels.bench import main as bench_main
    bench_main(rest, prog="mfqat bench")
    sys.exit(0)


def _run(cmd: str, args: argparse.Namespace, rest: List[str]) -> None:
    """Run one parsed, checked subcommand."""
    from mfqat.progress import quiet_dependency_logs

    quiet_dependency_logs()  # transformers imports torchao, whose CUDA-only kernels complain on CPU
    if cmd == "train":
        from mfqat.train.loop import main as train_main
        train_main(rest)
    elif cmd == "mx-qlora":
        from mfqat.mxqlora.train import main as mx_qlora_main
        mx_qlora_main(rest)
    elif cmd == "mlx-train":
        from mfqat.mlx.train import main as mlx_train_main
        mlx_train_main(rest)
    elif cmd in ("convert", "export-mlx", "verify", "eval", "refine"):
        from mfqat.cli import commands
        {"convert": commands.convert, "export-mlx": commands.export, "verify": commands.verify,
         "eval": commands.evaluate, "refine": commands.refine}[cmd](args)
    elif cmd == "generate":
        from mfqat.mlx.serve import generate
        print(generate(args.model, args.prompt, args.max_tokens, args.adapter_path, temp=args.temp,
                       top_p=args.top_p, seed=args.seed, system_prompt=args.system_prompt,
                       chat_template=not args.ignore_chat_template))
    elif cmd == "serve":
        from mfqat.mlx.serve import serve
        extra = rest + (["--adapter-path", args.adapter_path] if args.adapter_path else [])
        serve(args.model, args.host, args.port, args.allow_origin, extra=extra)
    elif cmd == "demo":
        from mfqat.cli.demo import run_demo
        run_demo(args.out, args.steps, args.eval_blocks, model_name=args.model, force=args.force, skip_mlx=args.skip_mlx)


def _own_parser(cmd: str) -> argparse.ArgumentParser:
    """The parser of a subcommand that parses its own flags (train, mlx-train)."""
    if cmd == "train":
        from mfqat.train.args import build_parser
        return build_parser(prog="mfqat train")
    if cmd == "mx-qlora":
        from mfqat.mxqlora.train import build_parser as qlora_parser
        return qlora_parser()
    from mfqat.mlx.train import build_parser as mlx_parser
    return mlx_parser(argparse.ArgumentParser(prog="mfqat mlx-train", description=sys.modules[mlx_parser.__module__].__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))


def group_sizes(text: str):
    """``--group-size``: one MLX affine group (32, 64 or 128), or several, comma-separated (a tuple)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p in ("32", "64", "128") for p in parts) or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give 32, 64 or 128, or several different ones separated by "
                                         "commas (64,128: auto:BPW:affine plans only)")
    groups = tuple(int(p) for p in parts)
    return groups[0] if len(groups) == 1 else groups


def memory_size(text: str) -> int:
    """``--max-memory``: a size such as 8GB, 512MB, 1.5GiB or a byte count."""
    import re
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size: write e.g. 8GB, 512MB or 1.5GiB")
    unit = (m.group(2) or "b").rstrip("b").rstrip("i")
    value = float(m.group(1)) * 1024 ** "_kmgt".index(unit or "_") if unit else float(m.group(1))
    return int(value)


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of the `mfqat` console script."""
    from mfqat.cli.sysmem import STREAMING_COMMANDS, return_freed_memory

    args, rest = build_parser().parse_known_args(argv)
    cmd = args.cmd
    if cmd in STREAMING_COMMANDS and (not getattr(args, "no_refine", False) or getattr(args, "gptq", False)):
        return_freed_memory()  # freed tensors go back to the system at once (mfqat.cli.sysmem)
    if cmd == "bench":
        _bench(rest)
    if cmd in ("mlx-train", "generate", "serve"):
        _mlx(cmd)
    checked = args
    if cmd in ("train", "mlx-train", "mx-qlora"):
        checked = _own_parser(cmd).parse_args(rest)
    elif rest and cmd not in ("serve",):
        fail(cmd, f"unrecognized arguments: {' '.join(rest)}")
    try:
        check(cmd, checked)
        _run(cmd, args, rest)
    except UsageError as exc:
        fail(cmd, str(exc))
    except Exception as exc:
        if os.environ.get("MFQAT_DEBUG") or not _is_user_error(exc):
            raise
        fail(cmd, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


if __name__ == "__main__":
    main()
