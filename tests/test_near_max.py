"""Finite in, finite out: MX quantization of inputs near the dtype's largest value (issue 13).

``scale_rule="ceil"`` once rounded blocks near float16's 65504 (every format) or float32's max
(MXFP formats) up to inf. The reference caps the ceil exponent (mx_shared_exponent's docstring);
every backend must agree with it bit for bit, and nothing may overflow.
"""
import numpy as np
import pytest
import torch

import mfqat
from mfqat.quant.reference import dtype_max_exponent, fake_quantize_reference, quantize_reference

from .conftest import MX_FORMATS
from .test_kernels import FAST_PATHS, DTYPES, assert_bits_equal, run_path, run_quantize

RULES = ["floor", "ceil"]


def near_max(dtype: torch.dtype) -> torch.Tensor:
    """(8, 32) blocks at and just below ``dtype``'s largest finite value, in ``dtype``."""
    big = torch.finfo(dtype).max
    top = 2.0 ** dtype_max_exponent(dtype)
    mant = torch.linspace(1.0, 2.0, 32, dtype=torch.float64)
    rows = [
        torch.full((32,), big, dtype=torch.float64),
        torch.cat([torch.tensor([-big], dtype=torch.float64), torch.ones(31, dtype=torch.float64)]),
        torch.linspace(-big, big, 32, dtype=torch.float64),
        top * mant,  # every mantissa at the top exponent
        -top * mant.flip(0),
        top / 2 * mant,  # one exponent below
        torch.full((32,), top * 1.9, dtype=torch.float64),
        torch.full((32,), top * 1.5, dtype=torch.float64),
    ]
    x = torch.stack(rows).clamp(-big, big)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rule", RULES)
def test_reference_and_public_api_stay_finite(dtype, rule):
    x = near_max(dtype)
    for name in MX_FORMATS:
        out, _ = fake_quantize_reference(x, mfqat.get_format(name), 32, rule)
        assert torch.isfinite(out).all(), f"reference {name} {dtype} {rule}: {out[~torch.isfinite(out)][:4]}"
        q = mfqat.quantize(x, name, 32, scale_rule=rule)
        assert torch.isfinite(q.dequantize()).all(), f"quantize {name} {dtype} {rule}"
        assert torch.isfinite(mfqat.fake_quantize(x, name, 32, scale_rule=rule)).all(), f"api {name} {dtype} {rule}"
    if rule == "ceil":  # half the max reaches the cap but not past it: ceil still never saturates
        half = torch.full((1, 32), torch.finfo(dtype).max / 2, dtype=dtype)
        for name in MX_FORMATS:
            assert not fake_quantize_reference(half, mfqat.get_format(name), 32, rule)[1].any(), name


@pytest.mark.parametrize("backend,device", FAST_PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_paths_bit_exact_near_max(backend, device, dtype):
    x = near_max(dtype).to(device)
    for name in MX_FORMATS:
        fmt = mfqat.get_format(name)
        for rule in RULES:
            what = f"{backend} {name} {dtype} {rule}"
            out, mask = run_path(backend, x, fmt, 32, rule)
            ref, ref_mask = fake_quantize_reference(x.cpu(), fmt, 32, rule)
            assert_bits_equal(out, ref, what)
            assert torch.equal(mask.cpu(), ref_mask), f"{what}: saturation mask"
            codes, scales = run_quantize(backend, x, fmt, 32, rule)
            ref_codes, ref_scales = quantize_reference(x.cpu(), fmt, 32, rule)
            assert torch.equal(codes.cpu(), ref_codes), f"{what}: codes"
            assert torch.equal(scales.cpu(), ref_scales), f"{what}: scales"


def test_mlx_bit_exact_near_max():
    mx = pytest.importorskip("mlx.core")
    from mfqat.mlx import quant as mq

    for tdt, mdt in [(torch.float32, mx.float32), (torch.bfloat16, mx.bfloat16), (torch.float16, mx.float16)]:
        x = near_max(tdt)
        xm = mx.array(x.float().numpy()).astype(mdt)
        for name in MX_FORMATS:
            fmt = mfqat.get_format(name)
            for rule in RULES:
                what = f"mlx {name} {tdt} {rule}"
                out = torch.from_numpy(np.array(mq.qdq(xm, fmt, 32, rule).astype(mx.float32))).to(tdt)
                ref, _ = fake_quantize_reference(x, fmt, 32, rule)
                assert_bits_equal(out, ref, what)
                codes, scales, _ = mq.quantize(xm, fmt, 32, rule)
                ref_codes, ref_scales = quantize_reference(x, fmt, 32, rule)
                assert np.array_equal(np.array(codes), ref_codes.numpy()), f"{what}: codes"
                assert np.array_equal(np.array(scales), ref_scales.numpy()), f"{what}: scales"

