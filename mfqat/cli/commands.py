"""What the `mfqat` subcommands convert, eval, export-mlx and verify do (argument parsing: mfqat.cli.app)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional


def convert(a: argparse.Namespace) -> None:
    """Anchor -> a plain HF checkpoint holding the *dequantized* weights of one format: written tensor by tensor
    from the lazily read anchor (mfqat.anchor.dequantized; ``--scale-search``'s importance measured module by
    module, mfqat.export.scale_search) unless the model's layout needs the whole model."""
    from transformers import AutoTokenizer

    from mfqat.anchor.checkpoint import anchor_model, read_anchor
    from mfqat.anchor.dequantized import save_dequantized, why_not_streamed
    from mfqat.anchor.search import search_scales
    from mfqat.anchor.stream import close_anchor
    from mfqat.export.mlx_sizes import anchor_parameters
    from mfqat.export.scale_search import lazy_importance
    from mfqat.memory import check_fits
    from mfqat.storage.io import atomic_directory, write_json
    from mfqat.storage.manifest import seal
    from mfqat.storage.model_card import write_model_card

    anchor = read_anchor(a.anchor, lazy=True)
    try:
        why = why_not_streamed(anchor)  # refused before the calibration pass, not after it
        if why is not None:
            print(f"[mfqat] convert loads the whole model in float32 ({why})")
            check_fits(f"convert: {a.anchor} loaded whole in float32 ({why}): its state dict and model", 8 *
                       anchor_parameters(anchor), getattr(a, "max_memory", None), "convert on a machine with that "
                       "much memory or pass a larger --max-memory if more is free; export-mlx streams every family")
        searched = False
        if a.scale_search:
            calib = calibration_ids(AutoTokenizer.from_pretrained(a.anchor), a.calib_text, a.anchor)
            report = search_scales(anchor, calib, a.to or anchor.format, measure=lazy_importance)
            searched = bool(report["formats"])
        model = anchor_model(anchor, a.to) if why is not None else None
        with atomic_directory(a.out, overwrite=a.overwrite, kind="convert", protect=[a.anchor]) as tmp:
            if model is not None:
                model.save_pretrained(tmp)
                fmt = model.mfqat_format
            else:
                fmt = save_dequantized(anchor, tmp, a.to)
            _save_listed_tokenizer(a.anchor, tmp)
            write_model_card(tmp, "convert", source=a.anchor, formats=[fmt], name=Path(a.out).name,
                             note=f"float32 weights that hold exactly the {fmt} values of the anchor (dequantized: "
                                  "as large as a full-precision checkpoint; `mfqat export-mlx` writes packed weights)"
                                  + ("; lowered with the output-aware per-block scale search" if searched else ""))
            marker = {"source": str(Path(a.anchor).absolute()), "format": fmt, "scale_search": searched}
            write_json(tmp / "mfqat_convert.json", seal(marker, tmp, "mfqat_convert.json"))
    finally:
        close_anchor(anchor)
    print(f"wrote {a.out}: {fmt} values as dequantized float32 weights (a plain from_pretrained "
          "checkpoint, not smaller than full precision; for packed low-bit weights use mfqat export-mlx)")


def _save_listed_tokenizer(anchor: str, out: Path) -> None:
    """The anchor's tokenizer, from the files its manifest lists only (checked; a file added after the
    anchor was saved is left out with a warning, never sealed into the output as verified)."""
    import tempfile

    from transformers import AutoTokenizer

    from mfqat.anchor.checkpoint import read_meta
    from mfqat.export.mlx_export import tokenizer_files

    files = tokenizer_files(read_meta(anchor), Path(anchor), remedy="copy it into the output by hand if you trust it")
    with tempfile.TemporaryDirectory() as staged:
        for name, data in files.items():
            (Path(staged) / name).write_bytes(data)
        try:
            AutoTokenizer.from_pretrained(staged).save_pretrained(out)
        except Exception:
            print(f"[mfqat] {anchor}: no tokenizer saved with the anchor; wrote weights only")


def verify(a: argparse.Namespace) -> None:
    """Check every file of an anchor, MLX export or converted checkpoint against its manifest."""
    from mfqat.anchor.checkpoint import META_FILE, read_anchor
    from mfqat.storage.manifest import verify_folder

    path = Path(a.path)
    for meta_name, what in ((META_FILE, "anchor"), ("mfqat_export.json", "MLX export"),
                            ("mfqat_convert.json", "converted checkpoint")):
        if (path / meta_name).is_file():
            if what == "anchor":
                read_anchor(path, verify=True)
            meta = verify_folder(path, meta_name)
            if what == "MLX export":
                from mfqat.export.verify import check_export_version
                check_export_version(meta, str(path / meta_name))
            print(f"OK {path}: {what}, {len(meta['manifest']) + 1} files match the manifest")
            return
    raise ValueError(f"{path} is not an mfqat anchor, MLX export or converted checkpoint")


def evaluate(a: argparse.Namespace) -> None:
    """Perplexity table + PNG over formats, from an anchor (Slice-and-Scale) or a model (PTQ)."""
    import torch

    from mfqat.anchor.checkpoint import read_anchor
    from mfqat.data.sources import load_model, load_text, model_label, split_text, token_blocks
    from mfqat.eval.elastic import evaluate_anchor_formats, evaluate_ptq
    from mfqat.eval.perplexity import perplexity
    from mfqat.eval.report import format_table, plot_ppl_vs_bpw
    from mfqat.formats import get_format
    from mfqat.train.setup import check_model_fits, check_token_ids

    formats = a.formats.split(",")
    is_anchor = (Path(a.model) / "mfqat.json").is_file()
    dtype = getattr(torch, getattr(a, "dtype", None) or "float32")
    lazy = None
    if is_anchor and a.fp_model and (a.compare or a.bnb) and Path(a.fp_model).is_dir():  # before hours are spent
        from mfqat.anchor.stream import model_and_targets_numel
        from mfqat.memory import check_fits
        check_fits(f"eval --compare/--bnb: {a.fp_model} loaded whole in float32 (the model and a copy of its quantized "
                   "weights, after the anchor's model is freed)", 4 * model_and_targets_numel(a.fp_model), getattr(a, "max_memory", None),
                   "evaluate on a machine with that much memory, pass a larger --max-memory if more is free, or "
                   "leave out --compare and --bnb")
    if is_anchor:  # read once, lazily; the model filled tensor by tensor, or run module by module (eval at any size)
        from transformers import AutoTokenizer

        from mfqat.anchor.checkpoint import empty_model, load_format
        anchor = read_anchor(a.model, lazy=True)  # --scale-search marks it by name (mfqat.anchor.lazy.annotate)
        lazy = module_by_module(anchor, dtype, getattr(a, "max_memory", None))
        if lazy is not None:
            model = lazy.model
        else:
            model = empty_model(anchor.config, dtype)
            load_format(model, anchor, None)
            model.tie_weights()
        model.eval().mfqat_format = anchor.format
        tok = AutoTokenizer.from_pretrained(a.tokenizer or a.model)
    else:
        if a.model and Path(a.model).is_dir():
            from mfqat.anchor.stream import model_and_targets_numel
            from mfqat.memory import check_fits
            check_fits(f"eval: {a.model} in {str(dtype)[6:]} (the model and a copy of its quantized weights)",
                       dtype.itemsize * model_and_targets_numel(a.model), getattr(a, "max_memory", None),
                       "evaluate on a machine with that much memory, pass a larger --max-memory if more is free, "
                       "try --dtype bfloat16, or save an anchor (mfqat PTQ anchors stream) and evaluate that")
        model, tok = load_model(a.model, dtype=dtype)
    text = load_text(a.text) if a.text else split_text(load_text(None))[1]
    check_model_fits(model, a.seq_len)
    blocks = token_blocks(tok, text, a.seq_len, max_blocks=a.blocks)
    check_token_ids(model, blocks, what=f"--text {a.text}" if a.text else "the held-out pydoc text")
    base_ppl = perplexity(model, blocks, desc="ppl base") if lazy is None else lazy_perplexity(lazy, anchor, None, dtype, blocks)
    if is_anchor:
        if a.scale_search:
            search_for_eval(anchor, tok, formats, a.calib_text, a.model)
        if lazy is None:
            rows = evaluate_anchor_formats(model, anchor, formats, blocks)
        else:
            rows = [{"format": f, "bits/weight": get_format(f).bits_per_weight(32),
                     "perplexity": lazy_perplexity(lazy, anchor, f, dtype, blocks)} for f in formats]
    else:
        rows = evaluate_ptq(model, formats, blocks)
    for r in rows:
        r["delta vs base"] = f"{100 * (r['perplexity'] / base_ppl - 1):+.2f}%"
    series = {"Slice-and-Scale from anchor" if is_anchor else "PTQ": [(r["bits/weight"], r["perplexity"], r["format"]) for r in rows]}
    base = f"anchor format {model.mfqat_format}" if is_anchor else model_label(a.model)
    if is_anchor:  # the anchor's rows are done: its model goes before --compare / --bnb load theirs
        del model, lazy
    fp_model = None
    if a.compare:
        fp_model, _ = load_model(a.fp_model)
        direct = evaluate_ptq(fp_model, formats, blocks)  # restores its weights: --bnb's model too
        for r, d in zip(rows, direct):
            r["direct ppl"] = d["perplexity"]
        series["direct quantization of fp model"] = [(d["bits/weight"], d["perplexity"], d["format"]) for d in direct]
    if a.bnb:
        from mfqat.eval.bnb import bnb_rows
        from mfqat.train.lora import bnb_config
        fp = model if not is_anchor else fp_model if fp_model is not None else load_model(a.fp_model)[0]
        bnb = bnb_rows(fp, {b: bnb_config(b) for b in a.bnb.split(",") if b}, blocks)
        for r in bnb:
            r["delta vs base"] = f"{100 * (r['perplexity'] / base_ppl - 1):+.2f}%"
        rows += bnb
        series["bitsandbytes"] = [(r["bits/weight"], r["perplexity"], r["format"]) for r in bnb]
    print(f"base ({base}) perplexity: {base_ppl:.3f}")
    cols = ["format", "bits/weight", "perplexity", "delta vs base"] + (["direct ppl"] if a.compare else [])
    print(format_table(rows, cols))
    png = plot_ppl_vs_bpw(series, Path(a.plot), fp_ppl=base_ppl, fp_label=f"base: {base.split(' (')[0]}")
    print(f"plot: {png}")


def module_by_module(anchor, dtype, max_memory: Optional[int]):
    """A :class:`mfqat.export.lazy_model.LazyModel` of ``anchor`` in ``dtype`` when holding its model does not fit
    ``max_memory`` (bytes; None: the memory available now, mfqat.cli.sysmem), else None (the model is held)."""
    import torch

    from mfqat.cli.sysmem import available_memory
    from mfqat.export.lazy_model import LazyModel
    from mfqat.export.mlx_sizes import anchor_parameters

    need = anchor_parameters(anchor) * torch.empty(0, dtype=dtype).element_size() + EVAL_WORKING_BYTES
    budget = max_memory if max_memory is not None else available_memory()
    if not budget or need <= budget:
        return None
    print(f"[mfqat] eval: holding the model in {str(dtype)[6:]} needs ~{need / 2 ** 30:.1f} GiB, over the "
          f"{'--max-memory' if max_memory is not None else 'available'} {budget / 2 ** 30:.1f} GiB: running it module "
          "by module (each format's weights rebuilt on every forward: slower)")
    return LazyModel(anchor, checkpoint_layers=False, dtype=dtype)


EVAL_WORKING_BYTES = 1 << 30  # libraries and activations beside an evaluated model


def lazy_perplexity(lazy, anchor, fmt: Optional[str], dtype, blocks) -> float:
    """Perplexity of ``anchor`` in ``fmt`` (None: its own) run module by module by ``lazy``: each tensor as
    :func:`mfqat.anchor.checkpoint.load_format` would load it into a model of ``dtype`` (lowered, dequantized to
    float32, then cast), built when its module runs."""
    import torch

    from mfqat.eval.perplexity import perplexity
    from mfqat.export.lazy_model import anchor_source

    with torch.no_grad(), lazy.running(anchor_source(anchor, fmt, dtype)) as model:
        return perplexity(model, blocks, desc=f"ppl {fmt or 'base'}")


def export(a: argparse.Namespace) -> None:
    """Anchor (or HF model) -> MLX model directory."""
    from mfqat.data.mix import mixed_text
    from mfqat.export import to_mlx
    from mfqat.export.mlx_export import calibration_blocks_needed

    refine = None
    if not a.no_refine:  # the default: refine the plan's affine tensors, if it has any
        from mfqat.export.refine import RefineConfig
        blocks = {} if getattr(a, "refine_blocks", None) is None else {"n_blocks": a.refine_blocks}
        refine = RefineConfig(steps=a.refine_steps, lr=a.refine_lr, exponent_lr=a.refine_exponent_lr,
                              optional=not a.refine, **blocks)
    from mfqat.export.sensitivity import SENSITIVITY_BLOCKS

    sens_blocks = getattr(a, "sensitivity_blocks", None) or SENSITIVITY_BLOCKS
    calib = mixed_text(a.calib_text, model=a.anchor,
                       n_blocks=calibration_blocks_needed(refine, _gptq_config(a), sens_blocks)) \
        if a.calib_text else None
    rep = to_mlx(a.anchor, a.out, recipe=a.recipe, base_bits=a.base_bits, verify=not a.no_verify, calib_text=calib,
                 awq=a.awq, scale_dtype=a.scale_dtype, overwrite=a.overwrite, group_size=a.group_size, tokenizer=a.tokenizer,
                 imatrix_path=a.imatrix_path, scale_search=a.scale_search, refine=refine,
                 max_memory=getattr(a, "max_memory", None), gptq=_gptq_config(a), sensitivity_blocks=sens_blocks)
    v = rep.get("verify", {})
    if "gptq" in rep:
        g = rep["gptq"]
        grid = f" ({g['on_searched_grid']} on a searched grid)" if g.get("grid_search") else ""
        print(f"gptq: {g['tensors']} of {g['candidates']} affine matrices{grid}, output error on the calibration inputs "
              f"{g['output_error_rtn']:.4g} -> {g['output_error_gptq']:.4g}, {g['seconds']:.0f}s")
    if "skipped" in rep.get("refine", {}):
        print(f"refine: skipped: {rep['refine']['skipped']}")
    elif "refine" in rep:
        r = rep["refine"]
        print(f"refine: {r['tensors']} affine tensors, {r['steps']} steps, validation KL to the anchor "
              f"{r['validation_kl_before']:.4f} -> {r['validation_kl_after']:.4f} "
              f"({'kept' if r['kept'] else 'not lower: the derived scales were kept'}), {r['seconds']:.0f}s "
              f"(estimated {r['estimated_seconds']:.0f}s)")
    print(f"wrote {a.out}: recipe {a.recipe}, nominal {rep['bits_per_weight']:.3f} bits/weight, stored "
          f"{rep['stored_bits_per_weight']:.3f} bits/weight on disk ({rep['stored_bits_per_weight_quantized']:.3f} "
          f"for the quantized matrices, {rep['scale_dtype']} scales), "
          f"{rep['seconds']:.1f}s; weights bit-exact: {v.get('weights_bit_exact')}, "
          f"max |logit diff| {v.get('max_abs_logit_diff')}")


def _gptq_config(a: argparse.Namespace):
    """``--gptq``: GPTQ's settings (mfqat.export.gptq.GPTQConfig; ``--gptq-blocks``, ``--gptq-damp`` and ``--gptq-grid-search`` where
    given, its defaults elsewhere), else None."""
    if not getattr(a, "gptq", False):
        return None
    from mfqat.export.gptq import GPTQConfig
    given = {"n_blocks": getattr(a, "gptq_blocks", None), "damp": getattr(a, "gptq_damp", None),
             "grid_search": getattr(a, "gptq_grid_search", False) or None}
    return GPTQConfig(**{k: v for k, v in given.items() if v is not None})


def calibration_ids(tok, calib_text: Optional[str], model: Optional[str] = None):
    """``--scale-search``'s calibration token ids: 8 x 128 tokens of ``--calib-text`` (a file, folder or
    mix; ``generated`` samples ``model``), else of the pydoc training split (never the held-out text)."""
    from mfqat.data.mix import mixed_text
    from mfqat.data.sources import calibration_blocks

    return calibration_blocks(tok, mixed_text(calib_text, model=model) if calib_text else None, n_blocks=8)


def search_for_eval(anchor, tok, formats: list, calib_text: Optional[str], model: Optional[str] = None) -> None:
    """``eval --scale-search``: mark the anchor so that the evaluated formats the search serves are searched."""
    from mfqat.anchor.search import search_scales, searchable_formats
    from mfqat.export.scale_search import lazy_importance
    from mfqat.formats import canonical_name

    can = searchable_formats(anchor.format, anchor.meta.get("scale_rules"))
    served = [f for f in formats if canonical_name(f) in can]
    if not served:
        print(f"scale search: none of {', '.join(formats)} is searched from a {anchor.format} anchor "
              f"(it serves {', '.join(can) or 'no format of this family'})")
        return
    rep = search_scales(anchor, calibration_ids(tok, calib_text, model), served, measure=lazy_importance)
    print(f"scale search: {', '.join(rep['formats'])} lowered with the output-aware per-block exponent "
          f"({rep['tensors']} tensors, {rep['calibration_tokens']} calibration tokens); other formats keep their rule")


def refine(a: argparse.Namespace) -> None:
    """Learn affine widths against the anchor and store them in it (mfqat.export.refine.refine_anchor)."""
    from mfqat.data.mix import mixed_text
    from mfqat.eval.report import format_table
    from mfqat.export.mlx_export import calibration_blocks_needed
    from mfqat.export.refine import RefineConfig, refine_anchor

    cfg = RefineConfig(steps=a.steps, lr=a.lr)
    calib = mixed_text(a.calib_text, model=a.anchor, n_blocks=calibration_blocks_needed(cfg, None)) if a.calib_text else None
    try:
        rows = refine_anchor(Path(a.anchor), [f for f in a.formats.split(",") if f], a.group_size, calib, cfg,
                             overwrite=a.overwrite)
    except FileExistsError as e:
        raise ValueError(str(e)) from None
    cols = ["width", "group", "tensors", "validation KL before", "after", "stored", "seconds"]
    print(format_table([dict(zip(cols, [r["format"], r["group_size"], r["tensors"], f"{r['validation_kl_before']:.4f}",
                                        f"{r['validation_kl_after']:.4f}", "yes" if r["stored"] else "no (not lower)",
                                        f"{r['seconds']:.0f}"])) for r in rows], cols))
    stored = [r["format"] for r in rows if r["stored"]]
    if stored:
        print(f"{a.anchor}: export-mlx --recipe uniform:{stored[0]} --group-size {a.group_size} and load_anchor(anchor, "
              f"'{stored[0]}', group_size={a.group_size}) now use the stored {', '.join(stored)}")
    kept = [r["format"] for r in rows if not r["stored"]]
    if kept:
        print(f"{', '.join(kept)}: the validation KL did not drop; nothing stored for it (a width stored before "
              "stays as it was)")

