"""Host-side plan of a mixed chunk call: its chunk and segment tables, the per-chunk weights of the linear part,
and the shape rules (chunks per segment, the state walk's tile, whether loads go through TMA).

Every rule here is a function of the call's shapes (and ``cu_seqlens``), never of values read from tensors the
forward and the backward could see differently, so both passes agree.  Device times below: CUDA-graph fwd+bwd ms
at ``S = 128, E = 2048, C = 256``, bf16, 32k tokens per batch, H200 (132 SMs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from lintime.ops.launch_tables import sequence_bounds, to_device
from lintime.ops.mixed_chunk.triton.launch import MixedChunkLaunch
from lintime.ops.kernel_launch import cdiv, sm_count
from lintime.ops.tma import tma_device
from lintime.ops.utils import packed_cache


def sdt_torch(dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of per-chunk states: :func:`~lintime.ops.kernel_launch.dot_config`'s ``SDT`` as a torch dtype."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def n_seqs(B: int, cu_seqlens) -> int:
    return B if cu_seqlens is None else cu_seqlens.shape[0] - 1


def chunk_bound(B: int, T: int, C: int, cu_seqlens) -> int:
    """Chunks of the call, or an upper bound from shapes alone (custom-op outputs must be sized
    without reading ``cu_seqlens``): ``sum_n ceil(L_n / C) <= N + T // C``."""
    if cu_seqlens is None:
        return B * math.ceil(T / C)
    return n_seqs(B, cu_seqlens) + T // C


def seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg: MixedChunkLaunch, device) -> int:
    """Chunks per segment of the state walk, from shapes only.  One segment per sequence when
    sequences x state tiles already give every SM a program; otherwise segments for about two walk
    programs per SM (all resident at once), never fewer than 2 chunks per segment: at 4k one segment 0.640 vs
    8-chunk segments 0.708 ms, at 16k 16-chunk segments 0.716 vs one segment 0.895 (2026-11-22)."""
    nct = max(1, chunk_bound(B, T, C, cu_seqlens))
    if cfg.seg_chunks > 0:
        return min(cfg.seg_chunks, nct)
    tiles = H * cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state)
    sms = sm_count(device)
    if n_seqs(B, cu_seqlens) * tiles >= sms:
        return nct
    want = max(1, 2 * sms // tiles)  # segments in all
    return min(nct, max(2, math.ceil(nct / want)))


def walk_launch(B, T, H, S, E, C, cu_seqlens, cfg: MixedChunkLaunch, device) -> MixedChunkLaunch:
    """``cfg`` with the state walk's ``S`` tile halved (once, from more than 64) where that alone gives every SM a
    walk program with one segment per sequence -- sequences x tiles short of the SM count at ``bs_state``, enough
    at half of it -- so no segment-start fix-up runs; automatic segments only (``seg_chunks = 0``).  From shapes
    only: the forward and the backward agree.  At 8k (4 sequences x 32 [128, 64] tiles = 128 programs) one segment
    on [64, 64] tiles 0.638-0.643 vs 16-chunk segments 0.665 ms; thinner tiles lose at 4k and 16k (2026-11-26)."""
    if cfg.seg_chunks or cfg.bs_state <= 64:
        return cfg
    return _thin_walk(n_seqs(B, cu_seqlens), H, S, E, cfg, str(device))


@functools.lru_cache(maxsize=64)
def _thin_walk(n, H, S, E, cfg: MixedChunkLaunch, device: str) -> MixedChunkLaunch:
    tiles = H * cdiv(S, cfg.bs_state) * cdiv(E, cfg.be_state)
    thin = H * cdiv(S, cfg.bs_state // 2) * cdiv(E, cfg.be_state)
    if n * tiles < sm_count(torch.device(device)) <= n * thin:
        return dataclasses.replace(cfg, bs_state=cfg.bs_state // 2)
    return cfg


def _seg_bound(B, T, C, cu_seqlens, G) -> int:
    """Segments, or a bound from shapes: ``sum_n ceil(nc_n / G) <= N + NC // G``."""
    if cu_seqlens is None:
        return B * math.ceil(math.ceil(T / C) / G)
    return n_seqs(B, cu_seqlens) + chunk_bound(B, T, C, cu_seqlens) // G


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
    """Launch tables of one call (device int32) and their sizes."""

    N: int
    NC: int
    NSEG: int
    NC_alloc: int
    NSEG_alloc: int
    one_segment: bool  # every sequence is one segment
    ragged: bool  # some chunk is shorter than C
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
    passes skip the host read of ``cu_seqlens`` and the rebuild)."""
    if cu_seqlens is None:
        return _regular_plan(B, T, H, S, E, C, cfg, str(device))
    entry = packed_cache(cu_seqlens, ("mixed_chunk", B, T, H, S, E, C, cfg, str(device)))
    if "plan" not in entry:
        entry["plan"] = build_plan(B, T, H, S, E, C, cu_seqlens, cfg, device)
    return entry["plan"]


@functools.lru_cache(maxsize=64)
def _regular_plan(B, T, H, S, E, C, cfg, device) -> Plan:
    return build_plan(B, T, H, S, E, C, None, cfg, torch.device(device))


def build_plan(B, T, H, S, E, C, cu_seqlens, cfg, device) -> Plan:
    G = seg_chunks(B, T, H, S, E, C, cu_seqlens, cfg, device)
    starts, lengths = sequence_bounds(B, T, cu_seqlens)
    N = lengths.numel()
    nch = (lengths + C - 1) // C  # [N]
    seq = torch.arange(N)
    ch_seq = torch.repeat_interleave(seq, nch)
    first_ch = torch.cumsum(nch, 0) - nch
    ch_k = torch.arange(ch_seq.numel()) - first_ch[ch_seq]
    ch_start = starts[ch_seq] + ch_k * C
    ch_len = torch.clamp(lengths[ch_seq] - ch_k * C, max=C)
    nseg = (nch + G - 1) // G
    seq_ptr = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(nseg, 0)])
    seg_seq = torch.repeat_interleave(seq, nseg)
    seg_k = torch.arange(seg_seq.numel()) - seq_ptr[seg_seq]
    seg_first = first_ch[seg_seq] + seg_k * G
    seg_n = torch.clamp(nch[seg_seq] - seg_k * G, max=G)
    t = to_device(device, ch_start, ch_len, ch_seq, ch_k, torch.arange(ch_seq.numel()), seg_first, seg_n, seg_seq,
                  seq_ptr, lengths)
    one = bool((nseg <= 1).all())
    ragged = bool((ch_len < C).any())
    return Plan(N, ch_seq.numel(), seg_seq.numel(), chunk_bound(B, T, C, cu_seqlens),
                _seg_bound(B, T, C, cu_seqlens, G), one, ragged, *t, weights={})


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


def _compute_weights(plan: Plan, C, causal, linear_norm, count0):
    seq, k, ln = plan.ch_seq.long(), plan.ch_k.long(), plan.ch_len
    if causal:
        wf = (ln == C).to(torch.float32)
    else:
        wf = torch.ones(plan.NC, dtype=torch.float32, device=ln.device)
    if linear_norm == "none":
        wq = torch.ones_like(wf)
    elif linear_norm == "chunk":
        wq = torch.full_like(wf, 1.0 / C)
    else:  # 'tokens': tokens in the sum (seed Code 8's normalised mask); an empty sum gives 0
        if causal:
            n = k * C
            if count0 is not None:
                n = n + count0.to(n.device).long()[seq]
        else:
            n = plan.lengths.long()[seq]
        wq = torch.where(n > 0, 1.0 / n.clamp(min=1).to(torch.float32), torch.zeros_like(wf))
    return wq.contiguous(), wf.contiguous()
