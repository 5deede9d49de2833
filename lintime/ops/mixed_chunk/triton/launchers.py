"""The forward and backward launchers of mixed chunk attention (seed §3.2, Eqs. 6-8), shared by the custom ops
``lintime::mixed_chunk_fwd`` / ``_bwd`` and the eager Function of :mod:`.mixed_chunk`.

Kernel sequence (:mod:`.walk`, :mod:`.kernels`), causal forward::

    chunk_state_kernel  the state entering every chunk, H [NC, H, S, E] (SDT), and the final kv:
                        one walk per sequence when that fills the GPU; otherwise a walk from zero
                        per segment gives segment-local states and segment totals, and
    seg_fix_kernel      adds each segment's start (initial state + earlier totals) to its states;
                        the walk's launch also runs A's programs: A [NC, H, C, C] =
                        relu(scale q_quad k_quad^T + b)^2, causal-masked
    mc_gemm_kernel      o = wq q_lin H_c + A_c v

Non-causal (Eq. 7): every chunk reads its sequence's total.  Backward: the reverse walk on ``(q_lin, do)`` with
weights ``wq`` gives ``G`` (the gradient flowing into each chunk's ``k_lin^T v``) and the initial state's gradient;
then ``mc_gemm_kernel`` (``dv = wf k_lin G_c + A^T do``), ``mc_dred_kernel`` (``dS``, stored like ``A``, and
``dq_lin, dk_lin``: both reductions over ``E`` in one launch) and ``mc_dqk_kernel`` (``dq_quad, dk_quad`` and the
bias gradient).

Loads: on Hopper GPUs (``MixedChunkLaunch.tma``, :func:`.plan.tma_shapes`) the output / dV GEMMs and the walks load
whole tiles through TMA tensor descriptors (inputs seen as ``[B T, H D]`` matrices, a head's tile a column offset);
elsewhere the same kernels use masked pointer loads.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from lintime.ops.utils.bias import fold_bias_grad, kernel_bias
from lintime.ops.mixed_chunk.triton.kernels import mc_dqk_kernel, mc_dred_kernel, mc_gemm_kernel
from lintime.ops.mixed_chunk.triton.launch import MixedChunkLaunch
from lintime.ops.mixed_chunk.triton.plan import plan_of, sdt_torch, tma_shapes, weights
from lintime.ops.mixed_chunk.triton.walk import chunk_state_kernel, seg_fix_kernel
from lintime.ops.utils.launching import cdiv, dot_config, next_pow2
from lintime.ops.utils.segments import ChunkPlan
from lintime.ops.utils.state_passing import seg_scan_kernel
from lintime.ops.utils.tma import tma_descriptors
from lintime.ops.utils import num_seqs


def _walk(x, y, w, plan: ChunkPlan, cfg, *, H, C, reverse, store, hout, tot, init=None, tma=False, scores=None):
    """``chunk_state_kernel`` over every segment: with ``init`` (one walk per sequence) each walk starts
    from its sequence's initial state, else from zero; ``tma``: load through descriptors where aligned;
    ``scores``: the :class:`_ScoresJob` whose programs the same launch runs after the walk's."""
    S, E = x.shape[-1], y.shape[-1]
    nwalk = cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state) * plan.NSEG * H
    nscores = scores.programs if scores is not None else 0
    if nwalk + nscores == 0:
        return
    NT = x.shape[0] * x.shape[1]
    d = tma_descriptors((x, NT, (cfg.bt, cfg.bs_state)), (y, NT, (cfg.bt, cfg.be_state))) if tma else None
    sc = scores or _ScoresJob(x, x, x, None, 1.0, 1, 1, 1, 1, 16, False, 0)
    chunk_state_kernel[(nwalk + nscores,)](
        x, y, *(d or (x, y)), hout, tot, init if init is not None else tot, w,
        plan.seg_first, plan.seg_n, plan.seg_seq, plan.ch_start, plan.ch_len, S, E, H, plan.NSEG, C,
        sc.qq, sc.kq, sc.a, sc.bias if sc.bias is not None else x, sc.scale, sc.C, sc.LB, sc.NMT,
        BS=cfg.bs_state, BE=cfg.be_state, BT=cfg.bt, REVERSE=reverse, STORE=store, HAS_INIT=init is not None,
        PREC=dot_config(x.dtype)[1], TMA=d is not None, FLAT=C % cfg.bt == 0,
        SCORES=scores is not None, BG=sc.BG, BSQ=sc.BS,
        CAUSAL=sc.causal, HAS_BIAS=sc.bias is not None, num_warps=cfg.warps_walk,
        num_stages=cfg.stages,
    )


@dataclass
class _ScoresJob:
    """The arguments of ``A``'s programs (``_scores_tile``), launched with the forward's state walk."""

    qq: torch.Tensor
    kq: torch.Tensor
    a: torch.Tensor
    bias: torch.Tensor | None
    scale: float
    C: int
    LB: int
    NMT: int
    BG: int
    BS: int
    causal: bool
    programs: int


def _scan(tot, plan: ChunkPlan, *, H, S, E, reverse):
    """lintime.ops.utils.state_passing's segment scan: each sequence's total over its segments (non-causal calls)."""
    final = torch.empty(plan.N, H, S, E, dtype=torch.float32, device=tot.device)
    if plan.N > 0:
        SK, SV = min(32, next_pow2(max(S, 16))), min(32, next_pow2(max(E, 16)))
        seg_scan_kernel[(cdiv(S, SK) * cdiv(E, SV), plan.N, H)](
            tot, tot, tot, tot, tot, tot, tot, final, final, plan.seq_ptr, 0,
            H=H, K=S, V=E, BK=SK, BV=SV, VARLEN=True, USE_G=False, REVERSE=reverse, NORM=False,
            HAS_INIT=False, STORE_START=False, num_warps=2,
        )
    return final


def states(x, y, w, plan: ChunkPlan, cfg, *, H, C, reverse, init, causal, sdt, tma, scores=None, defined=False):
    """Per-chunk states of the walk direction and the per-sequence result.

    Causal: ``(ST [NC_alloc, H, S, E] in sdt, the state entering each chunk; FINAL [N, H, S, E]
    fp32)``.  Non-causal: ``(ST [N, H, S, E] in sdt, FINAL)``, each sequence's total.  ``defined``: zero
    ``ST``'s rows of no chunk (a custom op's output must be fully defined; no kernel reads them).
    """
    S, E = x.shape[-1], y.shape[-1]
    f32 = {"dtype": torch.float32, "device": x.device}
    if not causal:
        tot = torch.empty(plan.NSEG, H, S, E, **f32)
        _walk(x, y, w, plan, cfg, tma=tma, H=H, C=C, reverse=reverse, store=False, hout=tot, tot=tot,
              scores=scores)
        final = _scan(tot, plan, H=H, S=S, E=E, reverse=reverse)
        return final.to(sdt), final
    hout = torch.empty(plan.NC_alloc, H, S, E, dtype=sdt, device=x.device)
    if defined and plan.NC_alloc > plan.NC_min:
        # rows no walk may write (the shape bound's slack, packed calls), zeroed before the walk writes its chunks
        hout[plan.NC_min :].zero_()
    final = torch.empty(plan.N, H, S, E, **f32)  # every sequence has a segment that writes its final state
    if plan.one_segment:
        # one walk per sequence from its initial state (an empty sequence: the state itself) writes the final
        # states in place: no zero fill and no copy from the totals
        _walk(x, y, w, plan, cfg, tma=tma, H=H, C=C, reverse=reverse, store=True, hout=hout, tot=final, init=init,
              scores=scores)
        return hout, final
    # one walk from zero at every segment writes segment-local states and totals; one pass adds each
    # segment's start (init + the totals walked before it) and writes the final states
    tot = torch.empty(plan.NSEG, H, S, E, **f32)
    _walk(x, y, w, plan, cfg, tma=tma, H=H, C=C, reverse=reverse, store=True, hout=hout, tot=tot, scores=scores)
    BS, BE = min(cfg.fix_bs, cfg.bs_state), cfg.be_state
    seg_fix_kernel[(cdiv(S, BS) * cdiv(E, BE), plan.NSEG, H)](
        hout, tot, init if init is not None else tot, final, plan.seg_first, plan.seg_n, plan.seg_seq,
        plan.seq_ptr, S, E, H, BS=BS, BE=BE, REVERSE=reverse, HAS_INIT=init is not None, num_warps=4,
    )
    return hout, final


def gemm(ts, w, idx, out, plan: ChunkPlan, cfg: MixedChunkLaunch, *, tma, S, E, H, C, NMT, BE, trans, causal, PREC, SDT,
         warps):
    """The output GEMM (``ts = (a, v, q_lin, H)``) or the dV GEMM (``trans``; ``(a, do, k_lin, G)``, ``A``'s tiles
    read transposed), through TMA descriptors (``tma``, where aligned) or pointers."""
    a, y, lin, st = ts
    BG, BK = cfg.bg, cfg.bk
    NT = y.shape[0] * y.shape[1]
    d = tma_descriptors((a, a.shape[0] * H * C, (BK, BG) if trans else (BG, BK)), (y, NT, (BK, BE)),
                        (lin, NT, (BG, BK)), (st, st.shape[0] * H * S, (BK, BE))) if tma else None
    mc_gemm_kernel[(cdiv(E, BE), plan.NC * NMT, H)](
        *ts, *(d or ts), w, idx, out, plan.ch_start, plan.ch_len, S, E, H, C, NMT, BG=BG, BE=BE, BK=BK,
        TRANS=trans, CAUSAL=causal, PREC=PREC, SDT=SDT, TMA=d is not None, num_warps=warps, num_stages=cfg.stages,
    )


def fwd_impl(qq, kq, ql, kl, v, rel_bias, kv0, count0, cu_seqlens, chunk_size, causal, scale, linear_norm,
              cfg: MixedChunkLaunch, zero_a: bool):
    """The forward launcher (``lintime::mixed_chunk_fwd`` and the eager path).  ``zero_a``: zero the
    entries of ``A`` no kernel writes (an op output must be fully defined; the eager path, which
    never hands ``A`` out, leaves them: the kernels never read them)."""
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    cfg = cfg.thin_walk(num_seqs(B, cu_seqlens), H, S, E, qq.device)
    plan = plan_of(B, T, H, S, E, C, cu_seqlens, cfg, qq.device)
    tma = tma_shapes(cfg, S, E, C, qq.device)
    wq, wf = weights(plan, C, causal, linear_norm, count0)
    # unwritten entries of A (above the diagonal, past a short chunk, the shape bound's slack rows)
    # are never read by the pointer kernels, but an op's outputs must be fully defined (torch.compile
    # compares them), and the backward's TMA path reads whole tiles: rows past a short chunk must be 0
    defined = zero_a
    zero_a = zero_a or (tma and plan.ragged)
    a = qq.new_zeros(plan.NC_alloc, H, C, C) if zero_a else qq.new_empty(plan.NC_alloc, H, C, C)
    o = torch.empty_like(v)
    bias, LB = kernel_bias(rel_bias)
    SDT, PREC = dot_config(qq.dtype)
    BG = cfg.bg
    NMT = cdiv(C, BG)
    # A's programs run in the state walk's launch, filling the SMs its last programs leave idle
    job = _ScoresJob(qq, kq, a, bias, float(scale), C, LB, NMT, BG, cfg.bs, bool(causal), plan.NC * NMT * NMT * H)
    st, final = states(kl, v, wf, plan, cfg, H=H, C=C, reverse=False, init=kv0 if causal else None, causal=causal,
                       sdt=sdt_torch(qq.dtype), tma=tma, scores=job, defined=defined)
    if plan.NC > 0:
        gemm((a, v, ql, st), wq, plan.ch_id if causal else plan.ch_seq, o, plan, cfg, tma=tma, S=S, E=E, H=H, C=C,
              NMT=NMT, BE=cfg.be_fwd, trans=False, causal=causal, PREC=PREC, SDT=SDT, warps=cfg.warps_fwd)
    if not causal:
        final = qq.new_empty(0, dtype=torch.float32)
    return o, final, a, st


def bwd_impl(do, dkv, qq, kq, ql, kl, v, rel_bias, count0, cu_seqlens, a, st, chunk_size, causal, scale,
              linear_norm, need_db, has_kv0, cfg: MixedChunkLaunch):
    """The backward launcher (``lintime::mixed_chunk_bwd`` and the eager path)."""
    B, T, H, S = qq.shape
    E = v.shape[-1]
    C = chunk_size
    dev = qq.device
    do = do.contiguous()
    cfg = cfg.thin_walk(num_seqs(B, cu_seqlens), H, S, E, dev)
    plan = plan_of(B, T, H, S, E, C, cu_seqlens, cfg, dev)
    tma = tma_shapes(cfg, S, E, C, dev)
    wq, wf = weights(plan, C, causal, linear_norm, count0)
    init = dkv.contiguous() if (causal and dkv is not None) else None
    idx = plan.ch_id if causal else plan.ch_seq
    bias, LB = kernel_bias(rel_bias)
    need_db = need_db and bias is not None
    SDT, PREC = dot_config(qq.dtype)
    BG = cfg.bg
    NMT = cdiv(C, BG)
    dv = torch.empty_like(v)
    dql, dkl = torch.empty_like(ql), torch.empty_like(kl)
    dqq, dkq = torch.empty_like(qq), torch.empty_like(kq)
    ds = qq.new_empty(plan.NC_alloc, H, C, C)
    ntd = 2 * NMT - 1
    # (no bias gradient: a 1-element placeholder the kernel never touches, not a fill)
    db_tiles = (torch.zeros((H, ntd, BG, BG), dtype=torch.float32, device=dev) if need_db
                else torch.empty(1, dtype=torch.float32, device=dev))
    # Under CUDA graph capture (CUDA graphs, torch.compile's "reduce-overhead") the dV GEMM is issued first on the
    # calling stream and the reductions on a second stream of higher priority, which the GPU gives the SMs first; the
    # GEMM fills the SMs around their tail.  Eager calls, bound by the host, keep one stream (a fork and a join cost
    # host time and gained nothing there).
    # Every tensor the second stream touches is allocated above on the calling stream and lives until the join below,
    # so the caching allocator needs no record_stream.  Under the interpreter (CPU tensors) the launches run in order.
    side = _side_stream(dev) if dev.type == "cuda" and torch.cuda.is_current_stream_capturing() else None
    gst, gfinal = states(ql, do, wq, plan, cfg, H=H, C=C, reverse=True, init=init, causal=causal,
                         sdt=sdt_torch(qq.dtype), tma=tma)
    if plan.NC > 0:
        rows = plan.NC * NMT
        NT = B * T
        BGR = cfg.bg_red
        NMTR = cdiv(C, BGR)
        b_ptr = bias if bias is not None else qq

        def dv_gemm():  # dV = wf Kl G + A^T dO
            gemm((a, do, kl, gst), wf, idx, dv, plan, cfg, tma=tma, S=S, E=E, H=H, C=C, NMT=NMT, BE=cfg.be_dv,
                 trans=True, causal=causal, PREC=PREC, SDT=SDT, warps=cfg.warps_bwd)

        def reductions():  # dS, dq_lin, dk_lin (one launch), then dq_quad, dk_quad and the bias gradient
            dr = None
            if tma and cfg.tma_red and E % cfg.be_red == 0 and S % cfg.bs == 0:
                dr = tma_descriptors((do, NT, (BGR, cfg.be_red)), (v, NT, (BGR, cfg.be_red)),
                                     (st, st.shape[0] * H * S, (cfg.bs, cfg.be_red)),
                                     (gst, gst.shape[0] * H * S, (cfg.bs, cfg.be_red)))
            mc_dred_kernel[(NMTR + cdiv(S, cfg.bs), plan.NC * NMTR, H)](
                qq, kq, v, do, ds, b_ptr, st, gst, wq, wf, idx, dql, dkl, plan.ch_start, plan.ch_len,
                *(dr or (do, v, st, gst)),
                float(scale), S, E, H, C, LB, NMTR, BG=BGR, BS=cfg.bs, BE=cfg.be_red, CAUSAL=causal,
                HAS_BIAS=bias is not None, PREC=PREC, SDT=SDT, TMA=dr is not None,
                num_warps=cfg.warps_red, num_stages=cfg.stages,
            )
            mc_dqk_kernel[(cdiv(S, cfg.bs), rows, H)](
                qq, kq, ds, dqq, dkq, db_tiles, plan.ch_start, plan.ch_len,
                float(scale), S, H, C, NMT, ntd, BG=BG, BS=cfg.bs, CAUSAL=causal, NEED_DB=need_db, PREC=PREC,
                num_warps=cfg.warps_bwd, num_stages=cfg.stages,
            )

        cur = side.fork() if side is not None else None  # after the states
        dv_gemm()
        with _on(side, cur):
            reductions()
        if side is not None:
            side.join(cur)
    db = fold_bias_grad(db_tiles, LB, C - 1, BG, rel_bias.dtype) if need_db else qq.new_empty(0)
    dkv0 = gfinal if (causal and has_kv0) else qq.new_empty(0, dtype=torch.float32)
    return dqq, dkq, dql, dkl, dv, db, dkv0


class _Side:
    """A second stream of one device for the backward's reductions under graph capture (:func:`bwd_impl`), with two
    events reused by every call: ``fork`` makes the second stream wait for the calling one, ``join`` the reverse.
    (A wait holds the event's record as of the wait, so re-recording it later is safe, in eager calls and under
    CUDA graph capture.)  Reused events and a plain ``set_stream`` keep the host cost of a fork and a join low:
    a fraction of that of ``Stream.wait_stream`` (a new event each time) and the ``torch.cuda.stream`` context
    manager."""

    def __init__(self, device: int):
        self.device = device
        self.stream = torch.cuda.Stream(device=device, priority=-1)  # scheduled before default-priority streams
        self.ev_fork = torch.cuda.Event()
        self.ev_join = torch.cuda.Event()

    def fork(self) -> torch.cuda.Stream:
        """Make the second stream wait for the calling stream's work so far; returns the calling stream."""
        cur = torch.cuda.current_stream(self.device)
        self.ev_fork.record(cur)
        self.stream.wait_event(self.ev_fork)
        return cur

    @contextlib.contextmanager
    def on(self, cur: torch.cuda.Stream):
        """Launches on the second stream; back to ``cur`` after."""
        torch.cuda.set_stream(self.stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(cur)

    def join(self, cur: torch.cuda.Stream):
        """Make ``cur`` wait for the second stream's work so far."""
        self.ev_join.record(self.stream)
        cur.wait_event(self.ev_join)


def _side_stream(dev: torch.device) -> _Side:
    """The :class:`_Side` of ``dev``, made once per device."""
    return _side_of(dev.index if dev.index is not None else torch.cuda.current_device())


@functools.cache
def _side_of(index: int) -> _Side:
    return _Side(index)


def _on(side: _Side | None, cur):
    """Launches on ``side``'s stream (forked from ``cur`` by the caller), or on the calling stream."""
    return side.on(cur) if side is not None else contextlib.nullcontext()
