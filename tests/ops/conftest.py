import pytest


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
