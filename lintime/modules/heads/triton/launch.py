"""The heads op's launch configuration: :class:`HeadsLaunch` and :func:`default_launch`.

What chose the defaults: ``docs/design/kernels.md`` (the heads op).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lintime.ops.utils.launching import LaunchConfig, interpreting


@dataclass(frozen=True)
class HeadsLaunch(LaunchConfig):
    """Launch configuration of the heads kernels (:mod:`.kernels`).  Defaults: the GPU's, the fastest launch at
    FLASH's shapes."""

    bt: int = 8  # rows of a u / v tile: long contiguous row segments; 4 x 1024, 16 x 512, 32 x 128 no faster
    be: int = 512  # columns of a u / v tile
    bth: int = 8  # rows per heads block: the per-row terms stay in registers; 16- or 32-row blocks were slower
    warps: int = 4  # per program; 2 or 8 warps no faster
    # heads blocks per backward heads program (its rows: one partial row of dgamma, dbeta, the z columns' bias):
    # more blocks a program, fewer partial rows to write and fold; 4 or 8 were slower
    rb: int = 16
    tr: int = 16  # bt-row tiles per backward tile program (one partial row of the u, v columns' bias): 32 no faster


def default_launch(device: torch.device) -> HeadsLaunch:
    """The GPU's :class:`HeadsLaunch`; under the interpreter 16 x 16 tiles and 16-row heads blocks, two per backward
    program, so that small test shapes cross several row blocks, ``u`` / ``v`` tiles and partial-sum rows, with
    partial ones."""
    if device.type == "cpu" and interpreting():
        return HeadsLaunch(16, 16, 16, 1, rb=2, tr=2)
    return HeadsLaunch()
