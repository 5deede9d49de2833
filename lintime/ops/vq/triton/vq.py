"""Transformer-VQ attention on Triton kernels: the custom ops ``lintime::vq_fwd`` / ``lintime::vq_bwd`` and the
entry :func:`triton_vq_attention` (the ``"triton"`` backend of :func:`lintime.ops.vq_attention`).

What runs where:

* PyTorch (the chunked form's code, :mod:`lintime.ops.vq.chunk`): the block layout, the per-block cache
  summaries ``(count, mean)`` of blocks ``<= n - 2`` through the chosen ``reduction`` (O(blocks * S * V), with
  autograd from the means to ``v`` and the initial state), the final state;
* forward: ``vq_probs_kernel`` writes the probabilities ``P`` of every window column (causal, bias) and cache
  code (``q . codebook + log count``) -- ``[T, 2L + S]`` per head, the chunked form's score size, never
  ``T x T`` -- and ``vq_pv_kernel`` forms ``o = P [v_window; mean]`` as a tiled matrix product;
* backward: ``vq_delta_kernel`` takes ``rowsum(do o)``, ``vq_dp_kernel`` the score gradients
  ``dS = P (do [v_window; mean]^T - rowsum(do o))`` (the window's part is the bias gradient), ``vq_pv_kernel``
  ``dq = dS [k_window; codebook]``; ``vq_bwd_key_kernel`` folds the window's ``P^T do`` and ``dS^T q`` into
  ``dv`` / ``dk`` of each key block (its own block's queries and the next block's, fp32 accumulation); the
  cache's ``d mean = P^T do`` per block, ``d codebook = dS^T q`` over all blocks and ``d log count`` are
  matmuls / sums in PyTorch.

No per-token ``[S, V]`` tensor and no ``T x T`` tensor is made.  ``P`` is saved for the backward (the input
dtype, ``[T, 2L + S]`` per head).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from lintime.ops.utils.launching import block, cdiv, check_device, dot_config, grad_as, launcher_op
from lintime.ops.vq.bias import rel_table_padded
from lintime.ops.vq.chunk import cache_summaries, call_layout, final_state
from lintime.ops.vq.state import log_count
from lintime.ops.vq.triton.kernels import (vq_bwd_key_kernel, vq_delta_kernel, vq_dp_kernel, vq_probs_kernel,
                                           vq_pv_kernel, vq_rel_grad_kernel)
from lintime.ops.vq.triton.launch import VQLaunch, default_launch
from lintime.ops.vq.triton.scan import block_sums_cuda, scan_cache

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _fwd_fake(q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb, logc, cm, L, rel, launch):
    NQ, _, H, _ = q.shape
    return (q.new_empty(NQ, L, H, v.shape[-1]), q.new_empty(NQ, L, H, 2 * L), q.new_empty(NQ, L, H, cb.shape[1]))


def _pv(aw, ac, x, y, qblk, pvalid, L: int, y_block_stride: int, cfg: VQLaunch):
    """``A [x_window; y]`` (:func:`vq_pv_kernel`): ``aw [NQ, L, H, 2L]``, ``ac [NQ, L, H, S]``, ``x [NB, L, H, D]``,
    ``y`` ``[.., H, S, D]`` at ``y_block_stride`` elements per query block; returns ``[NQ, L, H, D]``."""
    NQ, _, H, S = ac.shape
    D = x.shape[-1]
    out = aw.new_empty(NQ, L, H, D)
    BD = min(cfg.bd_o, block(D))
    NQT = cdiv(L, cfg.bm_o)
    vq_pv_kernel[(NQ * NQT, cdiv(D, BD), H)](
        aw, ac, x, y, qblk, pvalid, out, L, S, NQT, y_block_stride, H=H, D=D, BM=cfg.bm_o, BD=BD, BK=cfg.bk_o,
        PREC=dot_config(aw.dtype)[1], num_warps=cfg.warps_o, num_stages=cfg.stages,
    )
    return out


def vq_fwd(q, k, v, kvalid, qblk, pvalid, bias, cb, logc, cm, L: int, rel: bool, cfg: VQLaunch):
    """Forward launcher: ``o [NQ, L, H, V]`` and the probabilities ``pw [NQ, L, H, 2L]``, ``pc [NQ, L, H, S]`` (the
    input dtype, saved for the backward); arguments as in :mod:`.kernels`; ``rel``: ``bias`` is the relative table
    ``[NQ, L, H, TB]`` (:func:`lintime.ops.vq.bias.rel_table_padded`), not the window bias."""
    NQ, _, H, K = q.shape
    S = cb.shape[1]
    pw = q.new_empty(NQ, L, H, 2 * L)
    pc = q.new_empty(NQ, L, H, S)
    if NQ == 0:
        return q.new_empty(0, L, H, v.shape[-1]), pw, pc
    NQT = cdiv(L, cfg.bm_p)
    vq_probs_kernel[(NQ * NQT, H)](
        q, k, kvalid, qblk, pvalid, bias, cb, logc, pw, pc, L, S, NQT, 2 * L if bias is None else bias.shape[-1], H=H,
        K=K, BM=cfg.bm_p, BN=cfg.bn_p, BK=block(K), HAS_BIAS=bias is not None, REL=rel, PREC=dot_config(q.dtype)[1],
        num_warps=cfg.warps_p, num_stages=cfg.stages,
    )
    return _pv(pw, pc, v, cm, qblk, pvalid, L, H * S * v.shape[-1], cfg), pw, pc


def _bwd_fake(do, q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb, logc, cm, o, pw, pc, L, rel, launch):
    db = torch.empty_like(bias) if bias is not None else q.new_empty(0)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), db, torch.empty_like(cb),
            torch.empty_like(logc), torch.empty_like(cm))


def vq_bwd(do, q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb, logc, cm, o, pw, pc, L: int, rel: bool,
           cfg: VQLaunch):
    """Backward launcher: ``dq, dk, dv, dbias (empty without a bias; the relative table's with ``rel``), dcb, dlogc,
    dcm``."""
    NQ, _, H, K = q.shape
    NB = k.shape[0]
    V = v.shape[-1]
    S = cb.shape[1]
    PREC = dot_config(q.dtype)[1]
    dsw = torch.empty_like(pw)
    dsc = torch.empty_like(pc)
    if NQ > 0:
        delta = q.new_empty(NQ, L, H, dtype=torch.float32)
        R = NQ * L * H
        vq_delta_kernel[(cdiv(R, cfg.delta_br),)](do, o, delta, R, D=V, BR=cfg.delta_br,
                                                  BD=min(cfg.delta_bd, block(V)), num_warps=cfg.delta_warps)
        NQT = cdiv(L, cfg.bm_d)
        NWT = cdiv(2 * L, cfg.bn_d)
        vq_dp_kernel[(NQ * NQT, NWT + cdiv(S, cfg.bn_d), H)](
            do, v, cm, qblk, pvalid, pw, pc, delta, dsw, dsc, L, S, NQT, NWT, H * S * V, H=H, D=V, BM=cfg.bm_d,
            BN=cfg.bn_d, BK=min(cfg.bk_d, block(V)), PREC=PREC, num_warps=cfg.warps_d, num_stages=cfg.stages,
        )
        dq = _pv(dsw, dsc, k, cb, qblk, pvalid, L, 0, cfg)
    else:
        dq = torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    NJT = cdiv(L, cfg.bn_k)
    for a, x, out in ((dsw, q, dk), (pw, do, dv)):
        D = x.shape[-1]
        BD = min(cfg.bd_k, block(D))
        vq_bwd_key_kernel[(NB * NJT, cdiv(D, BD), H)](
            a, x, qa, qb, out, L, NJT, H=H, D=D, BN=cfg.bn_k, BI=cfg.bi_k, BD=BD, PREC=PREC, num_warps=cfg.warps_k,
            num_stages=cfg.stages,
        )
    with torch.autocast(q.device.type, enabled=False):  # the cache's gradients in the inputs' dtype
        dcm = torch.einsum("nihs,nihv->nhsv", pc, do)  # [NQ, H, S, V]
        dcb = torch.einsum("nihs,nihk->hsk", dsc, q)  # [H, S, K], every block's cache together
    dlogc = dsc.sum(1, dtype=torch.float32)  # [NQ, H, S]
    db = q.new_empty(0) if bias is None else dsw
    if rel:  # the relative table's gradient: its column t of row a is window column a + t
        db = torch.empty_like(bias)
        TB = bias.shape[-1]
        if db.numel():
            BT = min(cfg.rel_bt, block(TB))
            vq_rel_grad_kernel[(cdiv(NQ * L * H, cfg.rel_br), cdiv(TB, BT))](
                dsw, db, NQ * L * H, L, TB, H=H, BR=cfg.rel_br, BT=BT, num_warps=cfg.rel_warps)
    return dq, dk, dv, db, dcb.to(cb.dtype), dlogc, dcm.to(cm.dtype)


@launcher_op("vq_bwd", fake=_bwd_fake)
def vq_bwd_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, kvalid: Tensor, qblk: Tensor, pvalid: Tensor, qa: Tensor,
              qb: Tensor,
              bias: Optional[Tensor], cb: Tensor, logc: Tensor, cm: Tensor, o: Tensor, pw: Tensor, pc: Tensor, L: int,
              rel: bool, launch: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return vq_bwd(do, q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb, logc, cm, o, pw, pc, L, rel,
                  VQLaunch.of(launch))


def _setup(ctx, inputs, output):
    q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb, logc, cm, L, rel, launch = inputs
    o, pw, pc = output
    ctx.save_for_backward(q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb, logc, cm, o, pw, pc)
    ctx.L, ctx.rel, ctx.launch = L, rel, launch


def _backward(ctx, do, *_unused):
    q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb, logc, cm, o, pw, pc = ctx.saved_tensors
    do = grad_as(do, q.dtype).contiguous()
    dq, dk, dv, db, dcb, dlogc, dcm = vq_bwd_op.for_ctx(ctx)(do, q, k, v, kvalid, qblk, pvalid, qa, qb, bias, cb,
                                                             logc, cm, o, pw, pc, ctx.L, ctx.rel, ctx.launch)
    return (dq, dk, dv, None, None, None, None, None, (db if bias is not None else None), dcb, dlogc, dcm, None, None,
            None)


@launcher_op("vq_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup, outputs=1)
def vq_fwd_op(q: Tensor, k: Tensor, v: Tensor, kvalid: Tensor, qblk: Tensor, pvalid: Tensor, qa: Tensor, qb: Tensor,
              bias: Optional[Tensor], cb: Tensor, logc: Tensor, cm: Tensor, L: int, rel: bool,
              launch: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    """``o`` (the op returns the probabilities too, saved for the backward)."""
    return vq_fwd(q, k, v, kvalid, qblk, pvalid, bias, cb, logc, cm, L, rel, VQLaunch.of(launch))


def _key_owners(qblk: Tensor, NB: int, blk_ok: Tensor) -> tuple[Tensor, Tensor]:
    """``qa [NB]``: the query block at each flat block (-1: none); ``qb [NB]``: the query block right after it
    (the next block, whose window's first half it is; -1: none -- a pseudo-block, a row end).  A block without a
    key (``blk_ok`` false) gets -1 in both: its gradients are zero, written without a product."""
    idx = torch.arange(qblk.numel(), dtype=torch.int32, device=qblk.device)  # qblk: int64 [NQ]
    qa = torch.full((NB + 1,), -1, dtype=torch.int32, device=qblk.device).index_copy(0, qblk, idx)
    return qa[:NB].masked_fill(~blk_ok, -1), qa[1:].masked_fill(~blk_ok, -1)


def triton_vq_attention(
    q, k_hat, codes, v, codebook, *, block_len, bias=None, reduction="serial", initial_state=None,
    output_final_state=False, cu_seqlens=None, host_values=None, launch: VQLaunch | None = None, rel_bias=None,
):
    """Same arguments and results as :func:`lintime.ops.vq.chunk.chunk_vq_attention` (``host_values`` as
    there), computed by the kernels of :mod:`.kernels`; fp16 / bf16 / fp32 inputs, fp32 scores and sums.
    fp64 inputs and keys wider than 256 go to the chunked PyTorch form.  ``launch`` overrides
    :func:`default_launch` (tests)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if q.dtype not in _TL or K > 256:
        from lintime.ops.vq.chunk import chunk_vq_attention

        return chunk_vq_attention(q, k_hat, codes, v, codebook, block_len=block_len, bias=bias,
                                  reduction=reduction, initial_state=initial_state,
                                  output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                  host_values=host_values, rel_bias=rel_bias)
    check_device("vq_attention", q)
    S = codebook.shape[1]
    L = block_len
    dev = q.device
    st, N, lay, host_values = call_layout(B, T, L, cu_seqlens, initial_state, host_values, dev)
    R, NE = lay.R, lay.NE
    flat = lambda x: x.reshape(B * T, *x.shape[2:])
    bufs = lambda x: None if st is None else x.reshape(N * 2 * L, *x.shape[2:])

    # sequences of whole blocks from block starts (training rows, packed or not): the query blocks are the tokens
    # as they lie (dest_q is the identity), so queries, bias and output skip the layout's scatter / gather; with
    # no state and equal lengths, keys / values too: each sequence's blocks are its pseudo and previous blocks
    # (empty) and then its tokens, one concatenation
    lens = [T] * B if host_values[0] is None else [b - a for a, b in zip(host_values[0], host_values[0][1:])]
    q_dense = (B * T > 0 and lay.NQ * L == B * T and all(n % L == 0 for n in lens)
               and (host_values[1] is None or all(p % L == 0 for p in host_values[1])))
    if q_dense:
        qplace = lambda x: x.reshape(lay.NQ, L, *x.shape[2:]).contiguous()  # the kernels' strides
    else:
        qplace = lambda x: lay.qplace(flat(x))
    if q_dense and st is None and len(set(lens)) == 1:
        Tn = lens[0]
        pad = lambda x: torch.cat([x.new_zeros(N, 2 * L, *x.shape[2:]), x.reshape(N, Tn, *x.shape[2:])], 1).view(
            R, NE, L, *x.shape[2:])
        kc, vc, zc = pad(k_hat), pad(v), pad(codes.long())
    else:
        kc = lay.place(flat(k_hat), bufs(st.k_hat.to(k_hat.dtype)) if st is not None else None)  # [R, NE, L, H, K]
        vc = lay.place(flat(v), bufs(st.v.to(v.dtype)) if st is not None else None)  # [R, NE, L, H, V]
        zc = lay.place(flat(codes).long(), bufs(st.codes.long()) if st is not None else None)  # [R, NE, L, H]
    NB = R * NE
    back2 = lay.qblk - 2  # the cache of query block n: blocks <= n - 2 (seed Code 2: pad 2, drop last 2)
    # [R, NE, H, S], [R, NE, H, S, V] fp32 (per-block sums by scatter-adds); "serial": the scan kernel (the same
    # running count and mean as Code 2), which also writes each query block's cache means in q's dtype
    if reduction == "serial":
        qmap = torch.full((NB,), -1, dtype=torch.int32, device=dev).index_copy(
            0, back2, torch.arange(lay.NQ, dtype=torch.int32, device=dev))
        got = {}

        def reduce(first, cnt, sumv):
            tot, mean, got["cm"] = scan_cache(first, cnt, sumv, qmap, lay.NQ, output_final_state, q.dtype)
            return tot, mean

        cum_c, cum_m = cache_summaries(lay, zc, vc, st, S, reduction, sums=block_sums_cuda, reduce=reduce)
        cache_m = got["cm"]  # [NQ, H, S, V]
    else:
        cum_c, cum_m = cache_summaries(lay, zc, vc, st, S, reduction, sums=block_sums_cuda)
        cache_m = cum_m.reshape(NB, H, S, V).index_select(0, back2).to(q.dtype)  # [NQ, H, S, V]
    cache_c = cum_c.reshape(NB, H, S).index_select(0, back2)  # [NQ, H, S]

    qblk = lay.qblk.to(torch.int32)
    blk_ok = lay.kvalid.reshape(NB, L).any(1)  # blocks that hold a key (no query sees an empty one's slots)
    qa, qb = _key_owners(lay.qblk, NB, blk_ok)
    pvalid = blk_ok.index_select(0, lay.qblk - 1).to(torch.int8)  # [NQ]: the previous block holds a key
    kvalid = lay.kvalid.reshape(NB * L).to(torch.int8)
    bc = None if bias is None else qplace(bias)  # [NQ, L, H, 2L]
    if rel_bias is not None:  # the relative table [.., H, L + 1 (padded)]: the kernels shift it into the window
        bc = qplace(rel_table_padded(*rel_bias))
    launch = launch or default_launch(K, V, q.dtype)
    o = vq_fwd_op(
        qplace(q), kc.view(NB, L, H, K), vc.view(NB, L, H, V), kvalid, qblk, pvalid, qa, qb, bc,
        codebook.to(q.dtype).contiguous(), log_count(cache_c).float(), cache_m, L, rel_bias is not None,
        launch.to_ints(),
    )[0]  # [NQ, L, H, V]
    o = o.view(B, T, H, V) if q_dense else o.reshape(lay.NQ * L, H, V).index_select(0, lay.dest_q).view(B, T, H, V)

    final = None
    if output_final_state:
        final = final_state(lay, N, kc, vc, zc, cum_c, cum_m, k_hat.dtype, v.dtype)
    return o, final
