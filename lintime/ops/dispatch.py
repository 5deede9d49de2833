"""The one place that chooses how an op is computed.

Every op family registers its implementations by name (``naive``, ``chunk``, ``recurrent``,
later ``triton``) and calls :func:`select` with the caller's ``backend=`` override.  With no
override the choice depends only on the inputs (device, length) -- there is no module-level
switch to flip.

Automatic rule:

* a CUDA tensor and a registered ``triton`` implementation -> ``triton``;
* a single decoding step (``T == 1``) and a registered ``recurrent`` implementation -> ``recurrent``;
* otherwise ``chunk`` (the chunked PyTorch form, O(T*C) memory, any device).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

BACKENDS = ("naive", "chunk", "recurrent", "triton")


def triton_available(device: torch.device) -> bool:
    """True when Triton kernels can run for tensors on ``device``."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# implementation tables of families whose Triton form is not registered because Triton is not installed
_WITHOUT_TRITON: list[Mapping] = []

NO_TRITON = ("Triton is not installed here (a CPU build of PyTorch does not bring it): pip install triton, "
             "or pip install -e '.[gpu]' in a checkout; every op also runs as chunked PyTorch on any device")


def require_triton(op: str) -> None:
    """Raise one clear ``ValueError`` when ``backend='triton'`` is asked for and Triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ValueError(f"{op}: backend 'triton' needs Triton. {NO_TRITON}") from None


def register_triton(impls: dict, load: Callable[[], Callable]) -> None:
    """Register ``impls["triton"]`` when Triton is installed: a function that calls ``load()`` and then
    what it returns.  ``load`` holds the family's literal ``from ... import`` of its Triton entry, so
    the kernel modules are imported on first use (Triton decides interpreter vs compiler when a kernel
    module is imported: ``TRITON_INTERPRET``) and ``torch.compile`` can trace the import (it cannot
    trace ``importlib``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        _WITHOUT_TRITON.append(impls)
        return

    def triton_impl(*args, **kwargs):
        return load()(*args, **kwargs)

    impls["triton"] = triton_impl


def select(op: str, backend: str | None, impls: Mapping[str, Callable], x: torch.Tensor) -> Callable:
    """Pick the implementation of ``op`` for input ``x`` (``[B, T, H, D]``).

    ``backend`` is the explicit override (``None`` = automatic).  Asking for a backend the op
    does not have raises ``ValueError`` naming the ones it has.
    """
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"{op}: unknown backend {backend!r}; choose from {BACKENDS}")
        if backend == "triton" and any(impls is m for m in _WITHOUT_TRITON):
            require_triton(op)
        if backend not in impls:
            raise ValueError(f"{op}: backend {backend!r} is not implemented; available: {sorted(impls)}")
        return impls[backend]
    if "triton" in impls and triton_available(x.device):
        return impls["triton"]
    if "recurrent" in impls and x.shape[1] == 1:
        return impls["recurrent"]
    return impls["chunk"]
