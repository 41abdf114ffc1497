"""The export check: MLX's dequantized tensors and mlx_lm's logits against PyTorch on the same weights."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np
import torch

from mfqat.anchor.checkpoint import Anchor
from mfqat.export.mlx_files import load_weights
from mfqat.export.recipes import Plan, mlx_storage

# The exported logits must match PyTorch's (float32, same weights) within LOGIT_RTOL[check] x
# max(1, max |PyTorch logit|) on the check prompt. The weights are checked bit-exact first, so this
# checks the model around them (config, per-module bits, rope, tying). float32 scales: MLX computes
# in float32, observed ~3e-7 absolute. bfloat16 parameters (scales, biases, norms) are upcast to
# float32 for the check ("float32-upcast"): MLX's bfloat16 arithmetic drifts with depth (15-23% of
# max |logit| on SmolLM2-135M at affine3..8, which would hide a broken model) and is ~100x slower on
# CPU; upcast, only the scale arithmetic of the dequantization differs (float32 instead of bfloat16's
# two roundings): observed 1.6-2.5% on SmolLM2-135M at affine3/4/8 with argmax agreement 1.0.
LOGIT_RTOL = {"float32": 1e-3, "float32-upcast": 0.1}
# The logits are compared at every position of the check prompt, repeated to at least this many tokens:
# a port that differs only past a short context (a sliding window mlx-lm ignores, rope scaling) shows.
CHECK_TOKENS = 64
# mfqat_export.json's layout; an export declaring a newer one is refused (written since mfqat 0.1.0: 1;
# exports without the field are version 1).
EXPORT_FORMAT_VERSION = 1


def check_export_version(meta: dict, where: str) -> int:
    """The export's format version; ValueError naming ``where`` when it is newer than this mfqat reads."""
    v = meta.get("format_version", 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{where}: field 'format_version' must be a positive integer, got {v!r}")
    if v > EXPORT_FORMAT_VERSION:
        raise ValueError(f"{where}: format version {v} is newer than this mfqat supports ({EXPORT_FORMAT_VERSION}); "
                         "upgrade mfqat to read it")
    return v

def _as_written(family, name: str, value: torch.Tensor) -> torch.Tensor:
    """A plain tensor as the export writes it (bfloat16 unless kept float32, in mlx-lm's form), mapped back
    to transformers' form in float32: the PyTorch reference runs on exactly the written numbers."""
    written = family.mlx_value(name, value.float())
    if not family.float32_on_export(name):
        written = written.to(torch.bfloat16)
    return family.hf_value(name, written.float())


def reference_state(anchor: Anchor, plan: Plan) -> Dict[str, torch.Tensor]:
    """The PyTorch weights that the export must reproduce (float32)."""
    family = plan.family
    sd = {k: _as_written(family, k, v) if v.is_floating_point() else v for k, v in anchor.plain.items()}
    for name, q in plan.tensors(anchor).items():
        sd[name] = q.dequantize(torch.float32)
    for name in plan.kept16:
        if name in anchor.quantized:
            sd[name] = anchor.quantized[name].dequantize(torch.float32).to(torch.bfloat16).float()
    return sd


def verify_export(out: Path, anchor: Anchor, plan: Plan, prompt: str) -> dict:
    """Every tensor dequantized by MLX equals the PyTorch dequantization; logits compared."""
    import mlx.core as mx

    weights = load_weights(out)
    checked = 0
    for name, q in plan.tensors(anchor).items():
        full = q.dequantize(torch.float32).numpy()
        rows = full.shape[-2] if full.ndim > 1 else 1
        for piece, lo, hi in plan.family.mlx_pieces(name, rows):
            module = piece[: -len(".weight")]
            expect = full if (lo, hi) == (0, rows) else full[..., lo:hi, :]
            if f"{module}.scales" in weights:
                mode, bits = mlx_storage(plan.formats[name])
                got = mx.dequantize(weights[piece], weights[f"{module}.scales"], weights.get(f"{module}.biases"),
                                    group_size=plan.group_of(plan.formats[name]), bits=bits, mode=mode)
            elif piece in weights:
                got = weights[piece]
            else:
                raise RuntimeError(f"export check failed: {name}: no {piece} in the written files; nothing was written")
            got = np.array(got.astype(mx.float32))
            if got.shape != expect.shape or not np.array_equal(got, expect):
                bad = int((got != expect).sum()) if got.shape == expect.shape else got.size
                where = "" if piece == name else f", in {piece}"
                raise RuntimeError(f"export check failed: {name}: {bad} elements differ between MLX and PyTorch "
                                   f"dequantization ({plan.formats[name]}{where}); nothing was written")
            checked += got.size
    rep = {"weights_bit_exact": checked > 0, "weights_checked": checked, **compare_logits(out, anchor, plan, prompt)}
    if not rep["max_abs_logit_diff"] <= rep["logit_tolerance"]:
        raise RuntimeError(f"export check failed: the logits of mlx_lm.load(out) differ from PyTorch by "
                           f"{rep['max_abs_logit_diff']:.3g}, above the tolerance {rep['logit_tolerance']:.3g} "
                           f"({rep['mlx_compute']} LOGIT_RTOL x max(1, max |logit|)); nothing was written")
    return rep


def compare_logits(out: Path, anchor: Anchor, plan: Plan, prompt: str) -> dict:
    """Load with mlx_lm and compare logits on ``prompt`` with the PyTorch model in the same format."""
    import mlx.core as mx
    from mlx_lm import load as mlx_load
    import transformers
    from transformers import CONFIG_MAPPING

    from mlx.utils import tree_flatten, tree_map

    model, tok = mlx_load(str(out))
    ids = tok.encode(prompt)
    ids = (ids * -(-CHECK_TOKENS // max(len(ids), 1)))[:max(CHECK_TOKENS, len(ids))]  # the prompt, repeated
    params = tree_flatten(model.parameters())
    bf16_scales = any(a.dtype == mx.bfloat16 and k.endswith((".scales", ".biases")) for k, a in params)
    compute = "float32-upcast" if bf16_scales else "float32"  # see LOGIT_RTOL
    if any(a.dtype == mx.bfloat16 for _, a in params):  # bf16 norms upcast exactly (PyTorch holds them so)
        model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a, model.parameters()))
    mlx_logits = np.array(model(mx.array([ids])).astype(mx.float32))
    config = CONFIG_MAPPING[anchor.config["model_type"]].from_dict(anchor.config)
    auto = getattr(transformers, plan.family.hf_auto_class)  # a VL release's whole class
    pt = auto.from_config(config, dtype=torch.float32)
    missing, unexpected = pt.load_state_dict(reference_state(anchor, plan), strict=False)
    missing = [k for k in missing if k not in set(anchor.meta.get("tied", {})) and not plan.family.tower(k)]
    if missing or unexpected:  # the reference must hold every weight the anchor has, nothing else
        raise RuntimeError(f"export check failed: the PyTorch reference does not match {anchor.path}'s weights "
                           f"(missing {missing[:3]}, unexpected {unexpected[:3]}); nothing was written")
    pt.tie_weights()
    with torch.no_grad():
        pt_logits = pt(torch.tensor([ids])).logits.numpy()
    diff = float(np.abs(mlx_logits - pt_logits).max())
    tol = LOGIT_RTOL[compute] * max(1.0, float(np.abs(pt_logits).max()))
    agree = float((mlx_logits.argmax(-1) == pt_logits.argmax(-1)).mean())
    return {"max_abs_logit_diff": diff, "logit_tolerance": tol, "mlx_compute": compute,
            "argmax_agreement": agree, "prompt_tokens": len(ids)}
