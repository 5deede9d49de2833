"""Per-block per-code counts and value sums of the Triton path (seed Appendix E, Code 2 ``delta1_by_block`` /
``deltav_by_block``) as one kernel each way: the custom op ``lintime::vq_sums`` (and ``lintime::vq_sums_bwd``).

:func:`lintime.ops.vq.state.scatter_sums` in PyTorch is an ``index_add`` of an fp32 copy of the values (the
op needs source and destination of one dtype) plus one for the counts, and its gradient an ``index_select`` in
fp32 followed by a cast: vq-base at 32k tokens, bf16, per layer and step, about 0.3 GB of copy and cast in the
forward and 0.5 GB in the backward (counted from the tensor sizes).  Here the kernel reads the values in their
own dtype and adds them in fp32 straight into the sums (atomic adds: the order of a sum's terms is not fixed,
as with ``index_add`` on CUDA), with the counts in the same pass; the backward gathers each slot's row of the
sums' gradient and writes it in the values' dtype.  Empty slots (``valid`` 0) add nothing and get no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from lintime.ops.custom_op import launcher_op
from lintime.ops.kernel_launch import block, cdiv, interpreting


@triton.jit
def vq_sums_fwd_kernel(rows, v, valid, cnt, sumv, M, V: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr):
    """``sumv[rows[m]] += v[m]``, ``cnt[rows[m]] += 1`` for the valid slots ``m`` of a ``[BM]`` tile (fp32);
    grid ``(cdiv(M, BM), cdiv(V, BV))``, programs of column tile 0 add the counts."""
    i_m, i_v = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    b_ok = tl.load(valid + o_m, mask=m_m, other=0) != 0
    m_m = m_m & b_ok
    b_r = tl.load(rows + o_m, mask=m_m, other=0).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_x = m_m[:, None] & (o_v < V)[None, :]
    b_v = tl.load(v + o_m.to(tl.int64)[:, None] * V + o_v[None, :], mask=m_x, other=0.0).to(tl.float32)
    tl.atomic_add(sumv + b_r[:, None] * V + o_v[None, :], b_v, mask=m_x, sem="relaxed")
    if i_v == 0:
        tl.atomic_add(cnt + b_r, tl.full([BM], 1.0, tl.float32), mask=m_m, sem="relaxed")


@triton.jit
def vq_sums_bwd_kernel(rows, valid, dsumv, dv, M, V: tl.constexpr, BM: tl.constexpr, BV: tl.constexpr):
    """``dv[m] = dsumv[rows[m]]`` for valid slots, 0 for empty ones, in ``dv``'s dtype; grid as the forward's."""
    i_m, i_v = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    m_m = o_m < M
    b_ok = tl.load(valid + o_m, mask=m_m, other=0) != 0
    b_r = tl.load(rows + o_m, mask=m_m & b_ok, other=0).to(tl.int64)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = (o_v < V)[None, :]
    b_g = tl.load(dsumv + b_r[:, None] * V + o_v[None, :], mask=(m_m & b_ok)[:, None] & m_v, other=0.0)
    tl.store(dv + o_m.to(tl.int64)[:, None] * V + o_v[None, :], b_g.to(dv.dtype.element_ty),
             mask=m_m[:, None] & m_v)


def _tiles(V: int) -> tuple[int, int]:
    """``(BM, BV)``: 32 slots x 128 values (vq-base: 12 column tiles), not timed yet; 16-wide under the
    interpreter (several tiles in small tests)."""
    if interpreting():
        return 16, 16
    return 32, min(128, block(V))


def _sums_fake(rows, v, valid, G):
    return v.new_empty(G, dtype=torch.float32), v.new_empty(G, v.shape[1], dtype=torch.float32)


@launcher_op("vq_sums_bwd", fake=lambda rows, valid, dsumv, like: torch.empty_like(like))
def vq_sums_bwd_op(rows: Tensor, valid: Tensor, dsumv: Tensor, like: Tensor) -> Tensor:
    """``dv`` ``[M, V]`` in ``like``'s dtype: each valid slot's row of ``dsumv``."""
    M, V = like.shape
    dv = torch.empty_like(like)
    BM, BV = _tiles(V)
    if M > 0:
        vq_sums_bwd_kernel[(cdiv(M, BM), cdiv(V, BV))](rows, valid, dsumv, dv, M, V=V, BM=BM, BV=BV)
    return dv


def _setup(ctx, inputs, output):
    rows, v, valid, G = inputs
    ctx.save_for_backward(rows, valid)
    ctx.v_shape, ctx.v_dtype = v.shape, v.dtype


def _backward(ctx, dcnt, dsumv):
    if dsumv is None:
        return None, None, None, None
    rows, valid = ctx.saved_tensors
    like = dsumv.new_empty(ctx.v_shape, dtype=ctx.v_dtype)
    return None, vq_sums_bwd_op.for_ctx(ctx)(rows, valid, dsumv.contiguous(), like), None, None


@launcher_op("vq_sums", fake=_sums_fake, backward=_backward, setup_context=_setup)
def vq_sums_op(rows: Tensor, v: Tensor, valid: Tensor, G: int) -> tuple[Tensor, Tensor]:
    """``(cnt [G], sumv [G, V])`` fp32: the counts and value sums of the valid slots (``valid`` ``[M]`` int8) of
    ``v`` ``[M, V]`` by output row ``rows`` ``[M]`` (int64 in ``[0, G)``)."""
    M, V = v.shape
    cnt = v.new_zeros(G, dtype=torch.float32)
    sumv = v.new_zeros(G, V, dtype=torch.float32)
    BM, BV = _tiles(V)
    if M > 0:
        vq_sums_fwd_kernel[(cdiv(M, BM), cdiv(V, BV))](rows, v, valid, cnt, sumv, M, V=V, BM=BM, BV=BV)
    return cnt, sumv


def triton_scatter_sums(codes: Tensor, v: Tensor, valid: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """:func:`lintime.ops.vq.state.scatter_sums` (same arguments and results; fp32 sums for fp16 / bf16 / fp32
    values) on the kernels above: ``codes`` ``[..., L, H]``, ``v`` ``[..., L, H, V]``, ``valid`` ``[..., L]``
    -> ``count [..., H, S]``, ``sum [..., H, S, V]``."""
    *lead, L, H = codes.shape
    V = v.shape[-1]
    G = codes[..., 0, 0].numel()  # groups (blocks)
    grp = torch.arange(G, device=codes.device).view(*lead, 1, 1)
    rows = ((grp * H + torch.arange(H, device=codes.device)) * S + codes).reshape(-1)  # [... * L * H]
    ok = valid[..., None].expand(codes.shape).reshape(-1).to(torch.int8)
    cnt, sumv = vq_sums_op(rows.contiguous(), v.reshape(-1, V).contiguous(), ok.contiguous(), G * H * S)
    return cnt.view(*lead, H, S), sumv.view(*lead, H, S, V)
