"""The relu^2 kernels' Toeplitz bias on the host: :func:`kernel_bias`, the bias ``[H, LB]`` as the kernels read it,
and :func:`fold_bias_grad`, its gradient folded from the kernels' per-tile-diagonal sums ``[H, NTD, BM, BM]``.

GAU attention's kernels and mixed chunk attention's (GAU attention within a chunk, :mod:`lintime.ops.mixed_chunk`)
both read the bias this way; the mixed chunk family imports it from here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
