"""External oracles: torchao to_mx (FLOOR) for every MXFP format, bitsandbytes NF4.

Known, documented deviations of torchao 0.18 (not of mfqat): blocks holding Inf get a finite
scale there (docs/numerics.md: NaN scale), and its FP8 path halves blocks whose E8M0 scale is
2^-127 (the subnormal scale). Those blocks are excluded from the comparison and tested against
the exact oracle in test_reference.py instead.
"""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mfqat

torchao_mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

TORCHAO_ELEM = {
    "mxfp8_e4m3": torch.float8_e4m3fn,
    "mxfp8_e5m2": torch.float8_e5m2,
    "mxfp6_e3m2": "fp6_e3m2",
    "mxfp6_e2m3": "fp6_e2m3",
    "mxfp4_e2m1": torch.float4_e2m1fn_x2,
}


def torchao_fake_quant(x, name):
    elem = TORCHAO_ELEM[name]
    scale, data = torchao_mx.to_mx(x, elem, 32, ScaleCalculationMode.FLOOR)
    deq = torchao_mx.to_dtype(data, scale, elem, 32, torch.float32)
    return scale.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] // 32), deq


def compare(x, name):
    scale, deq = torchao_fake_quant(x, name)
    q = mfqat.quantize(x, name)
    comparable = torch.isfinite(x.float()).reshape(*q.scales.shape, 32).all(-1) & (q.scales > 0)
    assert torch.equal(scale[comparable], q.scales[comparable])
    ours = q.dequantize(torch.float32).reshape(*q.scales.shape, 32)
    theirs = deq.reshape(*q.scales.shape, 32)
    assert torch.equal(ours[comparable], theirs[comparable])


@pytest.mark.parametrize("name", list(TORCHAO_ELEM))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchao_random_and_adversarial(name, dtype):
    torch.manual_seed(0)
    x = torch.randn(256, 256) * torch.exp2(torch.randint(-100, 100, (256, 1)).float())
    x[0, :32] = 0
    x[1, :32] = torch.arange(32) * 0.25             # ties on the element grid
    x[2, :32] = torch.arange(32) * 2.0 ** -8         # subnormal elements
    x[3, :32] = 448.0 * torch.linspace(-1.2, 1.2, 32)  # saturation
    x[4, :32] = float("nan")
    x[5, 5] = float("inf")
    f = mfqat.get_format(name)
    grid = torch.unique(mfqat.quant.reference.mx_codes_to_values(torch.arange(2 ** f.bits).to(torch.uint8), f).abs())
    grid = grid[grid.isfinite()]
    mids = ((grid[1:] + grid[:-1]) / 2)[:32]
    x[6, :mids.numel()] = mids                        # exact midpoints after scaling by 1
    x[6, 31] = f.max_normal
    compare(x.to(dtype), name)


@given(st.sampled_from(list(TORCHAO_ELEM)), st.integers(-120, 120),
       st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=64, max_size=64))
def test_torchao_hypothesis(name, exponent, values):
    x = torch.tensor([values], dtype=torch.float32) * 2.0 ** exponent
    compare(x, name)


def test_bitsandbytes_nf4():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    from mfqat.formats import NF4_CODEBOOK

    torch.manual_seed(0)
    w = torch.randn(64, 256) * 3
    book = torch.tensor(NF4_CODEBOOK)
    mids = (book[1:] + book[:-1]) / 2
    w[:8, :15] = mids                                  # ties between code-book entries
    w[:8, 15] = 1.0
    w[:8, 16:31] = torch.nextafter(mids, torch.tensor(2.0))
    w[:8, 32:47] = torch.nextafter(mids, torch.tensor(-2.0))
    w[:8, 47:64] = 0.0                                 # block absmax exactly 1: real ties (see also below)
    w[8, :64] = 0.0
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    q = mfqat.quantize(w, "nf4", 64)
    flat = packed.flatten()
    bnb_codes = torch.stack([flat >> 4, flat & 15], -1).reshape(64, 256)  # bnb: element 0 high nibble
    assert torch.equal(bnb_codes, q.codes)
    assert torch.equal(state.absmax, q.scales.flatten())
    assert torch.equal(bnbf.dequantize_4bit(packed, state), q.dequantize())


def test_bitsandbytes_nf4_exact_ties():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    from .test_reference import nf4_tie_blocks

    w, _, _ = nf4_tie_blocks()
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4")
    flat = packed.flatten()
    bnb_codes = torch.stack([flat >> 4, flat & 15], -1).reshape(w.shape)
    q = mfqat.quantize(w, "nf4", 64)
    assert torch.equal(state.absmax, q.scales.flatten())
    assert torch.equal(bnb_codes, q.codes)
    assert torch.equal(bnbf.dequantize_4bit(packed, state), q.dequantize())
