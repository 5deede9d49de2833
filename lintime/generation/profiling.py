"""Counting the host work of a model call: device->host syncs and PyTorch calls.

:func:`count_host_syncs` is a context manager (a ``TorchFunctionMode``) that sees every PyTorch
function / ``Tensor`` method called from Python while it is active and counts

* **syncs** -- calls that make the host wait for the device on CUDA: reading a value
  (``item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``, ``cpu``,
  ``numpy``) and ops whose output size depends on values (``nonzero``, ``masked_select``,
  indexing with a boolean tensor, ``unique``, ``repeat_interleave`` with tensor repeats);
* **h2d** -- tensors built from host data (``torch.tensor`` / ``as_tensor`` of Python numbers or
  lists): a host->device copy per call on CUDA;
* **ops** -- every PyTorch call made from Python (the eager dispatcher overhead scales with it).

On the CPU nothing actually waits; what the counter gives is the number of such calls, which is
what costs a synchronisation on CUDA.  Used by ``tests/generation/test_decode_syncs.py`` (pins
the syncs of one decoded token per family).
"""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode

_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere"}
_FROM_HOST = {"tensor", "as_tensor"}


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _bool_index(idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostSyncCounter(TorchFunctionMode):
    """See the module docstring.  ``counts``: ``Counter`` of sync kinds (``'item'``,
    ``'tolist'``, ...); ``total``: their sum; ``h2d``: host->device tensor constructions;
    ``ops``: PyTorch calls."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self.h2d = 0
        self.ops = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        self.ops += 1
        if name in _READS or name in _DATA_DEPENDENT:
            self.counts[name] += 1
        elif name == "__getitem__" and len(args) > 1 and _bool_index(args[1]):
            self.counts["bool_index"] += 1
        elif name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and kwargs.get("output_size") is None:
            self.counts["repeat_interleave"] += 1
        elif name in _FROM_HOST and args and not isinstance(args[0], torch.Tensor):
            self.h2d += 1
        return func(*args, **kwargs)


def count_host_syncs() -> HostSyncCounter:
    """``with count_host_syncs() as c: ...`` then read ``c.total``, ``c.counts``, ``c.h2d``,
    ``c.ops`` (see the module docstring)."""
    return HostSyncCounter()


__all__ = ["HostSyncCounter", "count_host_syncs"]
