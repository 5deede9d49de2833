"""Launch configuration of the GLA Triton kernels (:class:`GLALaunch`, :func:`gla_launch`).

What chose the defaults: ``docs/design/kernels.md`` (gated linear attention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.launching import block

BT = 64  # chunk length (tokens): lintime.ops.segments.BT


@dataclass(frozen=True)
class GLALaunch:
    """Tiles and launch settings of the GLA kernels for one ``(K, V, dtype)``.

    ``one_level``: in-chunk products as one matmul per chunk and K-block where the gates span < 40
    nats (:mod:`lintime.ops.gla.triton.kernels`), else the secondary tiling;
    ``prep_bk``: K-block of the prep kernel (``A``, gated inputs);
    ``walk``: ``(BK, BV)`` state tile ``[all K, BV]`` of the output and dv walks;
    ``dqkg``: ``(BK, BV)`` of the dq/dk/dg kernel (a K-block per program, V walked in blocks);
    ``*_warps``, ``*_stages``: ``num_warps``, ``num_stages``; ``dqkg_maxnreg``: register cap per
    thread of the dq/dk/dg kernel (0 = none).
    """

    one_level: bool
    prep_bk: int
    walk: tuple[int, int]
    walk_warps: int
    walk_stages: int
    dqkg: tuple[int, int]
    dqkg_warps: int
    dqkg_maxnreg: int
    prep_warps: int = 4  # prep kernel: 8 warps were slower
    prep_stages: int = 1
    dqkg_stages: int = 2

    def walk_launch(self) -> dict:
        return dict(num_warps=self.walk_warps, num_stages=self.walk_stages)

    def prep_launch(self) -> dict:
        return dict(num_warps=self.prep_warps, num_stages=self.prep_stages)

    def dqkg_launch(self) -> dict:
        out = dict(num_warps=self.dqkg_warps, num_stages=self.dqkg_stages)
        if self.dqkg_maxnreg:
            out["maxnreg"] = self.dqkg_maxnreg
        return out


def _warps(rows: int, cols: int) -> int:
    # 8 warps keep [64, K] tiles out of local memory; 4 warps on the K = 128, V = 256 tiles gave an illegal
    # memory access and a wrong dq (cause unknown), so large tiles always get 8
    return 8 if rows * cols >= 2048 else 4


def walk_tile(K: int, V: int) -> tuple[int, int]:
    """``(BK, BV)``: the ``[all K, BV]`` state tile of the output and dv walks: 8192 fp32 elements (32 KB);
    [128, 128] at K = 128, which still fits the registers without spilling and, with 2 stages, beat [128, 64]
    tiles with 1.  Not cached: ``torch.compile`` traces it."""
    BKf, BVf = block(K), block(V)
    return BKf, min(BVf, max(16, (16384 if BKf == 128 else 8192) // BKf))


@functools.lru_cache(maxsize=64)
def gla_launch(K: int, V: int, dtype: torch.dtype) -> GLALaunch:
    """The shipped launch configuration of a call with ``K``-wide keys and ``V``-wide values."""
    BKf, BVf = block(K), block(V)
    walk = walk_tile(K, V)
    # dq/dk/dg: K-blocks of 32 spill a little at K = 128, V = 256 (16 not at all) but recompute do v^T half as
    # often as 16, which is faster
    dqkg = (min(32, BKf), min(64, BVf))
    # bf16: one level, much faster than the secondary tiling; fp16 (range 65504) and fp32 (exact exponents) keep
    # two levels
    one_level = dtype == torch.bfloat16
    return GLALaunch(
        one_level=one_level,
        prep_bk=min(32, BKf),  # 64 spills at K = 128
        walk=walk,
        walk_warps=_warps(*walk),
        # 2 stages up to 128-wide keys; [256, BV] tiles never compiled with 2 (shared memory)
        walk_stages=2 if walk[0] <= 128 else 1,
        dqkg=dqkg,
        dqkg_warps=_warps(BT, max(dqkg)),
        # 128 registers (two 8-warp programs per SM) with one level; the secondary tiling spills under the cap
        # and is slower with it, so no cap there
        dqkg_maxnreg=128 if one_level else 0,
    )
