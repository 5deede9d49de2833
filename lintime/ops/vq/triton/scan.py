"""The ``"serial"`` cache reduction of the Triton path (seed Appendix E, Code 2) as a segmented scan kernel:
``lintime::vq_scan`` (forward) and ``lintime::vq_scan_bwd``.

Per layout row, block by block, the running count and value sum of each code are carried in fp32 and reset at a
sequence's pseudo-block; each block's inclusive count is written, and its mean twice at most: in fp32 (when the
final state or an initial count's gradient needs it) and in the attention kernels' dtype at the query block whose
cache it is (``qmap``), so no gather or cast pass follows the scan.  One read of the sums and one write of the means
(vq-base at 32k, bf16, training: about 0.3 GB of memory traffic, against about 6 GB for the chunked form's closed
form, whose fp64 prefix sums are subtracted at every segment start).  The backward is the reverse scan: ``d sum_e'``
= the sum of ``d mean_e / count_e`` over the blocks ``e >= e'`` of the same sequence, ``d mean_e`` read from both
copies' gradients; the count's gradient (needed only for an initial state's ``cache_count``) is formed in PyTorch
from the same rule.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from lintime.ops.utils.launching import cdiv, launcher_op
from lintime.ops.vq.state import scatter_sums
from lintime.ops.vq.triton.launch import default_launch


@triton.jit
def _tile(NST, HS: tl.constexpr, V: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr):
    """This program's layout row ``r``, its ``[BS]`` rows ``o_s`` of ``(h, s)`` (mask ``m_s``) and the ``[BS, BV]``
    offsets ``o_sv`` (mask ``m_sv``) of its column tile in one block's ``[HS, V]``."""
    i_t, i_v = tl.program_id(0), tl.program_id(1)
    r = (i_t // NST).to(tl.int64)
    o_s = (i_t % NST) * BS + tl.arange(0, BS)
    m_s = o_s < HS
    o_v = i_v * BV + tl.arange(0, BV)
    return r, o_s, m_s, m_s[:, None] & (o_v < V)[None, :], o_s[:, None] * V + o_v[None, :]


@triton.jit
def vq_scan_fwd_kernel(first, cnt, sumv, qmap, tot, mean, cm, NE, NST, HS: tl.constexpr, V: tl.constexpr,
                       BS: tl.constexpr, BV: tl.constexpr, KEEP_MEAN: tl.constexpr):
    """Rows ``[BS]`` of ``(h, s)`` and columns ``[BV]`` of one layout row: ``tot``, ``mean`` ``[R, NE, HS(, V)]``
    (``mean`` only with ``KEEP_MEAN``), and each block's mean in ``cm``'s dtype at ``cm[qmap[block]]`` (the cache
    of the query block two blocks on; ``-1``: none).  Grid ``(R * NST, cdiv(V, BV))``; programs of column tile 0
    write ``tot``."""
    i_v = tl.program_id(1)
    r, o_s, m_s, m_sv, o_sv = _tile(NST, HS, V, BS, BV)
    b_c = tl.zeros([BS], tl.float32)
    b_u = tl.zeros([BS, BV], tl.float32)
    for e in range(0, NE):
        be = r * NE + e
        keep = (tl.load(first + be) == 0).to(tl.float32)  # 0 at a sequence's pseudo-block: a new cache
        b_c = b_c * keep + tl.load(cnt + be * HS + o_s, mask=m_s, other=0.0)
        b_u = b_u * keep + tl.load(sumv + be * HS * V + o_sv, mask=m_sv, other=0.0)
        b_m = b_u / tl.where(b_c > 0, b_c, 1.0)[:, None]
        if KEEP_MEAN:
            tl.store(mean + be * HS * V + o_sv, b_m, mask=m_sv)
        n = tl.load(qmap + be).to(tl.int64)
        if n >= 0:
            tl.store(cm + n * HS * V + o_sv, b_m.to(cm.dtype.element_ty), mask=m_sv)
        if i_v == 0:
            tl.store(tot + be * HS + o_s, b_c, mask=m_s)


@triton.jit
def vq_scan_bwd_kernel(first, tot, dmean, qmap, dcm, dsumv, NE, NST, HS: tl.constexpr, V: tl.constexpr,
                       BS: tl.constexpr, BV: tl.constexpr, HAS_DMEAN: tl.constexpr, HAS_DCM: tl.constexpr):
    """``dsumv`` ``[R, NE, HS, V]``: the reverse scan of ``(dmean + dcm[qmap]) / tot`` within each sequence.
    Grid as the forward's."""
    i_v = tl.program_id(1)
    r, o_s, m_s, m_sv, o_sv = _tile(NST, HS, V, BS, BV)
    b_g = tl.zeros([BS, BV], tl.float32)
    for i in range(0, NE):
        be = r * NE + (NE - 1 - i)
        c = tl.load(tot + be * HS + o_s, mask=m_s, other=1.0)
        d = tl.zeros([BS, BV], tl.float32)
        if HAS_DMEAN:
            d += tl.load(dmean + be * HS * V + o_sv, mask=m_sv, other=0.0)
        if HAS_DCM:
            n = tl.load(qmap + be).to(tl.int64)
            if n >= 0:
                d += tl.load(dcm + n * HS * V + o_sv, mask=m_sv, other=0.0).to(tl.float32)
        b_g += d / tl.where(c > 0, c, 1.0)[:, None]
        tl.store(dsumv + be * HS * V + o_sv, b_g, mask=m_sv)
        b_g = b_g * (tl.load(first + be) == 0).to(tl.float32)  # blocks before a pseudo-block: another sequence


def _tiles(HS: int, V: int) -> tuple[int, int]:
    """``(BS, BV)``: :meth:`.launch.VQLaunch.scan_tiles` (fp32 tiles whatever the inputs' dtype)."""
    return default_launch(0, V, torch.float32).scan_tiles(HS, V)


def _scan_fake(first, cnt, sumv, qmap, NQ, keep_mean, cm_dtype):
    R, NE, H, S, V = sumv.shape
    return (torch.empty_like(cnt), torch.empty_like(sumv) if keep_mean else sumv.new_empty(0),
            sumv.new_empty(NQ, H, S, V, dtype=cm_dtype))


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


def _scan_bwd(first, cnt, tot, mean, qmap, dtot, dmean, dcm, need_dcnt: bool):
    R, NE, H, S = tot.shape
    V = dcm.shape[-1] if dcm is not None else mean.shape[-1]
    HS = H * S
    dsumv = tot.new_empty(R, NE, H, S, V)
    BS, BV = _tiles(HS, V)
    NST = cdiv(HS, BS)
    if R * NE > 0:
        vq_scan_bwd_kernel[(R * NST, cdiv(V, BV))](
            first, tot, dmean, qmap, dcm, dsumv, NE, NST, HS=HS, V=V, BS=BS, BV=BV, HAS_DMEAN=dmean is not None,
            HAS_DCM=dcm is not None,
        )
    dcnt = None
    if need_dcnt:
        # mean_e = sum_e / tot_e: d tot_e = incoming - (d mean_e . mean_e) / tot_e where tot_e > 0, with
        # d mean_e the gradient of the fp32 means and of the copy at cm[qmap[e]]
        dm = torch.zeros_like(mean) if dmean is None else dmean.clone()
        if dcm is not None:
            live = qmap >= 0
            dm.view(R * NE, H, S, V)[live] += dcm[qmap[live].long()].to(dm.dtype)
        nz = tot > 0
        dc = torch.where(nz, (dm * mean).sum(-1) / torch.where(nz, tot, torch.ones_like(tot)), 0.0)
        dc = -dc if dtot is None else dtot - dc
        dcnt = _rev_segment_sum(first.bool(), dc)
    return dcnt, dsumv


def _scan_bwd_fake(first, cnt, tot, mean, qmap, dtot, dmean, dcm, need_dcnt):
    V = dcm.shape[-1] if dcm is not None else mean.shape[-1]
    return ((torch.empty_like(cnt) if need_dcnt else cnt.new_empty(0)),
            tot.new_empty(*tot.shape, V))


@launcher_op("vq_scan_bwd", fake=_scan_bwd_fake)
def vq_scan_bwd_op(first: Tensor, cnt: Tensor, tot: Tensor, mean: Tensor, qmap: Tensor, dtot: Optional[Tensor],
                   dmean: Optional[Tensor], dcm: Optional[Tensor], need_dcnt: bool) -> tuple[Tensor, Tensor]:
    """``(dcnt, dsumv)`` (``dcnt`` empty unless ``need_dcnt``, which needs the fp32 ``mean``)."""
    dcnt, dsumv = _scan_bwd(first, cnt, tot, mean, qmap, dtot, dmean, dcm, need_dcnt)
    return (dcnt if need_dcnt else cnt.new_empty(0)), dsumv


def _setup(ctx, inputs, output):
    first, cnt, sumv, qmap, NQ, keep_mean, cm_dtype = inputs
    tot, mean, cm = output
    ctx.save_for_backward(first, cnt, tot, mean, qmap)


def _backward(ctx, dtot, dmean, dcm):
    first, cnt, tot, mean, qmap = ctx.saved_tensors
    need_dcnt = ctx.needs_input_grad[1]
    dmean = None if dmean is None or mean.numel() == 0 else dmean.contiguous()
    dcm = None if dcm is None else dcm.contiguous()
    dtot = None if dtot is None else dtot.contiguous()
    dcnt, dsumv = vq_scan_bwd_op.for_ctx(ctx)(first, cnt, tot, mean, qmap, dtot, dmean, dcm, need_dcnt)
    return None, (dcnt if need_dcnt else None), dsumv, None, None, None, None


@launcher_op("vq_scan", fake=_scan_fake, backward=_backward, setup_context=_setup)
def vq_scan_op(first: Tensor, cnt: Tensor, sumv: Tensor, qmap: Tensor, NQ: int, keep_mean: bool,
               cm_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """``(tot [R, NE, H, S], mean [R, NE, H, S, V], cm [NQ, H, S, V])``: the inclusive running count and mean
    (fp32) of each block's sequence (``first`` ``[R, NE]`` int8 marks the pseudo-blocks; ``cnt``, ``sumv`` fp32
    per-block counts and value sums), and block ``e``'s mean in ``cm_dtype`` at ``cm[qmap[e]]`` (``qmap``
    ``[R * NE]`` int32, ``-1``: not copied); ``mean`` is empty unless ``keep_mean``."""
    R, NE, H, S, V = sumv.shape
    HS = H * S
    tot = torch.empty_like(cnt)
    mean = torch.empty_like(sumv) if keep_mean else sumv.new_empty(0)
    cm = sumv.new_empty(NQ, H, S, V, dtype=cm_dtype)
    BS, BV = _tiles(HS, V)
    NST = cdiv(HS, BS)
    if R * NE > 0:
        vq_scan_fwd_kernel[(R * NST, cdiv(V, BV))](first, cnt, sumv, qmap, tot, mean if keep_mean else None, cm, NE,
                                                   NST, HS=HS, V=V, BS=BS, BV=BV, KEEP_MEAN=keep_mean)
    return tot, mean, cm


def scan_cache(first: Tensor, cnt: Tensor, sumv: Tensor, qmap: Tensor, NQ: int, keep_mean: bool,
               cm_dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor]:
    """The ``"serial"`` reduction on the scan kernel, with each query block's cache means written in the kernels'
    dtype as the scan goes (no gather or cast pass after it): ``(tot, mean or None, cm)`` as :func:`vq_scan_op`'s;
    the fp32 ``mean`` is kept when asked for or when ``cnt`` needs a gradient (its backward reads it)."""
    keep_mean = keep_mean or (cnt.requires_grad and torch.is_grad_enabled())
    tot, mean, cm = vq_scan_op(first.to(torch.int8).contiguous(), cnt.contiguous(), sumv.contiguous(),
                               qmap.to(torch.int32).contiguous(), NQ, keep_mean, cm_dtype)
    return tot, (mean if keep_mean else None), cm


def scan_serial(first: Tensor, cnt: Tensor, sumv: Tensor) -> tuple[Tensor, Tensor]:
    """The ``"serial"`` reduction (same signature and result as ``lintime.ops.vq.chunk.REDUCTIONS["serial"]``)
    on the scan kernel; fp32 ``cnt`` / ``sumv``."""
    qmap = torch.full((first.numel(),), -1, dtype=torch.int32, device=first.device)
    tot, mean, _ = scan_cache(first, cnt, sumv, qmap, 0, True, sumv.dtype)
    return tot, mean


@triton.jit
def vq_sum_grad_kernel(grad, codes, valid, dv, R, L, S, H: tl.constexpr, V: tl.constexpr, BR: tl.constexpr,
                       BV: tl.constexpr):
    """The values' gradient of per-code block sums: slot row ``r = (g L + l) H + h`` gets row ``codes[r]`` of its
    block and head of ``grad`` ``[G, H, S, V]`` (fp32) in ``dv``'s dtype, an empty slot (``valid``) zero.
    Grid ``(cdiv(R, BR), cdiv(V, BV))``."""
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = o_r < R
    o_v = tl.program_id(1) * BV + tl.arange(0, BV)
    m_v = o_v < V
    c = tl.load(codes + o_r, mask=m_r, other=0)
    ok = tl.load(valid + o_r // H, mask=m_r, other=0) != 0
    src = ((o_r // (L * H) * H + o_r % H) * S + c) * V
    x = tl.load(grad + src[:, None] + o_v[None, :], mask=(m_r & ok)[:, None] & m_v[None, :], other=0.0)
    tl.store(dv + o_r[:, None] * V + o_v[None, :], x.to(dv.dtype.element_ty), mask=m_r[:, None] & m_v[None, :])


def _sum_grad_fake(grad, codes, valid, dtype):
    return grad.new_empty(*codes.shape, grad.shape[-1], dtype=dtype)


@launcher_op("vq_sum_grad", fake=_sum_grad_fake)
def vq_sum_grad_op(grad: Tensor, codes: Tensor, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """``dv [G, L, H, V]`` in ``dtype`` from ``grad [G, H, S, V]`` (fp32), ``codes [G, L, H]`` (int64), ``valid
    [G, L]`` (int8): the gradient of ``sum[g, h, s] = sum over the valid slots l with codes[g, l, h] = s of v[g, l, h]``
    -- a gather of one fp32 row per slot, rounded once (where the one-hot product's backward casts all of ``grad``
    and multiplies)."""
    G, L, H = codes.shape
    S, V = grad.shape[-2:]
    dv = grad.new_empty(G, L, H, V, dtype=dtype)
    R = G * L * H
    if R:
        cfg = default_launch(0, V, dtype)
        BR, BV = cfg.sums_tiles(V)
        vq_sum_grad_kernel[(cdiv(R, BR), cdiv(V, BV))](grad, codes, valid, dv, R, L, S, H=H, V=V, BR=BR, BV=BV,
                                                       num_warps=cfg.sums_warps)
    return dv


class _OneHotSums(torch.autograd.Function):
    """Per head, ``onehot [G, S, L] @ v [G, L, V]`` with fp32 output (the tensor cores' fp32 accumulation of half
    inputs, one rounding); the gradient to ``v`` is each valid slot's row of the incoming gradient, rounded once to
    ``v``'s dtype, as the scatter-add's gather gives it (``lintime::vq_sum_grad``, one read of the rows it needs,
    where ``onehot^T @ grad`` first casts all of ``grad``)."""

    @staticmethod
    def forward(ctx, hot, v, codes, valid):
        ctx.save_for_backward(codes, valid)
        ctx.v_dtype = v.dtype
        H = hot.shape[1]
        parts = [torch.bmm(hot[:, h], v[:, :, h], out_dtype=torch.float32) for h in range(H)]
        return parts[0].unsqueeze(1) if H == 1 else torch.stack(parts, 1)  # [G, H, S, V]

    @staticmethod
    def backward(ctx, grad):
        codes, valid = ctx.saved_tensors
        return None, vq_sum_grad_op(grad.contiguous(), codes, valid, ctx.v_dtype), None, None


def _onehot_sums(codes: Tensor, v: Tensor, valid: Tensor, S: int):
    """:func:`~lintime.ops.vq.state.scatter_sums` for half ``v`` on CUDA: per head, the masked one-hot
    ``[G, S, L]`` of the codes times the values (empty slots are not in the one-hot)."""
    *lead, L, H = codes.shape
    V = v.shape[-1]
    G = codes[..., 0, 0].numel()
    cg = codes.reshape(G, L, H)
    vd = valid.reshape(G, L).to(torch.int8)
    hot = torch.zeros(G, H, S, L, dtype=v.dtype, device=v.device)  # [G, H, S, L]: one zero fill and one scatter
    hot.scatter_(2, cg.transpose(1, 2)[:, :, None, :], vd.view(G, 1, 1, L).expand(G, H, 1, L).to(v.dtype))
    cnt = hot.sum(-1, dtype=torch.float32)
    sumv = _OneHotSums.apply(hot, v.reshape(G, L, H, V), cg.contiguous(), vd)
    return cnt.view(*lead, H, S), sumv.view(*lead, H, S, V)


def block_sums_cuda(codes: Tensor, v: Tensor, valid: Tensor, S: int):
    """The per-block code counts and value sums of :func:`lintime.ops.vq.state.scatter_sums` (same arguments and
    results) for the Triton path: half ``v`` on CUDA takes the one-hot product on the tensor cores with fp32
    accumulation (:class:`_OneHotSums`), where the fp32 atomic adds of ``[T, V]`` values cost more than its
    O(L * S * V) flops (``index_add`` was a large share of vq-base's training step); anything else
    the scatter-adds."""
    if v.is_cuda and v.dtype in (torch.float16, torch.bfloat16):
        return _onehot_sums(codes, v, valid, S)
    return scatter_sums(codes, v, valid, S)
