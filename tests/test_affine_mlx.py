"""mfqat's affine{k} formats equal ``mx.quantize(w, group_size, bits)`` (mode affine) bit for bit:
packed codes, scales and biases, on random and adversarial matrices, every MLX bit width and group
size, float32 and bfloat16 inputs; the MLX-runtime twin (mfqat.mlx.quant) gives the same."""
import numpy as np
import pytest
import torch

import mfqat
from mfqat.quant.packing import pack_codes

mx = pytest.importorskip("mlx.core")

from mfqat.mlx import quant as mq  # noqa: E402

DTYPES = [(torch.float32, mx.float32), (torch.bfloat16, mx.bfloat16)]


def matrices(cols: int = 256) -> torch.Tensor:
    """Rows: random at many magnitudes and offsets, constant groups, zeros of both signs, tiny ranges,
    one-sided groups, exact ties, large magnitudes (the range overflows float32), subnormals."""
    g = torch.Generator().manual_seed(17)
    rows = [torch.randn(cols, generator=g) * 10.0 ** e + torch.randn(1, generator=g) * 10.0 ** o
            for e, o in ((0, -9), (-6, 0), (3, 3), (-12, -11), (30, 30))]
    rows += [torch.zeros(cols), torch.full((cols,), -0.0), torch.full((cols,), 0.3), torch.full((cols,), -5.0),
             1.0 + torch.randn(cols, generator=g) * 1e-6, torch.randn(cols, generator=g).abs(),
             -torch.randn(cols, generator=g).abs(), (torch.arange(cols) % 16 - 8) / 4.0,
             torch.randn(cols, generator=g) * 2e38, torch.randn(cols, generator=g) * 1e-40,
             torch.where(torch.arange(cols) % 32 == 0, 1.0, -0.0)]
    return torch.stack(rows).float()


def _mlx_reference(x: torch.Tensor, dtype, group: int, bits: int):
    wq, scales, biases = mx.quantize(mx.array(x.float().numpy()).astype(dtype), group_size=group, bits=bits)
    return np.array(wq), np.array(scales.astype(mx.float32)), np.array(biases.astype(mx.float32))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_affine_equals_mlx_quantize(bits, group):
    for source in (matrices(), torch.randn(16, 512, generator=torch.Generator().manual_seed(bits))):
        for tdt, mdt in DTYPES:
            x = source.to(tdt)
            words, scales, biases = _mlx_reference(x, mdt, group, bits)
            q = mfqat.quantize(x, f"affine{bits}", group)
            ours = pack_codes(q.codes, bits).numpy().view(np.uint32)
            where = f"affine{bits} g{group} {tdt}"
            assert (ours != words).sum() == 0, f"{where}: packed codes differ"
            np.testing.assert_array_equal(q.scales.numpy(), scales, err_msg=f"{where}: scales")
            np.testing.assert_array_equal(q.biases.numpy(), biases, err_msg=f"{where}: biases")
            codes, mscales, mbiases = mq.quantize(mx.array(x.float().numpy()).astype(mdt), f"affine{bits}", group)
            assert np.array_equal(np.array(codes), q.codes.numpy()), f"{where}: MLX twin codes"
            np.testing.assert_array_equal(np.array(mscales), scales, err_msg=f"{where}: MLX twin scales")
            np.testing.assert_array_equal(np.array(mbiases), biases, err_msg=f"{where}: MLX twin biases")


def test_affine_dequantizes_like_mlx():
    """mfqat's dequantization (and fake_quantize) equals mx.dequantize of MLX's own quantization, in
    float32 and in bfloat16, where MLX computes code * scale + bias in bfloat16 arithmetic."""
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3)) * 3 + 1
    for tdt, mdt in DTYPES:
        for bits in (2, 4, 8):
            wq, s, b = mx.quantize(mx.array(x.numpy()).astype(mdt), group_size=64, bits=bits)
            want = np.array(mx.dequantize(wq, s, b, group_size=64, bits=bits).astype(mx.float32))
            got = mfqat.quantize(x.to(tdt), f"affine{bits}", 64).dequantize(torch.float32).numpy()
            np.testing.assert_array_equal(got, want, err_msg=f"affine{bits} {tdt}")
            fq = mfqat.fake_quantize(x.to(tdt), f"affine{bits}", 64).float().numpy()
            np.testing.assert_array_equal(fq, want, err_msg=f"fake_quantize affine{bits} {tdt}")
