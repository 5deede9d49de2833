"""The GLU activation's launch configuration: :class:`GLULaunch` and :func:`default_launch`.

What chose the defaults: ``docs/design/kernels.md`` (GLU activation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lintime.ops.utils.launching import LaunchConfig, interpreting


@dataclass(frozen=True)
class GLULaunch(LaunchConfig):
    """Launch configuration of the GLU kernels (:mod:`.kernels`): ``bn x be`` tiles of a bandwidth-bound pass."""

    bn: int = 8  # rows of a tile: long contiguous row segments (the heads kernel's measured u / v tile)
    be: int = 512  # columns of a tile: the heads kernel's u / v tile width; other tiles not tried
    warps: int = 4  # per program: the heads kernel's, for the same tile
    # row tiles per backward program with a bias (cdiv(N, bn rb) partial rows of dbias): fewer partial rows to fold
    # than 4-16; 64 was slower
    rb: int = 32


def default_launch(device: torch.device) -> GLULaunch:
    """The GPU's :class:`GLULaunch`; under the interpreter 16 x 16 tiles, two per backward program with a bias, so
    small test shapes cross several tiles and partial-sum rows, with partial ones."""
    if device.type == "cpu" and interpreting():
        return GLULaunch(16, 16, 1, rb=2)
    return GLULaunch()
