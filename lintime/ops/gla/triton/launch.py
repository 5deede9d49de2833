"""GLA's launch configuration: :class:`GLALaunch` and :func:`default_launch`.

What chose the defaults: ``docs/design/kernels.md`` (gated linear attention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from lintime.ops.utils.launching import LaunchConfig, block

BT = 64  # chunk length (tokens): lintime.ops.utils.segments.BT


@dataclass(frozen=True)
class GLALaunch(LaunchConfig):
    """Tiles and launch settings of the GLA kernels (:mod:`.kernels`).  Field defaults are the GPU's at ``K = 128,
    V = 256`` in bf16; :func:`default_launch` fits them to a shape and dtype.

    The output and dv walks hold a ``[walk_bk = all K, walk_bv]`` state tile; the dq/dk/dg kernel runs one
    ``dqkg_bk`` K-block per program and walks ``V`` in ``dqkg_bv`` steps; ``*_warps``, ``*_stages``: ``num_warps``,
    ``num_stages``."""

    # in-chunk products as one matmul where a K-block's gates span < 40 nats (else the secondary tiling): much
    # faster; bf16 only, fp16's range and fp32's exact exponents keep two levels
    one_level: bool = True
    prep_bk: int = 32  # prep kernel's K-block: 64 spills at K = 128
    prep_warps: int = 4  # prep kernel: 8 warps were slower
    prep_stages: int = 1  # the prep kernel reads each chunk once: nothing to pipeline
    walk_bk: int = 128  # output / dv walks: all of K per program (the state tile's rows)
    walk_bv: int = 128  # [128, 128] still fits the registers without spilling and beat [128, 64]
    walk_warps: int = 8  # tiles of 2048 elements or more always get 8 (:func:`_warps`)
    walk_stages: int = 2  # with the [128, 128] tiles 2 stages beat 1; [256, BV] tiles never compiled with 2
    # dq/dk/dg K-block: 32 spills a little at K = 128, V = 256 (16 not at all) but recomputes do v^T half as
    # often as 16, which is faster
    dqkg_bk: int = 32
    dqkg_bv: int = 64  # dq/dk/dg V step
    dqkg_warps: int = 8  # tiles of 2048 elements or more always get 8 (:func:`_warps`)
    dqkg_stages: int = 2  # the next V step's loads overlap this one's products
    # register cap per thread of the dq/dk/dg kernel (0: none): 128 lets two 8-warp programs share an SM with one
    # level; the secondary tiling spills under the cap and is slower with it
    dqkg_maxnreg: int = 128

    @property
    def walk(self) -> tuple[int, int]:
        return self.walk_bk, self.walk_bv

    @property
    def dqkg(self) -> tuple[int, int]:
        return self.dqkg_bk, self.dqkg_bv

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
    """``(walk_bk, walk_bv)``: the ``[all K, BV]`` state tile of the output and dv walks, 8192 fp32 elements (32 KB),
    16384 at ``K = 128``.  Not cached: ``torch.compile`` traces it (the automatic segment length reads it)."""
    BKf, BVf = block(K), block(V)
    return BKf, min(BVf, max(16, (16384 if BKf == 128 else 8192) // BKf))


@functools.lru_cache(maxsize=64)
def default_launch(K: int, V: int, dtype: torch.dtype) -> GLALaunch:
    """The launch configuration of a call with ``K``-wide keys, ``V``-wide values and ``dtype`` inputs (cached: part
    of a call's host time)."""
    BKf, BVf = block(K), block(V)
    walk_bk, walk_bv = walk_tile(K, V)
    dqkg_bk, dqkg_bv = min(32, BKf), min(64, BVf)
    one_level = dtype == torch.bfloat16
    return GLALaunch(
        one_level=one_level,
        prep_bk=min(32, BKf),
        walk_bk=walk_bk,
        walk_bv=walk_bv,
        walk_warps=_warps(walk_bk, walk_bv),
        walk_stages=2 if walk_bk <= 128 else 1,
        dqkg_bk=dqkg_bk,
        dqkg_bv=dqkg_bv,
        dqkg_warps=_warps(BT, max(dqkg_bk, dqkg_bv)),
        dqkg_maxnreg=128 if one_level else 0,
    )
