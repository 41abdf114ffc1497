"""int8_absmax and nf4_dq (NF4 + double quantization) against bitsandbytes on CPU."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mfqat
from mfqat.quant.reference_bnb import (double_dequantize_absmax, double_quantize_absmax,
                                       dynamic_code_book, dynamic_code_index)

bnbf = pytest.importorskip("bitsandbytes.functional")


def test_int8_absmax_worked_example():
    q = mfqat.quantize(torch.tensor([[1.2, -0.5, -3.0, 1.5, 2.4]]), "int8_absmax", block_size=5)
    assert q.codes.tolist() == [[51, -21, -127, 64, 102]]
    assert q.scales.tolist() == [[3.0]]


def test_int8_absmax_any_block_size_and_zero_blocks():
    x = torch.zeros(2, 6)
    x[1] = torch.tensor([1.0, -2.0, 0.0, 0.5, 4.0, -4.0])
    q = mfqat.quantize(x, "int8_absmax", block_size=3)  # per row halves
    assert q.codes[0].abs().sum() == 0 and torch.isfinite(q.dequantize()).all()
    assert q.codes[1].tolist() == [64, -127, 0, 16, 127, -127]
    with pytest.raises(ValueError, match="int8_absmax.*positive integer"):
        mfqat.quantize(x, "int8_absmax", block_size=0)


@given(st.integers(1, 40), st.integers(-20, 20), st.integers(0, 2**31 - 1))
def test_int8_absmax_matches_llm_int8_rowwise(rows, exponent, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 96, generator=g) * 2.0 ** exponent
    codes, stats, _ = bnbf.int8_vectorwise_quant(w.clone())
    q = mfqat.quantize(w, "int8_absmax", block_size=96)  # per row = LLM.int8's vector-wise rule
    assert torch.equal(q.codes, codes)
    assert torch.equal(q.scales.flatten(), stats)
    assert torch.equal(q.dequantize(), bnbf.int8_vectorwise_dequant(codes, stats))


def test_dynamic_code_book_is_bnbs():
    assert torch.equal(dynamic_code_book(), bnbf.create_dynamic_map(signed=True))


def test_nf4_dq_bits_per_weight():
    assert mfqat.get_format("nf4_dq").bits_per_weight(64) == 4 + (8 + 32 / 256) / 64  # 4.127


@pytest.mark.parametrize("rows,dtype", [(64, torch.float32), (37, torch.float32), (129, torch.bfloat16)])
def test_nf4_double_quant_against_bitsandbytes(rows, dtype):
    torch.manual_seed(rows)
    w = (torch.randn(rows, 512) * 10 ** torch.randn(rows, 1)).to(dtype)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    absmax = w.float().reshape(-1, 64).abs().amax(-1)
    codes, group_max, offset = double_quantize_absmax(absmax)
    # offset and per-group absmax: bit-exact
    assert torch.equal(offset, state.offset) and torch.equal(group_max, state.state2.absmax)
    # decoding bnb's own 8-bit codes: bit-exact with bnb's dequantize_4bit
    dq = double_dequantize_absmax(state.absmax, group_max, offset)
    flat = packed.flatten()
    nf4 = torch.stack([flat >> 4, flat & 15], -1).reshape(w.shape)
    ours = mfqat.MXTensor(nf4, dq.reshape(rows, -1), mfqat.get_format("nf4_dq"), 64, dtype).dequantize()
    assert torch.equal(ours, bnbf.dequantize_4bit(packed, state))
    # the 8-bit choice: ours is the nearest entry; bnb's native CPU kernel is never nearer
    book = dynamic_code_book()
    normed = (absmax - offset) / group_max.repeat_interleave(256)[: absmax.numel()]
    ours_err = (normed - book[codes.long()]).abs()
    bnb_err = (normed - book[state.absmax.long()]).abs()
    assert (ours_err <= bnb_err).all()
    assert (codes != state.absmax).float().mean() < 0.02
    # NF4 codes: chosen with the exact absmax, as bnb does
    q = mfqat.quantize(w, "nf4_dq", 64)
    assert torch.equal(q.codes, nf4)
    assert torch.equal(q.scales.flatten(), double_dequantize_absmax(codes, group_max, offset))


def test_double_quant_ties_go_to_the_lower_entry():
    """Centred values exactly on a midpoint between two dynamic-map entries get the lower one."""
    book = dynamic_code_book()
    k = torch.arange(0, 255)
    lo, hi = book[k].double(), book[k + 1].double()
    mids = ((lo + hi) / 2).float()
    exact = mids.double() - lo == hi - mids.double()   # midpoints representable in float32
    assert exact.sum() > 50
    assert torch.equal(dynamic_code_index(mids).long()[exact], k[exact])
    above = torch.nextafter(mids, torch.tensor(2.0))
    assert torch.equal(dynamic_code_index(above).long()[exact], k[exact] + 1)


def test_mlx_refuses_bnb_formats():
    pytest.importorskip("mlx.core")
    import mlx.core as mx

    from mfqat.mlx import quant as mq
    with pytest.raises(ValueError, match="nf4_dq.*PyTorch only"):
        mq.quantize(mx.zeros((2, 64)), "nf4_dq")
