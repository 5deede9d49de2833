"""Launch configuration of the GLA Triton kernels (:class:`GLALaunch`, :func:`gla_launch`).

Times below: fwd+bwd through the launchers at T = 8k, H = 4, K = 128, V = 256, bf16, H200, 2026-11-22.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.kernel_launch import block

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
    prep_warps: int = 4  # 0.74 -> 0.44 ms against 8 warps (prep kernel alone, H200, 2026-11-22)
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
    # 8 warps keep [64, K] tiles out of local memory; 4 faulted (illegal address) on the K = 128, V = 256
    # tiles and gave a wrong dq (H200, Triton 3.6, 2026-11-22)
    return 8 if rows * cols >= 2048 else 4


def walk_tile(K: int, V: int) -> tuple[int, int]:
    """``(BK, BV)``: the ``[all K, BV]`` state tile of the output and dv walks: 8192 fp32 elements (32 KB);
    [128, 128] at K = 128 (238 registers, no spills on sm_90a): 2.47 -> 2.22 ms with 2 stages against
    [128, 64] and 1 stage (H200, 2026-11-22).  Not cached: ``torch.compile`` traces it."""
    BKf, BVf = block(K), block(V)
    return BKf, min(BVf, max(16, (16384 if BKf == 128 else 8192) // BKf))


@functools.lru_cache(maxsize=64)
def gla_launch(K: int, V: int, dtype: torch.dtype) -> GLALaunch:
    """The shipped launch configuration of a call with ``K``-wide keys and ``V``-wide values."""
    BKf, BVf = block(K), block(V)
    walk = walk_tile(K, V)
    # dq/dk/dg: K-blocks of 32 spill 620 B at K = 128, V = 256 (16: none; 64: 1460 B) but recompute
    # do v^T half as often as 16: 1.31 against 1.86 ms (H200, 2026-11-22)
    dqkg = (min(32, BKf), min(64, BVf))
    # bf16: one level 2.26 -> 1.48 ms; fp16 (range 65504) and fp32 (exact exponents) keep two levels
    one_level = dtype == torch.bfloat16
    return GLALaunch(
        one_level=one_level,
        prep_bk=min(32, BKf),  # 64 spills at K = 128 (sm_90a ptxas, 2026-11-22)
        walk=walk,
        walk_warps=_warps(*walk),
        # 2 stages up to 128-wide keys; [256, BV] tiles never compiled with 2 (shared memory)
        walk_stages=2 if walk[0] <= 128 else 1,
        dqkg=dqkg,
        dqkg_warps=_warps(BT, max(dqkg)),
        # 128 registers (two 8-warp programs per SM): 1.47 -> 1.31 ms with one level; the secondary
        # tiling spills under the cap (2.26 -> 2.81 ms), so no cap there (H200, 2026-11-22)
        dqkg_maxnreg=128 if one_level else 0,
    )
