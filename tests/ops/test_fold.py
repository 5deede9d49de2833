"""fold_rows (column sums of fp32 partial rows, the second stage of the bias / gain gradients): against an fp64 sum,
one to four buffers of different widths and row counts in one launch, into views, row counts around the row step, no rows; deterministic.
Runs the kernel through the Triton interpreter on the CPU (4-row steps, 16-column tiles), compiled on CUDA."""

import pytest
import torch

triton = pytest.importorskip("triton")

from lintime.ops.fold import fold_rows  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("P", [1, 3, 4, 9, 130])
def test_fold_rows_matches_fp64_sum(P):
    g = torch.Generator().manual_seed(P)
    parts = [torch.randn(P, c, generator=g, dtype=torch.float64).float().to(DEV) for c in (37, 5, 64)]
    outs = fold_rows(parts)
    assert len(outs) == 3
    for p, o in zip(parts, outs):
        assert o.shape == (p.shape[1],) and o.dtype == torch.float32
        ref = p.double().sum(0)
        # fp32 accumulation of P terms: a few ulps of the sum of magnitudes
        bound = 4 * P * torch.finfo(torch.float32).eps * p.double().abs().sum(0) + 1e-30
        assert ((o.double() - ref).abs() <= bound).all()


def test_fold_rows_row_counts_differ_into_views():
    """Four buffers of different row counts (one empty) in one launch, written into views of one output."""
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(P, c, generator=g).to(DEV) for P, c in ((9, 20), (3, 20), (0, 4), (130, 12))]
    out = torch.full((56,), float("nan"), device=DEV)
    views = [out[0:20], out[20:40], out[40:44], out[44:56]]
    assert fold_rows(parts, views) is views
    for p, v in zip(parts, views):
        torch.testing.assert_close(v.double(), p.double().sum(0), rtol=1e-5, atol=1e-5)


def test_fold_rows_one_buffer_and_determinism():
    p = torch.randn(77, 300, generator=torch.Generator().manual_seed(1)).to(DEV)
    a, = fold_rows([p])
    b, = fold_rows([p])
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), p.double().sum(0), rtol=1e-5, atol=1e-4)


def test_fold_rows_no_rows_and_errors():
    outs = fold_rows([torch.empty(0, 7, device=DEV), torch.empty(0, 3, device=DEV)])
    assert [tuple(o.shape) for o in outs] == [(7,), (3,)] and all((o == 0).all() for o in outs)
    with pytest.raises(ValueError, match="1 to 4"):
        fold_rows([])
    with pytest.raises(ValueError, match="1 to 4"):
        fold_rows([torch.zeros(2, 2, device=DEV)] * 5)
    with pytest.raises(ValueError, match="unit stride"):
        fold_rows([torch.zeros(2, 3, device=DEV)], [torch.zeros(3, 2, device=DEV)[:, 0]])
