"""The norm's launch configuration: :class:`NormLaunch` and :func:`default_launch`.

What chose the defaults: ``docs/design/kernels.md`` (norms).
"""

from __future__ import annotations

from dataclasses import dataclass

from lintime.ops.utils.launching import LaunchConfig


@dataclass(frozen=True)
class NormLaunch(LaunchConfig):
    """Launch configuration of the norm kernels (:mod:`.kernels`): ``G`` persistent programs walk ``[BM, BD]`` tiles of
    ``BM`` rows (``BD``: ``D`` rounded up to a power of two)."""

    # Elements of a tile (BM = tile_elems // BD rows, at least 1): several rows in flight per program beat one row,
    # and larger tiles were no faster at the models' widths
    tile_elems: int = 2048
    # BM fixed instead of taken from tile_elems (a power of two; 1: one row per iteration; 0: from tile_elems): for
    # A/B runs and tests.
    rows_per_tile: int = 0
    # Below this row width (BD) the backward walks one row per iteration: for narrow rows one warp per row beats
    # multi-row tiles
    backward_tiles_from: int = 512
    # Tile elements per warp (warps = BM * BD / this, 1 to max_warps): the tile2048 launch above (4 warps at D = 768).
    elems_per_warp: int = 512
    # A one-row program's elements per warp: 4 warps for a 1024-wide row, 1 for a 256-wide one (the launch measured).
    row_elems_per_warp: int = 256
    max_warps: int = 16  # the widest program: 512 threads, 32 values each of a 16384-wide row (as the one-row launch)
    # Persistent programs per SM; 0: as many as one SM holds at once by the compiled kernel's registers, threads and
    # shared memory (one wave: no SM ends on a lone program of a second); not measured yet.
    programs_per_sm: int = 0
    max_bd: int = 16384  # the widest row held in registers (D up to 16384)

    def __post_init__(self):
        for name in ("tile_elems", "rows_per_tile", "backward_tiles_from", "elems_per_warp", "row_elems_per_warp",
                     "max_warps"):
            v = getattr(self, name)
            if (v != 0 or name != "rows_per_tile") and (v < 1 or v & (v - 1)):
                raise ValueError(f"NormLaunch.{name} must be a power of two >= 1, got {v}")
        if self.programs_per_sm < 0:
            raise ValueError(f"NormLaunch.programs_per_sm must be >= 0, got {self.programs_per_sm}")


LAUNCH = NormLaunch()  # what every call takes; tests and sweeps replace it to run other launches


def default_launch() -> NormLaunch:
    """The launch of every call, on every device: :data:`LAUNCH` (the interpreter's small grids come from
    :func:`lintime.modules.norm.triton.ops.max_programs`)."""
    return LAUNCH
