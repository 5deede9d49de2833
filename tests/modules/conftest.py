import pytest
import torch


@pytest.fixture(autouse=True)
def _poison(poison_empty):
    """Every modules test runs with NaN-poisoned fresh allocations."""
    yield


@pytest.fixture
def norm_wrapping_rows():
    """``rows(D) -> (BM, N)`` under the norm kernels' current launch: rows per tile ``BM`` of a long call of width
    ``D``, and a row count past twice the most programs x ``BM`` that is no multiple of ``BM`` (every program walks
    several tiles, the last tile partly past the rows: its tail masked)."""
    from lintime.modules.norm.triton import ops

    def rows(D):
        _, BM, warps, _ = ops.tiling(1 << 20, D)
        G = ops.max_programs(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu"), warps)
        N = 2 * G * BM + BM // 2 + 1
        assert ops.tiling(N, D)[1] == BM and N > G * BM and (BM == 1 or N % BM)
        return BM, N

    return rows
