"""Launch configuration of the linear-attention Triton kernels (:class:`LinearLaunch`, :func:`linear_launch`).

What chose the defaults: ``docs/design/kernels.md`` (linear attention).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lintime.ops.launching import block

TILE = 4096  # fp32 elements of the state tile one walk program holds (16 KB: [64, 64] at K = V = 64, in registers)


@dataclass(frozen=True)
class LinearLaunch:
    """Tiles ``(BK, BV)`` and launch settings of the linear-attention walks for one ``(K, V)``.

    ``fwd``: ``[all K, BV]`` (output walk); ``dq``: ``[BK, all V]``; ``fused``: ``[all K, all V]``, the
    dk/dv walk in one launch when ``fuse`` (the state fits in ``TILE``), else ``dk`` (``[BK, all V]``)
    and ``dv`` (``[all K, BV]``) in two; every walk runs ``num_warps`` warps, ``num_stages`` stages.
    """

    fwd: tuple[int, int]
    dq: tuple[int, int]
    fused: tuple[int, int]
    fuse: bool
    dk: tuple[int, int]
    dv: tuple[int, int]
    num_warps: int
    num_stages: int

    def launch(self) -> dict:
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


def fwd_tile(K: int, V: int) -> tuple[int, int]:
    """``(BK, BV)`` of the output walk, ``[all K, BV]`` (not cached: ``torch.compile`` traces it)."""
    BKf, BVf = block(K), block(V)
    return BKf, min(BVf, max(16, TILE // BKf))


@functools.lru_cache(maxsize=64)
def linear_launch(K: int, V: int) -> LinearLaunch:
    """The shipped launch configuration of a call with ``K``-wide keys and ``V``-wide values."""
    BKf, BVf = block(K), block(V)
    narrow = max(BKf, BVf) <= 64
    return LinearLaunch(
        fwd=fwd_tile(K, V),
        dq=(min(BKf, max(16, TILE // BVf)), BVf),
        fused=(BKf, BVf),
        fuse=BKf * BVf <= TILE,
        dk=(min(BKf, max(16, TILE // BVf)), BVf),
        dv=(BKf, min(BVf, max(16, TILE // BKf))),
        # 4 warps for heads up to 64 wide (where they were measured); [64, 256] tiles spill with 4
        num_warps=4 if narrow else 8,
        # 3 stages (the next chunk's loads in flight) beat 2; wider heads' [64, 256] tiles take 1: 3 would need
        # about 210 KB of shared memory
        num_stages=3 if narrow else 1,
    )
