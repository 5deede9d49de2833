"""Linear attention's launch configuration: :class:`LinearLaunch` and :func:`default_launch`.

What chose the defaults: ``docs/design/kernels.md`` (linear attention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lintime.ops.utils.launching import LaunchConfig, block

TILE = 4096  # fp32 elements of the state tile one walk program holds (16 KB: [64, 64] at K = V = 64, in registers)


@dataclass(frozen=True)
class LinearLaunch(LaunchConfig):
    """Tiles ``(*_bk, *_bv)`` and launch settings of the linear-attention walks (:mod:`.kernels`).  Field defaults
    are the GPU's at ``K = V = 64``; :func:`default_launch` fits them to a shape.

    ``fwd``: ``[all K, BV]`` (output walk); ``dq``: ``[BK, all V]``; ``fused``: ``[all K, all V]``, the dk/dv walk in
    one launch when ``fuse``, else ``dk`` (``[BK, all V]``) and ``dv`` (``[all K, BV]``) in two; every walk runs
    ``num_warps`` warps, ``num_stages`` stages."""

    fwd_bk: int = 64  # all of K: the output walk's state tile holds TILE elements
    fwd_bv: int = 64
    dq_bk: int = 64  # all of V per program: the dq walk's tile holds TILE elements
    dq_bv: int = 64
    fused_bk: int = 64  # the whole state: one dk/dv launch where it fits TILE
    fused_bv: int = 64
    fuse: bool = True  # one dk/dv walk instead of two where the whole state fits TILE
    dk_bk: int = 64  # the split dk walk's [BK, all V] tile (wider heads), TILE elements
    dk_bv: int = 64
    dv_bk: int = 64  # the split dv walk's [all K, BV] tile (wider heads), TILE elements
    dv_bv: int = 64
    num_warps: int = 4  # enough for [64, 64] tiles (where measured); [64, 256] tiles spill with 4 and take 8
    # the next chunk's loads in flight: 3 stages beat 2; wider heads' [64, 256] tiles take 1 (3 would need about
    # 210 KB of shared memory)
    num_stages: int = 3

    @property
    def fwd(self) -> tuple[int, int]:
        return self.fwd_bk, self.fwd_bv

    @property
    def dq(self) -> tuple[int, int]:
        return self.dq_bk, self.dq_bv

    @property
    def fused(self) -> tuple[int, int]:
        return self.fused_bk, self.fused_bv

    @property
    def dk(self) -> tuple[int, int]:
        return self.dk_bk, self.dk_bv

    @property
    def dv(self) -> tuple[int, int]:
        return self.dv_bk, self.dv_bv

    def launch(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


def fwd_tile(K: int, V: int) -> tuple[int, int]:
    """``(fwd_bk, fwd_bv)`` of the output walk, ``[all K, BV]`` (not cached: ``torch.compile`` traces it, the
    automatic segment length reads it)."""
    BKf, BVf = block(K), block(V)
    return BKf, min(BVf, max(16, TILE // BKf))


@functools.lru_cache(maxsize=64)
def default_launch(K: int, V: int) -> LinearLaunch:
    """The launch configuration of a call with ``K``-wide keys and ``V``-wide values (cached: part of a call's host
    time)."""
    BKf, BVf = block(K), block(V)
    narrow = max(BKf, BVf) <= 64
    fwd_bk, fwd_bv = fwd_tile(K, V)
    return LinearLaunch(
        fwd_bk=fwd_bk, fwd_bv=fwd_bv,
        dq_bk=min(BKf, max(16, TILE // BVf)), dq_bv=BVf,
        fused_bk=BKf, fused_bv=BVf,
        fuse=BKf * BVf <= TILE,
        dk_bk=min(BKf, max(16, TILE // BVf)), dk_bv=BVf,
        dv_bk=BKf, dv_bv=min(BVf, max(16, TILE // BKf)),
        num_warps=4 if narrow else 8,
        num_stages=3 if narrow else 1,
    )
