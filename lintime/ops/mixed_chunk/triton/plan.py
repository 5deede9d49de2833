"""The plan of a mixed chunk call: its chunk and segment tables (:func:`lintime.ops.utils.segments.chunk_plan`, the
shared planner, cached by its one rule), the per-chunk weights of the linear part (:func:`chunk_weights_kernel`),
and the shape rules (chunks per segment, whether loads go through TMA; the state walk's tile:
:meth:`.launch.MixedChunkLaunch.thin_walk`).

Every rule here is a function of the call's shapes (and ``cu_seqlens``), never of values read from tensors the
forward and the backward could see differently, so both passes agree.  A static ``cu_seqlens``
(:func:`lintime.ops.utils.mark_static`) is read by the kernels alone: its plan's sizes are bounds from shapes.
What chose the rules: ``docs/design/kernels.md`` (mixed chunk attention).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from lintime.ops.utils.launching import cdiv, sm_count
from lintime.ops.mixed_chunk.triton.launch import MixedChunkLaunch
from lintime.ops.utils.segments import ChunkPlan, cached_plan, chunk_bound, chunk_plan
from lintime.ops.utils.tma import tma_device
from lintime.ops.utils import num_seqs


def sdt_torch(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of per-chunk states: :func:`~lintime.ops.utils.launching.dot_config`'s ``SDT`` as a torch dtype."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


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


def plan_of(B, T, H, S, E, C, cu_seqlens, cfg, device) -> ChunkPlan:
    """The call's tables (:func:`lintime.ops.utils.segments.chunk_plan`, segments of :func:`seg_chunks` chunks), kept by
    the planners' one caching rule (:func:`lintime.ops.utils.segments.cached_plan`: per shape, per ``cu_seqlens`` tensor,
    or rebuilt on the device at every call for a static ``cu_seqlens``)."""
    return cached_plan("mixed_chunk", B, T, cu_seqlens, device, (H, S, E, C, cfg), lambda cu: chunk_plan(
        B, T, C, seg_chunks(B, T, H, S, E, C, cu, cfg, device), cu, device))


def weights(plan: ChunkPlan, C, causal, linear_norm, count0):
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


def _compute_weights(plan: ChunkPlan, C, causal, linear_norm, count0):
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
