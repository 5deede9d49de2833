"""Checks shared by the static-offsets tests (``tests/ops/*/test_*_static.py``): no host read, no plan cache
(importable as ``host_reads``: pytest puts tests/ on the path)."""

from __future__ import annotations

from lintime.ops.utils import is_static, segments


def refuse_plan_cache_for_static(monkeypatch):
    """From here on, consulting the per-tensor plan cache with a static ``cu_seqlens`` fails the test."""
    real = segments.packed_cache

    def refuse(cu, key):
        assert not is_static(cu), "packed_cache consulted for a static cu_seqlens"
        return real(cu, key)

    monkeypatch.setattr(segments, "packed_cache", refuse)


def assert_no_host_read(c):
    """``c`` (:func:`lintime.generation.profiling.count_host_syncs`) saw the calls, and no host sync or host-to-device
    copy among them."""
    assert c.ops > 0  # the counter saw the calls
    assert (c.total, c.h2d) == (0, 0), f"host syncs {dict(c.counts)}, host->device tensors {c.h2d}"
