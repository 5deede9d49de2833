"""The plan of a mixed chunk call: its chunk and segment tables and the per-chunk weights of the linear part (built
on the device: :func:`plan_kernel`, :func:`chunk_weights_kernel`), and the shape rules (chunks
per segment, whether loads go through TMA; the state walk's tile: :meth:`.launch.MixedChunkLaunch.thin_walk`).

Every rule here is a function of the call's shapes (and ``cu_seqlens``), never of values read from tensors the
forward and the backward could see differently, so both passes agree.  A static ``cu_seqlens``
(:func:`lintime.ops.utils.mark_static`) is read by the kernels alone: its plan's sizes are bounds from shapes.
What chose the rules: ``docs/design/kernels.md`` (mixed chunk attention).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lintime.ops.launching import cdiv, sm_count
from lintime.ops.mixed_chunk.triton.launch import MixedChunkLaunch
from lintime.ops.tma import tma_device
from lintime.ops.utils import is_static, num_seqs, packed_cache, sequence_bounds


def sdt_torch(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of per-chunk states: :func:`~lintime.ops.launching.dot_config`'s ``SDT`` as a torch dtype."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def chunk_bound(B: int, T: int, C: int, cu_seqlens) -> int:
    """Chunks of the call, or an upper bound from shapes alone (custom-op outputs must be sized
    without reading ``cu_seqlens``): ``sum_n ceil(L_n / C) <= N + T // C``."""
    if cu_seqlens is None:
        return B * math.ceil(T / C)
    return num_seqs(B, cu_seqlens) + T // C


def seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg: MixedChunkLaunch, device) -> int:
    """Chunks per segment of the state walk, from shapes only.  One segment per sequence when
    sequences x state tiles already give every SM a program; otherwise segments for about two walk
    programs per SM (all resident at once), never fewer than 2 chunks per segment: segments cost a start fix-up,
    cheaper than idle SMs but not free."""
    nct = max(1, chunk_bound(B, T, C, cu_seqlens))
    if cfg.seg_chunks > 0:
        return min(cfg.seg_chunks, nct)
    tiles = H * cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state)
    sms = sm_count(device)
    if num_seqs(B, cu_seqlens) * tiles >= sms:
        return nct
    want = max(1, 2 * sms // tiles)  # segments in all
    return min(nct, max(2, math.ceil(nct / want)))


def _seg_bound(B, T, C, cu_seqlens, G) -> int:
    """Segments, or a bound from shapes: ``sum_n max(1, ceil(nc_n / G)) <= N + NC // G``."""
    if cu_seqlens is None:
        return B * math.ceil(math.ceil(T / C) / G)
    return num_seqs(B, cu_seqlens) + chunk_bound(B, T, C, cu_seqlens) // G


def tma_shapes(cfg: MixedChunkLaunch, S: int, E: int, C: int, device: torch.device) -> bool:
    """Whether the kernels load through TMA descriptors at this shape (``MixedChunkLaunch.tma``, a TMA device,
    and every tile whole inside its head / chunk: ``S``, ``E``, ``C`` multiples of the tiles along
    them).  A function of the call's shape only, so the forward and the backward agree on it (the
    forward zero-fills ``A`` for the backward's TMA path when a chunk is short)."""
    return bool(
        cfg.tma and tma_device(device)
        and S % cfg.bk == 0 and S % cfg.bs_state == 0
        and E % cfg.be_fwd == 0 and E % cfg.be_dv == 0 and E % cfg.be_state == 0
        and C % cfg.bg == 0 and C % cfg.bk == 0
    )


@dataclass
class Plan:
    """Launch tables of one call (device int32) and their sizes.

    Chunk rows: every sequence's chunks, consecutive, then (a static ``cu_seqlens``) empty rows up to ``NC``.
    Segment rows: every sequence has at least one segment (an empty sequence one of no chunks, so every
    walk writes its sequence's result), then (static) rows of no segment up to ``NSEG``, never read by the
    per-sequence passes (``seq_ptr`` ends before them)."""

    N: int
    NC: int  # chunk rows the kernels run over: the chunks, or their bound for a static cu_seqlens
    NSEG: int  # segment rows, likewise
    NC_alloc: int  # rows of the per-chunk buffers (a bound from shapes: the custom op's outputs)
    NC_min: int  # rows that certainly hold a chunk (the walk writes them; an op output zero-fills the rest)
    one_segment: bool  # every sequence is one segment: NSEG == N, segment n is sequence n
    ragged: bool  # some chunk may be shorter than C
    ch_start: torch.Tensor
    ch_len: torch.Tensor
    ch_seq: torch.Tensor
    ch_k: torch.Tensor
    ch_id: torch.Tensor
    seg_first: torch.Tensor
    seg_n: torch.Tensor
    seg_seq: torch.Tensor
    seq_ptr: torch.Tensor
    lengths: torch.Tensor  # [N] on the device
    weights: dict  # (C, causal, linear_norm) -> (wq, wf) of calls without a state


def plan_of(B, T, H, S, E, C, cu_seqlens, cfg, device) -> Plan:
    """The call's tables; unpacked calls reuse those of the same shape (no host work, no copy), packed calls those of
    the same ``cu_seqlens`` tensor (:func:`lintime.ops.utils.packed_cache`: a model's layers and backward
    passes skip the host read of ``cu_seqlens`` and the rebuild).  A static ``cu_seqlens``
    (:func:`lintime.ops.utils.mark_static`) gets its tables built on the device at every call, sized by shapes: no
    host read, nothing cached (its values change under a replayed CUDA graph)."""
    if cu_seqlens is None:
        return _regular_plan(B, T, H, S, E, C, cfg, str(device))
    if is_static(cu_seqlens):
        return build_plan(B, T, H, S, E, C, cu_seqlens, cfg, device)
    entry = packed_cache(cu_seqlens, ("mixed_chunk", B, T, H, S, E, C, cfg, str(device)))
    if "plan" not in entry:
        entry["plan"] = build_plan(B, T, H, S, E, C, cu_seqlens, cfg, device)
    return entry["plan"]


@functools.lru_cache(maxsize=64)
def _regular_plan(B, T, H, S, E, C, cfg, device) -> Plan:
    return build_plan(B, T, H, S, E, C, None, cfg, torch.device(device))


def build_plan(B, T, H, S, E, C, cu_seqlens, cfg, device) -> Plan:
    """The tables of :func:`_tables`, built on the device from the offsets.  Their sizes: for an ordinary call the
    exact counts of chunks and segments, from the sequence bounds read on the host (once per ``cu_seqlens`` tensor,
    :func:`plan_of`); for a static ``cu_seqlens``, bounds from shapes (:func:`chunk_bound`; one segment per sequence
    where the segment length covers any sequence of ``T`` tokens, else :func:`_seg_bound` rows), nothing read."""
    G = seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg, device)
    NC_alloc = chunk_bound(B, T, C, cu_seqlens)
    N = num_seqs(B, cu_seqlens)
    if is_static(cu_seqlens):
        one = G >= cdiv(T, C)  # no sequence has more chunks than G
        NSEG = N if one else _seg_bound(B, T, C, cu_seqlens, G)
        t = _tables(cu_seqlens.detach(), N, NC_alloc, NSEG, C, G, device)
        # at least ceil(T / C) chunks hold the T tokens (cu_seqlens ends at T)
        return Plan(N, NC_alloc, NSEG, NC_alloc, min(cdiv(T, C), NC_alloc), one, True, *t, weights={})
    _, lengths = sequence_bounds(B, T, cu_seqlens)
    nch = (lengths + C - 1) // C
    nseg = ((nch + G - 1) // G).clamp(min=1)  # as plan_kernel counts them
    NC, NSEG = int(nch.sum()), int(nseg.sum())
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=device) * T
    else:
        cu = cu_seqlens.detach().to(device)
    t = _tables(cu, N, NC, NSEG, C, G, device)
    return Plan(N, NC, NSEG, NC_alloc, NC, bool((nseg == 1).all()), bool((lengths % C != 0).any()), *t, weights={})


def _tables(cu, N, NC, NSEG, C, G, device) -> list[torch.Tensor]:
    """``ch_start, ch_len, ch_seq, ch_k, ch_id [NC]``, ``seg_first, seg_n, seg_seq [NSEG]``, ``seq_ptr [N + 1]``,
    ``lengths [N]`` (int32 views of one buffer) of the offsets ``cu [N + 1]`` on ``device``: one launch of
    :func:`plan_kernel`."""
    sizes = [NC] * 5 + [NSEG] * 3 + [N + 1, N]
    flat = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    t = list(torch.split(flat, sizes))
    BLOCK = 64  # rows per program; each program searches all N sequences, BN at a time ([BLOCK, BN] compares)
    plan_kernel[(cdiv(max(NC, NSEG, N + 1), BLOCK),)](cu, *t, N, NC, NSEG, C, G, BLOCK=BLOCK, BN=64, num_warps=4)
    return t


def weights(plan: Plan, C, causal, linear_norm, count0):
    """Per chunk: ``wq`` (the linear part's ``1 / N``) and ``wf`` (whether the chunk's sum enters
    the states: a short last chunk of a causal call feeds no later token).  Kept with the plan
    for calls without a state."""
    if count0 is None:
        key = (C, causal, linear_norm)
        if key not in plan.weights:
            plan.weights[key] = _compute_weights(plan, C, causal, linear_norm, None)
        return plan.weights[key]
    return _compute_weights(plan, C, causal, linear_norm, count0)


_NORMS = {"none": 0, "chunk": 1, "tokens": 2}  # chunk_weights_kernel's NORM


def _compute_weights(plan: Plan, C, causal, linear_norm, count0):
    wq, wf = (torch.empty(plan.NC, dtype=torch.float32, device=plan.ch_len.device) for _ in range(2))
    if plan.NC > 0:
        BLOCK = 128  # chunk rows per program (elementwise)
        chunk_weights_kernel[(cdiv(plan.NC, BLOCK),)](
            plan.ch_len, plan.ch_k, plan.ch_seq, plan.lengths, count0 if count0 is not None else plan.lengths, wq, wf,
            plan.NC, C, 1.0 / C, CAUSAL=bool(causal), NORM=_NORMS[linear_norm], HAS_COUNT0=count0 is not None,
            BLOCK=BLOCK, num_warps=4,
        )
    return wq, wf


@triton.jit
def plan_kernel(
    CU, CH_START, CH_LEN, CH_SEQ, CH_K, CH_ID, SEG_FIRST, SEG_N, SEG_SEQ, SEQ_PTR, LENGTHS,
    N, NC, NSEG, C, G,
    BLOCK: tl.constexpr, BN: tl.constexpr,
):
    """The launch tables (int32) of the ``N`` sequences of the offsets ``CU [N + 1]``, for ``NC`` chunk rows and
    ``NSEG`` segment rows (at least the real counts), read and written on the device alone (no host read, sizes from
    the arguments: a CUDA graph replays it with new offsets).  Program ``p`` fills chunk row, segment row and
    ``SEQ_PTR`` entry ``o = p BLOCK + i``, each sequence ``n < N`` (``LENGTHS``) once.  Grid
    ``cdiv(max(NC, NSEG, N + 1), BLOCK)``.

    Sequence ``n`` has ``nch_n = ceil(L_n / C)`` chunks and ``nseg_n = max(1, ceil(nch_n / G))`` segments (an empty
    one: one segment of no chunks); ``ch_end``, ``seg_end`` are their inclusive prefix sums.  Chunk row ``c`` is
    chunk ``k = c - ch_end[n - 1]`` of sequence ``n = #{m : ch_end[m] <= c}`` (a sorted search: count, and the
    largest such ``ch_end`` is the sequence's first chunk), its tokens from ``CU[n] + k C``; segment rows likewise
    over ``seg_end``, ``G`` chunks each.  Rows past the real ones (``n = N``) are empty: chunk length 0 at the end
    of the last sequence, segments of no chunks with ``SEG_SEQ = N - 1`` (past ``SEQ_PTR[N]``: no pass reads them
    as part of a sequence)."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o_n = tl.arange(0, BN)
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    cnt_c, first_c, cnt_s, ptr_s, first_s, ptr_n = zero, zero, zero, zero, zero, zero
    car_c = tl.full([], 0, tl.int32)
    car_s = tl.full([], 0, tl.int32)
    for n0 in range(0, N, BN):
        n = n0 + o_n
        m = n < N
        lo = tl.load(CU + n, mask=m, other=0).to(tl.int32)
        hi = tl.load(CU + n + 1, mask=m, other=0).to(tl.int32)
        nch = (hi - lo + C - 1) // C
        nseg = tl.where(m, tl.maximum((nch + G - 1) // G, 1), 0)
        ch_end = tl.cumsum(nch, 0) + car_c
        seg_end = tl.cumsum(nseg, 0) + car_s
        car_c += tl.sum(nch, 0)
        car_s += tl.sum(nseg, 0)
        le = m[None, :] & (ch_end[None, :] <= o[:, None])
        cnt_c += tl.sum(le.to(tl.int32), 1)
        first_c = tl.maximum(first_c, tl.max(tl.where(le, ch_end[None, :], 0), 1))
        le = m[None, :] & (seg_end[None, :] <= o[:, None])
        cnt_s += tl.sum(le.to(tl.int32), 1)
        ptr_s = tl.maximum(ptr_s, tl.max(tl.where(le, seg_end[None, :], 0), 1))
        first_s = tl.maximum(first_s, tl.max(tl.where(le, ch_end[None, :], 0), 1))
        ptr_n += tl.sum(tl.where(m[None, :] & (n[None, :] < o[:, None]), nseg[None, :], 0), 1)
    # chunk rows
    m_c = o < NC
    real = cnt_c < N
    seq = tl.minimum(cnt_c, N - 1)
    lo = tl.load(CU + seq, mask=m_c, other=0).to(tl.int32)
    hi = tl.load(CU + seq + 1, mask=m_c, other=0).to(tl.int32)
    k = tl.where(real, o - first_c, 0)
    tl.store(CH_START + o, tl.where(real, lo + k * C, hi), mask=m_c)
    tl.store(CH_LEN + o, tl.where(real, tl.minimum(hi - lo - k * C, C), 0), mask=m_c)
    tl.store(CH_SEQ + o, seq, mask=m_c)
    tl.store(CH_K + o, k, mask=m_c)
    tl.store(CH_ID + o, o, mask=m_c)
    # segment rows
    m_s = o < NSEG
    real = cnt_s < N
    seq = tl.minimum(cnt_s, N - 1)
    lo = tl.load(CU + seq, mask=m_s, other=0).to(tl.int32)
    hi = tl.load(CU + seq + 1, mask=m_s, other=0).to(tl.int32)
    k = o - ptr_s
    tl.store(SEG_FIRST + o, tl.where(real, first_s + k * G, 0), mask=m_s)
    tl.store(SEG_N + o, tl.where(real, tl.minimum((hi - lo + C - 1) // C - k * G, G), 0), mask=m_s)
    tl.store(SEG_SEQ + o, seq, mask=m_s)
    # sequences
    tl.store(SEQ_PTR + o, ptr_n, mask=o <= N)
    m_q = o < N
    lo = tl.load(CU + o, mask=m_q, other=0).to(tl.int32)
    hi = tl.load(CU + o + 1, mask=m_q, other=0).to(tl.int32)
    tl.store(LENGTHS + o, hi - lo, mask=m_q)


@triton.jit
def chunk_weights_kernel(
    CH_LEN, CH_K, CH_SEQ, LENGTHS, COUNT0, WQ, WF, NC, C, inv_c,
    CAUSAL: tl.constexpr, NORM: tl.constexpr, HAS_COUNT0: tl.constexpr, BLOCK: tl.constexpr,
):
    """Per chunk row: ``WF`` (whether the chunk's sum enters the states: 0 for a short chunk of a causal call, which
    no later token sees) and ``WQ`` (the linear part's ``1 / N``: ``NORM`` 0 ``'none'`` 1, 1 ``'chunk'``
    ``inv_c = 1 / C``, 2 ``'tokens'`` one over the tokens in the sum -- the chunks before, plus the state's
    ``COUNT0``, or non-causal the sequence -- and 0 for an empty sum).  Grid ``cdiv(NC, BLOCK)``."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < NC
    ln = tl.load(CH_LEN + o, mask=m, other=0)
    if CAUSAL:
        wf = tl.where(ln == C, 1.0, 0.0)
    else:
        wf = tl.full([BLOCK], 1.0, dtype=tl.float32)
    if NORM == 0:
        wq = tl.full([BLOCK], 1.0, dtype=tl.float32)
    elif NORM == 1:
        wq = tl.full([BLOCK], 1.0, dtype=tl.float32) * inv_c
    else:
        seq = tl.load(CH_SEQ + o, mask=m, other=0)
        if CAUSAL:
            n = tl.load(CH_K + o, mask=m, other=0).to(tl.int64) * C
            if HAS_COUNT0:
                n += tl.load(COUNT0 + seq, mask=m, other=0).to(tl.int64)
        else:
            n = tl.load(LENGTHS + seq, mask=m, other=0).to(tl.int64)
        wq = tl.where(n > 0, tl.math.div_rn(1.0, tl.maximum(n, 1).to(tl.float32)), 0.0)
    tl.store(WF + o, wf, mask=m)
    tl.store(WQ + o, wq, mask=m)
