"""The fused loss's launch configuration: :class:`CrossEntropyLaunch` and :func:`default_launch`.

What chose the defaults: ``docs/design/kernels.md`` (the fused loss).
"""

from __future__ import annotations

from dataclasses import dataclass

from lintime.ops.utils.launching import LaunchConfig


@dataclass(frozen=True)
class CrossEntropyLaunch(LaunchConfig):
    """Launch configuration of the per-row kernel (:func:`.kernels.ce_rows_kernel`): one program per row."""

    # Columns per block: two sweeps of 8192-column blocks (the second mostly from L2) beat a whole row kept in
    # registers (Liger-Kernel's launch) and narrower or wider blocks
    block_v: int = 8192
    num_warps: int = 16  # warps per row: the launch measured with 8192-column blocks


def default_launch() -> CrossEntropyLaunch:
    """The launch of every call (the same on every device; the interpreter takes it too)."""
    return CrossEntropyLaunch()
