#!/usr/bin/env python
"""The bytes and numbers of ``--refine`` on the embedded SmolLM2-135M, as one JSON digest (issue 44):
run it from two checkouts and compare, to show that a change to mfqat/export/refine.py keeps every
learned scale, every validation KL and every written byte.

    PYTHONPATH=/work/main python scripts/dev/refine_digest.py --work /tmp/rd > main.json; rm -r /tmp/rd
    PYTHONPATH=.          python scripts/dev/refine_digest.py --work /tmp/rd > new.json; rm -r /tmp/rd
    cmp main.json new.json

It saves SmolLM2 as an MXINT8 anchor, exports ``uniform:affine4`` and ``seed:affine`` with ``--refine``
(``--steps`` Adam steps of 4 x 128 tokens), runs ``mfqat refine`` (``refine_anchor``) for affine4 and
affine3 on a copy of the anchor, and prints the sha256 of every file written (the report without its
seconds) and the report's KLs as exact hex floats. Both runs must use the same ``--work`` path (the model
card names the source) on the same machine (float32 matrix products may differ across CPUs).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

NUMBERS = ("tensors", "kept", "validation_kl_before", "validation_kl_after", "train_kl_first_last")


def _exact(v):
    """Floats as hex (every bit), lists element by element."""
    if isinstance(v, float):
        return v.hex()
    if isinstance(v, list):
        return [_exact(x) for x in v]
    return v


def _files(folder: Path, skip=("mfqat_export.json",)) -> dict:
    """{relative path: sha256} of every file under ``folder`` but ``skip``."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in skip}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="an empty or absent folder for the anchor and exports")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()

    import torch

    import mfqat
    from mfqat.data.sources import load_model
    from mfqat.export.refine import RefineConfig, refine_anchor

    torch.set_num_threads(2)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=False)
    model, tok = load_model(None)
    anchor = mfqat.save_anchor(model, work / "anchor", "mxint8", tok)
    del model
    cfg = RefineConfig(steps=a.steps)
    print(f"mfqat from {mfqat.__file__}", file=sys.stderr)
    digest = {"steps": a.steps}
    for recipe in ("uniform:affine4", "seed:affine"):
        out = work / recipe.replace(":", "-")
        rep = mfqat.export.to_mlx(anchor, out, recipe=recipe, refine=cfg)
        digest[recipe] = {"files": _files(out), **{k: _exact(rep["refine"][k]) for k in NUMBERS}}
    shutil.copytree(anchor, work / "refined")
    rows = refine_anchor(work / "refined", ["affine4", "affine3"], cfg=RefineConfig(steps=a.steps))
    digest["refine_anchor"] = {"files": _files(work / "refined", skip=()),
                               "rows": [{k: _exact(r[k]) for k in ("format", "stored") + NUMBERS} for r in rows]}
    print(json.dumps(digest, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
