"""The ``"serial"`` cache reduction of the Triton path (seed Appendix E, Code 2) as a segmented scan kernel:
``lintime::vq_scan`` (forward) and ``lintime::vq_scan_bwd``.

Per layout row, block by block, the running count and value sum of each code are carried in fp32 and reset at a
sequence's pseudo-block; each block's inclusive ``(count, mean)`` is written.  One read of the sums and one write
of the means (vq-base at 32k: about 0.4 GB of memory traffic, against about 6 GB for the chunked form's closed form,
whose fp64 prefix sums are subtracted at every segment start).  The backward is the reverse scan: ``d sum_e'`` =
the sum of ``d mean_e / count_e`` over the blocks ``e >= e'`` of the same sequence; the count's gradient (needed only
for an initial state's ``cache_count``) is formed in PyTorch from the same rule.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lintime.ops.custom_op import launcher_op
from lintime.ops.kernel_launch import block, cdiv, interpreting


@triton.jit
def vq_scan_fwd_kernel(first, cnt, sumv, tot, mean, NE, NST, HS: tl.constexpr, V: tl.constexpr, BS: tl.constexpr,
                       BV: tl.constexpr):
    """Rows ``[BS]`` of ``(h, s)`` and columns ``[BV]`` of one layout row: ``tot``, ``mean`` ``[R, NE, HS(, V)]``.
    Grid ``(R * NST, cdiv(V, BV))``; programs of column tile 0 write ``tot``."""
    i_t, i_v = tl.program_id(0), tl.program_id(1)
    r = (i_t // NST).to(tl.int64)
    o_s = (i_t % NST) * BS + tl.arange(0, BS)
    m_s = o_s < HS
    o_v = i_v * BV + tl.arange(0, BV)
    m_sv = m_s[:, None] & (o_v < V)[None, :]
    o_sv = o_s[:, None] * V + o_v[None, :]
    b_c = tl.zeros([BS], tl.float32)
    b_u = tl.zeros([BS, BV], tl.float32)
    for e in range(0, NE):
        be = r * NE + e
        keep = (tl.load(first + be) == 0).to(tl.float32)  # 0 at a sequence's pseudo-block: a new cache
        b_c = b_c * keep + tl.load(cnt + be * HS + o_s, mask=m_s, other=0.0)
        b_u = b_u * keep + tl.load(sumv + be * HS * V + o_sv, mask=m_sv, other=0.0)
        tl.store(mean + be * HS * V + o_sv, b_u / tl.where(b_c > 0, b_c, 1.0)[:, None], mask=m_sv)
        if i_v == 0:
            tl.store(tot + be * HS + o_s, b_c, mask=m_s)


@triton.jit
def vq_scan_bwd_kernel(first, tot, dmean, dsumv, NE, NST, HS: tl.constexpr, V: tl.constexpr, BS: tl.constexpr,
                       BV: tl.constexpr):
    """``dsumv`` ``[R, NE, HS, V]``: the reverse scan of ``dmean / tot`` within each sequence.  Grid as the
    forward's."""
    i_t, i_v = tl.program_id(0), tl.program_id(1)
    r = (i_t // NST).to(tl.int64)
    o_s = (i_t % NST) * BS + tl.arange(0, BS)
    m_s = o_s < HS
    o_v = i_v * BV + tl.arange(0, BV)
    m_sv = m_s[:, None] & (o_v < V)[None, :]
    o_sv = o_s[:, None] * V + o_v[None, :]
    b_g = tl.zeros([BS, BV], tl.float32)
    for i in range(0, NE):
        be = r * NE + (NE - 1 - i)
        c = tl.load(tot + be * HS + o_s, mask=m_s, other=1.0)
        b_g += tl.load(dmean + be * HS * V + o_sv, mask=m_sv, other=0.0) / tl.where(c > 0, c, 1.0)[:, None]
        tl.store(dsumv + be * HS * V + o_sv, b_g, mask=m_sv)
        b_g = b_g * (tl.load(first + be) == 0).to(tl.float32)  # blocks before a pseudo-block: another sequence


def _tiles(HS: int, V: int) -> tuple[int, int]:
    """``(BS, BV)``: [32, 64] fp32 tiles, 384 programs at vq-base (``S = 512``, ``V = 1536``) per layout row, not
    timed yet; 16-wide under the interpreter (several tiles in small tests)."""
    if interpreting():
        return 16, 16
    return min(32, block(HS)), min(64, block(V))


def _scan_fake(first, cnt, sumv):
    return torch.empty_like(cnt), torch.empty_like(sumv)


def _rev_segment_sum(first: Tensor, x: Tensor) -> Tensor:
    """``y_e = sum of x_e'`` over the blocks ``e' >= e`` of the same sequence (``first`` ``[R, NE]`` marks the
    starts; ``x`` ``[R, NE, ...]``), as reverse prefix sums in fp64 minus their value past the sequence's end."""
    R, NE = first.shape
    idx = torch.arange(NE, device=first.device)
    # the start of the next sequence after each block (NE past the last): a reverse running minimum
    nxt = torch.where(first, idx, NE).roll(-1, 1)
    nxt[:, -1] = NE
    nxt = nxt.flip(1).cummin(1).values.flip(1)  # [R, NE]
    suf = x.to(torch.float64).flip(1).cumsum(1).flip(1)  # sum over e' >= e of the row
    suf = torch.cat([suf, torch.zeros_like(suf[:, :1])], 1)  # column NE: nothing left
    past = suf.gather(1, nxt.view(R, NE, *[1] * (x.dim() - 2)).expand(R, NE, *x.shape[2:]))
    return (suf[:, :NE] - past).to(x.dtype)


def _scan_bwd(first, cnt, tot, mean, dtot, dmean, need_dcnt: bool):
    R, NE, H, S, V = mean.shape
    HS = H * S
    dsumv = torch.empty_like(mean)
    BS, BV = _tiles(HS, V)
    NST = cdiv(HS, BS)
    if R * NE > 0:
        vq_scan_bwd_kernel[(R * NST, cdiv(V, BV))](first, tot, dmean, dsumv, NE, NST, HS=HS, V=V, BS=BS, BV=BV)
    dcnt = None
    if need_dcnt:
        # mean_e = sum_e / tot_e: d tot_e = incoming - (d mean_e . mean_e) / tot_e where tot_e > 0
        nz = tot > 0
        dc = torch.where(nz, (dmean * mean).sum(-1) / torch.where(nz, tot, torch.ones_like(tot)), 0.0)
        dc = -dc if dtot is None else dtot - dc
        dcnt = _rev_segment_sum(first.bool(), dc)
    return dcnt, dsumv


def _scan_bwd_fake(first, cnt, tot, mean, dtot, dmean, need_dcnt):
    return (torch.empty_like(cnt) if need_dcnt else cnt.new_empty(0)), torch.empty_like(mean)


@launcher_op("vq_scan_bwd", fake=_scan_bwd_fake)
def vq_scan_bwd_op(first: Tensor, cnt: Tensor, tot: Tensor, mean: Tensor, dtot: Optional[Tensor], dmean: Tensor,
                   need_dcnt: bool) -> tuple[Tensor, Tensor]:
    """``(dcnt, dsumv)`` (``dcnt`` empty unless ``need_dcnt``)."""
    dcnt, dsumv = _scan_bwd(first, cnt, tot, mean, dtot, dmean, need_dcnt)
    return (dcnt if need_dcnt else cnt.new_empty(0)), dsumv


def _setup(ctx, inputs, output):
    first, cnt, sumv = inputs
    tot, mean = output
    ctx.save_for_backward(first, cnt, tot, mean)


def _backward(ctx, dtot, dmean):
    first, cnt, tot, mean = ctx.saved_tensors
    need_dcnt = ctx.needs_input_grad[1]
    dmean = torch.zeros_like(mean) if dmean is None else dmean.contiguous()
    dtot = None if dtot is None else dtot.contiguous()
    dcnt, dsumv = vq_scan_bwd_op.for_ctx(ctx)(first, cnt, tot, mean, dtot, dmean, need_dcnt)
    return None, (dcnt if need_dcnt else None), dsumv


@launcher_op("vq_scan", fake=_scan_fake, backward=_backward, setup_context=_setup)
def vq_scan_op(first: Tensor, cnt: Tensor, sumv: Tensor) -> tuple[Tensor, Tensor]:
    """``(tot [R, NE, H, S], mean [R, NE, H, S, V])`` fp32: the inclusive running count and mean of each block's
    sequence (``first`` ``[R, NE]`` int8 marks the pseudo-blocks; ``cnt``, ``sumv`` fp32 per-block counts and
    value sums)."""
    R, NE, H, S, V = sumv.shape
    HS = H * S
    tot, mean = torch.empty_like(cnt), torch.empty_like(sumv)
    BS, BV = _tiles(HS, V)
    NST = cdiv(HS, BS)
    if R * NE > 0:
        vq_scan_fwd_kernel[(R * NST, cdiv(V, BV))](first, cnt, sumv, tot, mean, NE, NST, HS=HS, V=V, BS=BS, BV=BV)
    return tot, mean


def scan_serial(first: Tensor, cnt: Tensor, sumv: Tensor) -> tuple[Tensor, Tensor]:
    """The ``"serial"`` reduction (same signature and result as ``lintime.ops.vq.chunk.REDUCTIONS["serial"]``)
    on the scan kernel; fp32 ``cnt`` / ``sumv``."""
    return vq_scan_op(first.to(torch.int8).contiguous(), cnt.contiguous(), sumv.contiguous())
