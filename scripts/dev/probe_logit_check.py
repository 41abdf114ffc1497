#!/usr/bin/env python
"""How close the export's logits check comes to its tolerance (mfqat/export/verify.py, LOGIT_RTOL).

For each family of mfqat.models.catalog (a tiny random model from its transformers config, saved as an
MXINT8 and an MXFP8 anchor) and, with --smollm2, the embedded SmolLM2-135M, exports every recipe below
twice: with the whole-model check and with the cut check (max_memory=1: compare_truncated). Prints, per
(family, recipe, check), the check's max |logit diff| / max(1, max |logit|) - the number LOGIT_RTOL bounds -
and its compute ("float32" or "float32-upcast"), then the worst ratio per compute. One JSON line per
export goes to --jsonl (when given) as it finishes.

    python scripts/dev/probe_logit_check.py                        # every family, both variants (~8 min on 2 cores)
    python scripts/dev/probe_logit_check.py --only llama,qwen3_moe --checks whole
    python scripts/dev/probe_logit_check.py --only none --smollm2  # SmolLM2 at affine4 and mxint4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

AFFINE = [(f"uniform:affine{b}", dict(group_size=g)) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
MXINT = [("uniform:mxint8", {}), ("uniform:mxint4", {}), ("uniform:mxint4", dict(scale_dtype="bfloat16")),
         ("seed", {}), ("seed", dict(scale_dtype="bfloat16")), ("seed:affine", {}), ("dynamic2:affine", {})]
MXFP = [("uniform:mxfp8", {}), ("uniform:mxfp4", {}), ("seed", {}), ("uniform:nvfp4", {})]
SMOLLM2 = [("uniform:affine4", {}), ("uniform:mxint4", {})]


def wide(extra: dict) -> dict:
    """The catalog model's settings with every width doubled (most input dimensions then take MLX group 128)
    and initializer_range 0.2 instead of 0.02 (logits near 10, attention far from uniform): the catalog's
    models have logits below 1, where the check's floor max(1, .) hides how the difference scales."""
    from mfqat.models.catalog import BASE

    kw = {**BASE, **extra, "hidden_size": 128, "intermediate_size": 2 * extra.get("intermediate_size", 128),
          "initializer_range": 0.2}
    for key in ("head_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "kv_lora_rank",
                "q_lora_rank", "v_head_dim", "qk_nope_head_dim", "linear_key_head_dim", "linear_value_head_dim",
                "query_pre_attn_scalar"):
        if key in kw:
            kw[key] = 2 * kw[key]
    return kw


def ratio(v: dict) -> float:
    """max |logit diff| / max(1, max |logit|), from the report (tolerance = LOGIT_RTOL x that max)."""
    from mfqat.export.verify import LOGIT_RTOL

    return v["max_abs_logit_diff"] / (v["logit_tolerance"] / LOGIT_RTOL[v["mlx_compute"]])


def probe(label: str, anchor: Path, jobs: list, checks: list, work: Path, out, rows: list) -> None:
    from mfqat.export import to_mlx

    for recipe, kw in jobs:
        for check in checks:
            row = {"family": label, "recipe": recipe + "".join(f" {k}={v}" for k, v in kw.items()), "check": check}
            t = time.perf_counter()
            try:
                rep = to_mlx(anchor, work / "out", recipe=recipe, overwrite=True,
                             max_memory=1 if check == "cut" else None, **kw)
                v = rep["verify"]
                row.update(ratio=ratio(v), diff=v["max_abs_logit_diff"], compute=v["mlx_compute"],
                           argmax=v["argmax_agreement"], checked=v["logits_checked"])
            except Exception as e:  # noqa: BLE001 - a recipe a family cannot take is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            row["seconds"] = round(time.perf_counter() - t, 1)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)


def main() -> None:
    import mfqat
    from mfqat.data.sources import load_model, tiny_tokenizer
    from mfqat.models.catalog import SUPPORTED, build

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma list of families (default: all of mfqat.models.catalog)")
    p.add_argument("--checks", default="whole,cut")
    p.add_argument("--variants", default="catalog,wide", help="catalog: the tests' models; wide: see wide()")
    p.add_argument("--smollm2", action="store_true", help="also the embedded SmolLM2-135M (affine4, mxint4)")
    p.add_argument("--jsonl", default=os.devnull, help="append one JSON line per export to this file")
    a = p.parse_args()
    names = [n for n in a.only.split(",") if n and n != "none"] if a.only else list(SUPPORTED)
    checks = a.checks.split(",")
    rows: list = []
    with tempfile.TemporaryDirectory(prefix="mfqat-logit-check-") as tmp, open(a.jsonl, "a") as out:
        work = Path(tmp)
        tok = tiny_tokenizer()
        for name in names:
            model_type, extra = SUPPORTED[name]
            for variant in a.variants.split(","):
                model = build(model_type, extra if variant == "catalog" else wide(extra), len(tok))
                for fmt, jobs in (("mxint8", MXINT + AFFINE), ("mxfp8", MXFP)):
                    anchor = mfqat.save_anchor(model, work / f"{name}-{fmt}", fmt, tok, overwrite=True)
                    probe(f"{name} ({variant})", anchor, jobs, checks, work, out, rows)
        if a.smollm2:
            model, tok = load_model(None)
            anchor = mfqat.save_anchor(model, work / "smollm2", "mxint8", tok, overwrite=True)
            probe("smollm2-135m", anchor, SMOLLM2, checks, work, out, rows)
    for compute in ("float32", "float32-upcast"):
        got = [r for r in rows if r.get("compute") == compute]
        if got:
            worst = max(got, key=lambda r: r["ratio"])
            print(f"{compute}: {len(got)} checks, worst ratio {worst['ratio']:.2e} ({worst['family']} "
                  f"{worst['recipe']} {worst['check']})")
    bad = [r for r in rows if "error" in r]
    print(f"{len(bad)} exports failed" + "".join(f"\n  {r['family']} {r['recipe']} {r['check']}: {r['error']}"
                                                 for r in bad))


if __name__ == "__main__":
    main()
