"""Launch configurations and host-side launch tables shared by the relu^2 Triton launchers (GAU attention,
:mod:`lintime.ops.gau.triton`, and mixed chunk attention, :mod:`lintime.ops.mixed_chunk.triton`).

* :class:`LaunchConfig`: the base of each family's frozen launch-config dataclass, and how a config travels
  through a custom op (an ``int[]`` argument, :meth:`LaunchConfig.to_ints` / :meth:`LaunchConfig.from_ints`);
* :func:`sequence_bounds`, :func:`to_device`: a call's sequences and int tables sent in one copy;
* :func:`kernel_bias`, :func:`fold_bias_grad`: the Toeplitz bias ``[H, LB]`` as the kernels read it, and its
  gradient folded from the kernels' per-tile-diagonal sums ``[H, NTD, BM, BM]``.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def pow2_at_least(x: int, lo: int = 16) -> int:
    """The smallest power of two ``>= x`` and ``>= lo``."""
    p = lo
    while p < x:
        p *= 2
    return p


@dataclass(frozen=True)
class LaunchConfig:
    """A family's block sizes and launch settings: int and bool fields, every one with a default.

    Custom ops (``torch.library``) take no dataclasses, so a config crosses ``lintime::<op>_fwd`` / ``_bwd`` as
    an ``int[]``: :meth:`to_ints` writes the fields in declaration order and :meth:`from_ints` reads them back
    in the same order -- the only two places that know the order (a field added anywhere stays consistent)."""

    def to_ints(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_ints(cls, xs) -> LaunchConfig:
        """The config of :meth:`to_ints`'s list (cached per list: part of a call's host time)."""
        return _from_ints(cls, tuple(int(x) for x in xs))

    @classmethod
    def of(cls, cfg) -> LaunchConfig:
        """``cfg`` as given (the eager paths pass the object) or from a custom op's int list."""
        return cfg if isinstance(cfg, cls) else cls.from_ints(cfg)


@functools.lru_cache(maxsize=64)
def _from_ints(cls, xs: tuple) -> LaunchConfig:
    return cls(*(type(f.default)(x) for f, x in zip(dataclasses.fields(cls), xs, strict=True)))


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``starts [N]``, ``lengths [N]`` (int64, CPU) of the sequences in the flattened ``[B * T]``
    token order."""
    if cu_seqlens is None:
        starts = torch.arange(B, dtype=torch.long) * T
        return starts, torch.full((B,), T, dtype=torch.long)
    cu = cu_seqlens.detach().to("cpu", torch.long)
    return cu[:-1].clone(), cu[1:] - cu[:-1]


def to_device(device, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Int tables to ``device`` as int32, in one host-to-device copy (pageable memory: pinning a
    fresh buffer per call costs more than the copy)."""
    sizes = [x.numel() for x in xs]
    flat = torch.cat([x.reshape(-1).to(torch.int32) for x in xs]) if xs else torch.zeros(0, dtype=torch.int32)
    return list(torch.split(flat.to(device), sizes))


def kernel_bias(rel_bias: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    """``(bias, LB)`` as both ops' kernels read it: its own 16- / 32-bit dtype (the kernels add it to fp32
    scores; a conversion here cost a launch per pass), other dtypes as fp32; ``(None, 1)`` without one."""
    if rel_bias is None:
        return None, 1
    b = rel_bias.detach()
    if b.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        b = b.to(torch.float32)
    return b.contiguous(), rel_bias.shape[1]


def fold_bias_grad(db_tiles: torch.Tensor, LB: int, OFF: int, bm: int, dtype: torch.dtype) -> torch.Tensor:
    """``[H, NTD, BM, BM]`` per-tile-diagonal sums of ``ds`` (fp32) -> ``[H, LB]`` bias gradient in ``dtype``,
    with entry ``(td, a, b)`` at bias index ``OFF + (td - mid) * bm + a - b`` (entries outside ``[0, LB)``:
    padding rows / columns, dropped).  One launch (:func:`fold_bias_kernel`)."""
    H, NTD = db_tiles.shape[:2]
    out = torch.empty(H, LB, dtype=dtype, device=db_tiles.device)
    BJ = 32
    fold_bias_kernel[(H, (LB + BJ - 1) // BJ)](db_tiles, out, NTD, LB, OFF, BM=bm, BJ=BJ, num_warps=4)
    return out


@triton.jit
def fold_bias_kernel(DB, OUT, NTD, LB, OFF, BM: tl.constexpr, BJ: tl.constexpr):
    """``OUT[h, j] = sum of DB[h, td, a, b]`` over the entries with ``OFF + (td - mid) BM + a - b = j``
    (``mid = (NTD - 1) // 2``): the per-tile-diagonal bias-gradient sums of both ops folded into the
    ``[H, LB]`` bias gradient, in ``OUT``'s dtype.  For ``r = j - OFF`` only the tile diagonals
    ``td - mid`` in ``{floor(r / BM), floor(r / BM) + 1}`` hold such entries.  Grid ``(H, LB / BJ)``."""
    i_h = tl.program_id(0)
    o_j = tl.program_id(1) * BJ + tl.arange(0, BJ)
    m_j = o_j < LB
    r = o_j - OFF
    q = tl.where(r >= 0, r // BM, -((BM - 1 - r) // BM))  # floor(r / BM) for either sign
    mid = (NTD - 1) // 2
    o_a = tl.arange(0, BM)
    acc = tl.zeros([BJ], dtype=tl.float32)
    for k in range(2):
        td = q + k + mid
        b = o_a[None, :] - (r - (q + k) * BM)[:, None]  # column of row a on this tile diagonal
        m = (m_j & (td >= 0) & (td < NTD))[:, None] & (b >= 0) & (b < BM)
        x = tl.load(DB + ((i_h * NTD + td[:, None]).to(tl.int64) * BM + o_a[None, :]) * BM + b, mask=m, other=0.0)
        acc += tl.sum(x, axis=1)
    tl.store(OUT + i_h * LB + o_j, acc.to(OUT.dtype.element_ty), mask=m_j)
