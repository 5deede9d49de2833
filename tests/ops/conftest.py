import pytest
import torch


@pytest.fixture(autouse=True)
def _poison(poison_empty):
    """Every ops test runs with NaN-poisoned fresh allocations."""
    yield


@pytest.fixture
def impl_calls(monkeypatch):
    """``impl_calls(family_module, backend)``: wrap that family's registered implementation so every
    call is counted; returns the list the calls are appended to (the dispatch tests assert on it)."""

    def spy(module, backend):
        calls = []
        impl = module._IMPLS[backend]
        monkeypatch.setitem(module._IMPLS, backend, lambda *a, **kw: calls.append(1) or impl(*a, **kw))
        return calls

    return spy


@pytest.fixture
def norm_wrapping_rows():
    """``rows(D) -> (BM, N)`` under the norm kernels' current launch: rows per tile ``BM`` of a long call of width
    ``D``, and a row count past twice the most programs x ``BM`` that is no multiple of ``BM`` (every program walks
    several tiles, the last tile partly past the rows: its tail masked)."""
    from lintime.ops.norm.triton import ops

    def rows(D):
        _, BM, warps, _ = ops.tiling(1 << 20, D)
        G = ops.max_programs(torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu"), warps)
        N = 2 * G * BM + BM // 2 + 1
        assert ops.tiling(N, D)[1] == BM and N > G * BM and (BM == 1 or N % BM)
        return BM, N

    return rows
