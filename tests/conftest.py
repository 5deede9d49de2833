"""Shared test fixtures and the ``cuda`` marker (skipped without CUDA).

``poison_empty`` (autouse in tests/ops and tests/modules) makes every fresh allocation through ``torch.empty``,
``torch.empty_like`` and ``Tensor.new_empty`` come back filled with NaN (floating dtypes), so
an op that reads memory it never wrote fails its comparison instead of passing by luck
(fla's conftest does the same).
"""

from __future__ import annotations

import os

import pytest
import torch

# Without CUDA, Triton kernels run in Triton's CPU interpreter.  Triton reads the
# variable when a kernel module is imported, so it is set here, in the root conftest, before any
# test module (models, generation, ...) can import lintime.ops and with it the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# hypothesis: deterministic, CI-sized
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "lintime", max_examples=int(os.environ.get("LINTIME_HYPOTHESIS_EXAMPLES", "12")),
        deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("lintime")
except ImportError:  # hypothesis is in the `test` extra
    pass


# One intra-op thread per test process: the suites run thousands of tiny ops, where a second
# thread costs more in hand-off than it gains (measured: several-fold slower on the 2-core CI
# machine whenever anything else runs); parallelism comes from pytest-xdist workers instead.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.cuda`` means "needs a CUDA device": such tests are skipped without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    """Every test starts on one intra-op thread, whatever the test before it set."""
    torch.set_num_threads(1)
    yield


def _poisoned(fn):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out.fill_(float("nan"))
        return out

    return wrapper


@pytest.fixture
def poison_empty(monkeypatch):
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    monkeypatch.setattr(torch.Tensor, "new_empty", _poisoned(torch.Tensor.new_empty))
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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
