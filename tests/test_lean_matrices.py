"""mfqat.export.lean_matrices: the refine student's embedding and head without their whole float32 matrices give
autograd's values and gradients bit for bit (issue 44)."""
import pytest
import torch
import torch.nn.functional as F

from mfqat.export.lean_matrices import LeanMatrices, marker
from mfqat.export.refine import _Groups
from mfqat.quant.derive import derive_affine


def _learner(rows=96, cols=64, fmt="affine4", seed=0):
    g = torch.Generator().manual_seed(seed)
    learner = _Groups(derive_affine(torch.randn(rows, cols, generator=g), fmt, 32))
    with torch.no_grad():  # learned values away from zero, so the scales' rounding is exercised
        learner.a.uniform_(-0.05, 0.05, generator=g)
        learner.c.uniform_(-0.05, 0.05, generator=g)
    return learner


def _grads(learner):
    out = [learner.a.grad.clone(), learner.c.grad.clone()]
    learner.a.grad = learner.c.grad = None
    return out


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_a_lean_embedding_equals_embedding_bit_for_bit(padding_idx):
    learner = _learner()
    ids = torch.tensor([[3, 5, 3, 95, 0, 5, 5, 7], [95, 95, 1, 3, 2, 2, 9, 3]])  # repeats, the padding row
    up = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    whole = F.embedding(ids, learner.weight(), padding_idx)
    (whole * up).sum().backward()
    expected = _grads(learner)
    m = marker(learner.shape)
    with LeanMatrices({id(m): learner}):
        lean = F.embedding(ids, m, padding_idx)
    (lean * up).sum().backward()
    assert torch.equal(lean, whole)
    for got, want in zip(_grads(learner), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["affine4", "affine3", "affine8"])
def test_a_lean_head_equals_linear_to_float32_rounding(fmt, monkeypatch):
    from mfqat.export import lean_matrices

    monkeypatch.setattr(lean_matrices, "_ROWS_ELEMENTS", 5 * 64)  # 5 rows a chunk: a short last chunk
    learner = _learner(fmt=fmt)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    up = torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(3))
    whole = F.linear(x, learner.weight())
    (whole * up).sum().backward()
    expected = _grads(learner) + [x.grad.clone()]
    x.grad = None
    m = marker(learner.shape)
    with LeanMatrices({id(m): learner}):
        lean = F.linear(x, m)
    (lean * up).sum().backward()
    assert torch.equal(lean, whole) and torch.equal(x.grad, expected[2])  # both formed whole, as linear forms them
    for got, want in zip(_grads(learner), expected[:2]):
        # the matrix's gradient in 5-row chunks: the same sums, but a BLAS may reduce a 5-row product in another
        # order than the whole one (an AMD EPYC's did, by ~1e-6 relative), so float32 rounding apart
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_a_marker_used_any_other_way_fails_loudly():
    learner = _learner()
    m = marker(learner.shape)
    with LeanMatrices({id(m): learner}), pytest.raises(ValueError, match=r"uses a lean embedding / head matrix \(96, 64\)"):
        torch.randn(4, 96) @ m  # on the meta device this would give a meta tensor, not an error
    with LeanMatrices({id(m): learner}):
        assert m.dtype == torch.float32 and m.shape == (96, 64) and m.size(0) == 96  # metadata is fine
    with LeanMatrices({id(m): learner}), pytest.raises(ValueError, match="max_norm"):
        F.embedding(torch.tensor([1]), m, max_norm=1.0)
