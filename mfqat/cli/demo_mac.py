"""The demo's Mac stage: what a Mac user would ship, against ``mlx_lm.convert`` of the same weights.

mfqat exports the demo's anchor in MLX's own affine layout as ``mfqat export-mlx`` does by default:
``uniform:affine4`` at mlx_lm's 4.5 bits/weight and ``auto:4.7:affine`` (a sensitivity-based mix of
widths at mlx_lm's ``mixed_4_6`` size), both refined (learned scales and biases, same bytes; steps by
model size), and ``uniform:affine4 --no-refine`` (the derived scales, round to nearest as mlx-lm's);
``mlx_lm.convert`` quantizes the run's full-precision master weights (q4 g64, mixed_4_6).
Every row: stored bits/weight from the files and perplexity of the exact weights MLX holds
(mfqat.eval.mlx_weights: computed in PyTorch, MLX's CPU backend being slow in bfloat16); mfqat's
rows also load in mlx_lm, generate, and carry the exporter's MLX-vs-PyTorch check.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import torch

from mfqat.eval.report import format_table

# (recipe, export-mlx's refine flag): the default refines (to_mlx refine="auto"), --no-refine does not
MAC_RECIPES = (("uniform:affine4", "--no-refine"), ("uniform:affine4", ""), ("auto:4.7:affine", ""))
MLX_LM_OPTIONS = {"q4 g64": dict(q_bits=4, q_group_size=64), "mixed_4_6": dict(quant_predicate="mixed_4_6")}
GENERATE_TOKENS = 12


def mac_exports(anchor: Path, master: Optional[Path], model, held: torch.Tensor, out_dir: Path, prompt: str) -> Dict[str, dict]:
    """{row name: {stored bits/weight, perplexity, ...}} for mfqat's exports and mlx_lm's conversions
    of ``master`` (none when it is None)."""
    from mlx_lm import generate, load as mlx_load

    from mfqat.eval.mlx_weights import mlx_folder_perplexity, mlx_lm_convert, stored_bits
    from mfqat.export import to_mlx

    n_params = sum(p.numel() for p in model.parameters())
    rows: Dict[str, dict] = {}
    for recipe, flag in MAC_RECIPES:
        label = f"{recipe} {flag}".strip()
        d = out_dir / ("mlx-" + label.replace(":", "-").replace(" --", "-"))
        rep = to_mlx(anchor, d, recipe=recipe, prompt=prompt, overwrite=True,
                     refine=None if flag == "--no-refine" else "auto")
        m, tok = mlx_load(str(d))
        rows[f"mfqat {label}"] = {
            "dir": str(d), "stored_bits_per_weight": rep["stored_bits_per_weight"],
            "perplexity": mlx_folder_perplexity(d, model, {"held": held})["held"],
            "weights_bit_exact": rep["verify"]["weights_bit_exact"],
            "max_abs_logit_diff": rep["verify"]["max_abs_logit_diff"],
            "refine_steps": rep.get("refine", {}).get("steps"),
            "completion": generate(m, tok, prompt=prompt, max_tokens=GENERATE_TOKENS)}
    for name, options in (MLX_LM_OPTIONS.items() if master else ()):
        d = mlx_lm_convert(master, out_dir / ("mlx_lm-" + name.replace(" ", "-")), **options)
        rows[f"mlx_lm {name}"] = {"dir": str(d), "stored_bits_per_weight": stored_bits(d, n_params),
                                  "perplexity": mlx_folder_perplexity(d, model, {"held": held})["held"]}
    return rows


def print_mac(rows: Dict[str, dict], prompt: str) -> None:
    """The Mac table (sorted by size) and each mfqat export's check and completion."""
    table = [{"MLX model": k, "stored bits/weight": v["stored_bits_per_weight"], "perplexity": v["perplexity"]}
             for k, v in sorted(rows.items(), key=lambda kv: kv[1]["stored_bits_per_weight"])]
    print("\nMac exports (perplexity of the exact MLX weights; mlx_lm.convert of the same fine-tuned master):")
    print(format_table(table, ["MLX model", "stored bits/weight", "perplexity"]))
    for k, v in rows.items():
        if "completion" in v:
            refined = f"refined {v['refine_steps']} steps; " if v.get("refine_steps") else ""
            print(f"{k}: {refined}weights bit-exact in MLX: {v['weights_bit_exact']}, max |logit diff| vs PyTorch "
                  f"{v['max_abs_logit_diff']:.2e}; {prompt} ...{v['completion']}")
