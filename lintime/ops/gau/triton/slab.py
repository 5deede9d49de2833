"""GAU attention by slabs: relu^2 scores materialised for a slab of rows, the ``E``-wide products as GEMMs.

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``S`` query/key width, ``E`` value width, ``R`` slab height
(:func:`slab_rows`: ``GauLaunch.slab`` rows, taller on long sequences), ``BM`` the square score tile of the two
kernels below (``GauLaunch.bm_slab``), ``NTD = 2 ceil(T / BM) - 1`` bias tile diagonals.

Why.  With ``E = 2048`` a FlashAttention-shaped kernel cannot hold a query tile's whole output row on chip:
the tiled kernels (:mod:`lintime.ops.gau.triton.kernels`) keep a ``[64, 512]`` accumulator, recompute the
scores per ``E`` tile and re-stream ``v`` from L2 for every 64 query rows, which caps them far below the matmul
peak.  Here the scores ``P = relu(scale q k^T + b)^2`` (``S``-wide products: 1/16 of the work at
``S = 128, E = 2048``) are written for ``R`` rows at a time -- ``R x T`` elements per sequence, a few MB that
stay in L2, memory linear in ``T`` for a fixed ``R``; no ``T x T`` tensor -- and the ``E``-wide products run as
long-K GEMMs (cuBLAS through ``torch.bmm``: ``P V``, ``dO V^T``, ``P^T dO``, ``dS^T q``).

Forward, per query slab ``[r0, r1)`` (keys ``[0, kend)``, ``kend = r1`` causal, ``T`` not):
``P = relu2(scale q k^T + b)`` by :func:`slab_fwd_scores_kernel` (one ``[BM, BM]`` tile per program, causal
zeros above the diagonal), then ``o[r0:r1] = P @ v[:kend]``.

Backward, per key slab ``[c0, c1)`` (query rows ``[q0, T)``, ``q0 = c0`` causal, 0 not): the GEMM
``dP = do[q0:] v[c0:c1]^T``; :func:`slab_bwd_scores_kernel` (one program per ``BM`` query rows) recomputes the
scores, writes ``P`` and ``dS = 2 relu(s) dP scale`` (over ``dP``, in place), adds ``dS k`` to the fp32 ``dq``
rows it owns and the bias gradient per tile diagonal (fp32 atomics, folded by
:func:`~lintime.ops.utils.bias.fold_bias_grad`); then the GEMMs ``dv[c0:c1] = P^T do[q0:]`` and
``dk[c0:c1] = dS^T q[q0:]`` write their rows once (no accumulation across slabs).

The causal waste is the upper half of each diagonal ``[R, R]`` block in the GEMMs: a fraction ``R / T`` of
the useful work.  Packed calls (``cu_seqlens``) whose sequences all have one length take the slab path as one
``[n, L]`` view; packed calls of mixed lengths whose sequences tile rows of one length (training batches) take it as
``[N / L, L]`` rows with the pairs across sequences masked, where that is not much more work than the tiled kernels'
(:func:`packed_rows`, :class:`RowMask`); other packed calls take the tiled kernels.  ``S > 256`` takes the tiled
kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lintime.ops.utils.bias import fold_bias_grad, kernel_bias
from lintime.ops.gau.triton.kernels import _bias_tile
from lintime.ops.gau.triton.launch import GauLaunch, bias_tiles
from lintime.ops.utils.launching import block, cdiv, dot_config

MAX_S = 256  # widest q / k the slab kernels keep in one tile (wider: the tiled kernels)


@triton.jit
def _slab_scores(K, BIAS, ST, EN, b_q, i_b, i_h, m0, n0, kmax, mmax, T, H, S, NTD, scale,
                 BM: tl.constexpr, BS: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 MASKED: tl.constexpr, PREC: tl.constexpr):
    """Scores ``s = scale q k^T + b`` (fp32 ``[BM, BM]``) of query rows ``m0..`` (their tile ``b_q``) and keys
    ``n0..`` of row ``i_b``, the mask of the pairs that count (key ``< kmax``, query ``< mmax``, causal; with
    ``MASKED`` also key in ``[ST[i], EN[i])``, the query's own sequence inside a row of a packed call) and the key
    tile."""
    o_m = m0 + tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BM)
    o_s = tl.arange(0, BS)
    m_n = o_n < kmax
    rows_n = (i_b.to(tl.int64) * T + o_n) * H + i_h
    b_k = tl.load(K + rows_n[:, None] * S + o_s[None, :], mask=m_n[:, None] & (o_s < S)[None, :], other=0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale
    if HAS_BIAS:
        b_s += _bias_tile(BIAS, BIAS, i_h, m0, n0, NTD, BM, False)
    m_m = o_m < mmax
    keep = m_m[:, None] & m_n[None, :]
    if CAUSAL:
        keep = keep & (o_n[None, :] <= o_m[:, None])
    if MASKED:
        tok = i_b.to(tl.int64) * T + o_m
        st = tl.load(ST + tok, mask=m_m, other=0)
        en = tl.load(EN + tok, mask=m_m, other=0)
        keep = keep & (o_n[None, :] >= st[:, None]) & (o_n[None, :] < en[:, None])
    return b_s, keep, b_k


@triton.jit
def _load_rows(X, i_b, i_h, m0, mmax, T, H, S, BM: tl.constexpr, BS: tl.constexpr):
    """Rows ``m0 .. m0 + BM`` (those ``< mmax``) of sequence ``i_b``, head ``i_h`` of a ``[B, T, H, S]`` tensor, as
    a ``[BM, BS]`` tile padded with zeros."""
    o_m = m0 + tl.arange(0, BM)
    o_s = tl.arange(0, BS)
    rows = (i_b.to(tl.int64) * T + o_m) * H + i_h
    return tl.load(X + rows[:, None] * S + o_s[None, :], mask=(o_m < mmax)[:, None] & (o_s < S)[None, :], other=0.0)


@triton.jit
def slab_fwd_scores_kernel(
    Q, K, P, BIAS, ST, EN, r0, r1, k0, kend, T, H, i_h, S, NTD, stride_pb, stride_pr, scale,
    BM: tl.constexpr, BS: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr,
    PREC: tl.constexpr,
):
    """``P[b, i - r0, j - k0] = relu(scale q_i . k_j + b[i - j])^2`` for query rows ``i`` in ``[r0, r1)`` and keys
    ``j`` in ``[k0, kend)`` of head ``i_h`` (0 where causal or, with ``MASKED``, the rows' sequences mask: see
    :func:`_slab_scores`; the GEMM reads the whole ``[r1 - r0, kend - k0]`` block); grid ``(key tiles, query tiles,
    B)``, one ``[BM, BM]`` tile each (``k0`` a multiple of ``BM``).  ``P`` is ``[B, R, >= kend - k0]`` with strides
    ``(stride_pb, stride_pr, 1)``."""
    i_n, i_m, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0 = r0 + i_m * BM
    n0 = k0 + i_n * BM
    o_m = m0 + tl.arange(0, BM)
    o_n = n0 + tl.arange(0, BM)
    m_st = (o_m < r1)[:, None] & (o_n < kend)[None, :]
    p_p = P + i_b.to(tl.int64) * stride_pb + (o_m - r0).to(tl.int64)[:, None] * stride_pr + (o_n - k0)[None, :]
    if CAUSAL:
        last = m0 + BM - 1  # the last key any row of this tile sees
    else:
        last = kend
    if n0 > last:  # above the diagonal: zeros for the GEMM, no scores
        tl.store(p_p, tl.zeros([BM, BM], dtype=P.dtype.element_ty), mask=m_st)
    else:
        b_q = _load_rows(Q, i_b, i_h, m0, r1, T, H, S, BM, BS)
        b_s, keep, _ = _slab_scores(K, BIAS, ST, EN, b_q, i_b, i_h, m0, n0, kend, r1, T, H, S, NTD, scale,
                                    BM, BS, CAUSAL, HAS_BIAS, MASKED, PREC)
        b_r = tl.maximum(b_s, 0.0)
        tl.store(p_p, tl.where(keep, b_r * b_r, 0.0).to(P.dtype.element_ty), mask=m_st)  # seed Eq. 5: relu^2


@triton.jit
def slab_bwd_scores_kernel(
    Q, K, DP, P, DQ, DB, BIAS, ST, EN, c0, c1, q0, q1, T, H, i_h, S, NTD, stride_b, stride_r, scale,
    BM: tl.constexpr, BS: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr,
    MASKED: tl.constexpr, PREC: tl.constexpr,
):
    """Key slab ``[c0, c1)`` against query rows ``[q0, q1)`` of head ``i_h`` (``MASKED``: pairs across the rows'
    sequences are zero, :func:`_slab_scores`): reads ``dP [B, q1 - q0, c1 - c0]``
    (``do . v``, from the GEMM; strides ``(stride_b, stride_r, 1)``), writes ``P`` (same layout) and
    ``dS = 2 relu(s) dP scale`` over ``dP``, adds ``dS k`` to the fp32 ``DQ`` rows of this program (it alone
    writes them in this launch) and, with ``NEED_DB``, ``2 relu(s) dP`` to the bias gradient's tile of each
    tile diagonal (``DB [H, NTD, BM, BM]``, fp32 atomics).  Grid ``(query tiles, B)``; the program walks the
    slab's key tiles."""
    i_m, i_b = tl.program_id(0), tl.program_id(1)
    m0 = q0 + i_m * BM
    o_m = m0 + tl.arange(0, BM)
    m_m = o_m < q1
    o_s = tl.arange(0, BS)
    o_b = tl.arange(0, BM)
    b_q = _load_rows(Q, i_b, i_h, m0, q1, T, H, S, BM, BS)
    b_dq = tl.zeros([BM, BS], dtype=tl.float32)
    base = i_b.to(tl.int64) * stride_b + (o_m - q0).to(tl.int64)[:, None] * stride_r
    mid = (NTD - 1) // 2
    if CAUSAL:
        last = m0 + BM - 1  # the last key any row of this tile sees
    else:
        last = c1
    for n0 in range(c0, c1, BM):
        o_c = n0 - c0 + tl.arange(0, BM)  # columns inside the slab
        m_st = m_m[:, None] & (o_c < c1 - c0)[None, :]
        if n0 > last:  # above the diagonal: zeros for the GEMMs
            tl.store(P + base + o_c[None, :], tl.zeros([BM, BM], dtype=P.dtype.element_ty), mask=m_st)
            tl.store(DP + base + o_c[None, :], tl.zeros([BM, BM], dtype=DP.dtype.element_ty), mask=m_st)
        else:
            b_s, keep, b_k = _slab_scores(K, BIAS, ST, EN, b_q, i_b, i_h, m0, n0, c1, q1, T, H, S, NTD, scale,
                                          BM, BS, CAUSAL, HAS_BIAS, MASKED, PREC)
            b_r = tl.where(keep, tl.maximum(b_s, 0.0), 0.0)
            b_dp = tl.load(DP + base + o_c[None, :], mask=m_st, other=0.0).to(tl.float32)
            b_ds = 2.0 * b_r * b_dp  # d relu(s)^2 / ds
            if NEED_DB:
                p_db = DB + ((i_h * NTD + (m0 - n0) // BM + mid).to(tl.int64) * BM + o_b[:, None]) * BM + o_b[None, :]
                tl.atomic_add(p_db, b_ds, sem="relaxed")
            b_ds = b_ds * scale
            tl.store(P + base + o_c[None, :], (b_r * b_r).to(P.dtype.element_ty), mask=m_st)
            tl.store(DP + base + o_c[None, :], b_ds.to(DP.dtype.element_ty), mask=m_st)
            b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=PREC)
    rows_m = (i_b.to(tl.int64) * T + o_m) * H + i_h
    p_dq = DQ + rows_m[:, None] * S + o_s[None, :]
    m_dq = m_m[:, None] & (o_s < S)[None, :]
    tl.store(p_dq, tl.load(p_dq, mask=m_dq, other=0.0) + b_dq, mask=m_dq)


def slab_on(cfg: GauLaunch, S: int) -> bool:
    """Whether the slab path is on for ``S``-wide keys: ``GauLaunch.slab > 0`` and ``S <= MAX_S``."""
    return cfg.slab > 0 and S <= MAX_S


def slab_applies(cfg: GauLaunch, S: int, cu_seqlens) -> bool:
    """Whether an unpacked call takes the slab path (packed calls: :func:`one_length_run`, :func:`packed_rows`)."""
    return cu_seqlens is None and slab_on(cfg, S)


def slab_rows(T: int, cfg: GauLaunch) -> int:
    """Rows per slab for sequences of ``T`` tokens: ``GauLaunch.slab``, doubled for every factor of 4 by which ``T``
    exceeds 4096 up to ``GauLaunch.slab_max`` (0: no growth); a multiple of the score tile, at most ``T`` rounded
    up to one.  Taller slabs mean fewer, longer GEMMs and launches but a larger causal waste (``R / T``) and
    ``R x T`` buffers; the rule is the fastest slab height per length (``docs/design/kernels.md``, GAU attention)."""
    bm = cfg.bm_slab
    R, t = cfg.slab, 4096
    while T > t and R * 2 <= cfg.slab_max:
        R, t = R * 2, t * 4
    return max(bm, min(R // bm * bm, cdiv(T, bm) * bm))


def one_length_run(starts: torch.Tensor, lengths: torch.Tensor, cfg: GauLaunch, S: int):
    """``(first token, n, L)`` when the slab path is on and a packed call's ``n`` non-empty sequences all have one
    length ``L`` -- consecutive tokens, which the slab path takes as one ``[n, L]`` batch, the same work as an
    unpacked call (``lintime bench model``'s batches, equal-length sequences packed by a user) --, else None.
    (``starts``, ``lengths``: CPU int tensors, in token order.)"""
    used = lengths > 0
    if not slab_on(cfg, S) or not bool(used.any()):
        return None
    L = int(lengths[used][0])
    if not bool((lengths[used] == L).all()):
        return None
    return int(starts[used][0]), int(used.sum()), L


# How much cheaper a pair of the slab path is than one of the tiled kernels, with a margin below the measured
# ratio (docs/design/kernels.md, GAU attention)
SLAB_PAIR_RATIO = 1.6


@dataclass
class RowMask:
    """A packed call run by slabs over ``[n, L]`` rows of its tokens, pairs across its sequences masked
    (:func:`packed_rows`): ``st`` / ``en`` ``[n L]`` (int32, device) the first and one-past-last position inside
    its row of each token's sequence; per slab ``s`` of ``R`` rows (host ints), ``k0[s]`` the first key any of its
    query rows sees in any row (down to a tile) and ``hi[s]`` one past the last query row that sees one of its keys
    (the end of the furthest sequence holding its last position)."""

    L: int
    R: int
    st: torch.Tensor
    en: torch.Tensor
    k0: list
    hi: list

    def keys(self, r0: int, r1: int, causal: bool) -> tuple[int, int]:
        """``[k0, kend)``: the keys that query rows ``[r0, r1)`` (slab ``r0 // R``) see in some row."""
        s = r0 // self.R
        return self.k0[s], (r1 if causal else self.hi[s])

    def queries(self, c0: int, causal: bool) -> tuple[int, int]:
        """``[q0, q1)``: the query rows that see some key of the slab starting at ``c0`` in some row."""
        s = c0 // self.R
        return (c0 if causal else self.k0[s]), self.hi[s]


def _tile_pairs(lengths: torch.Tensor, bm: int, causal: bool) -> int:
    """``[bm, bm]`` tile pairs the tiled kernels compute for sequences of these lengths."""
    nt = (lengths + bm - 1) // bm
    return int((nt * (nt + 1) // 2).sum() if causal else (nt * nt).sum()) * bm * bm


def packed_rows(starts: torch.Tensor, lengths: torch.Tensor, N: int, T_max: int, cfg: GauLaunch, S: int, causal: bool,
                cu_seqlens: torch.Tensor, device: torch.device) -> RowMask | None:
    """Whether a packed call of ``N`` tokens (sequences ``starts`` / ``lengths``, CPU, in token order; ``cu_seqlens``
    as the call has it) runs by slabs over ``[N / L, L]`` rows with the pairs across sequences masked, and how: the
    smallest ``L`` at least the longest sequence that divides ``N`` and whose multiples are all sequence boundaries --
    a training batch's rows (the data packer starts a sequence at every row) -- if the slabs' work (every
    slab's ``[R, kend - k0]`` block in every row) is at most :data:`SLAB_PAIR_RATIO` times the tiled kernels' (the
    in-sequence tile pairs).  Else None: the tiled kernels.  ``L`` is at most ``T_max`` (the call's ``T``: its bias
    covers offsets below it).  ``GauLaunch.slab_masked`` 0 turns it off, 2 skips the work comparison (tests).
    Host work:
    a few small ``[rows, slabs]`` tables; the per-token ones are built on the device, and only for rows taken."""
    if not cfg.slab_masked or not slab_on(cfg, S) or N == 0:
        return None
    used = lengths > 0
    if not bool(used.any()):
        return None
    starts, lengths = starts[used], lengths[used]
    lmax = int(lengths.max())
    bounds = set(starts.tolist()) | {N}
    divisors = sorted({d for i in range(1, math.isqrt(N) + 1) if N % i == 0 for d in (i, N // i)})
    L = next((L for L in divisors if L >= lmax and all(m * L in bounds for m in range(N // L))), None)
    if L is None or L > T_max:
        return None
    R, bm = slab_rows(L, cfg), cfg.bm_slab
    rows, lo = N // L, torch.arange(0, L, R)
    hi_pos = torch.clamp(lo + R, max=L) - 1
    row0 = torch.arange(rows)[:, None] * L
    ends = starts + lengths

    def seq_at(pos):  # the (non-empty) sequence holding each flat position
        return torch.searchsorted(ends, pos.reshape(-1), right=True).view(pos.shape)

    k0 = ((starts[seq_at(row0 + lo)] - row0).min(0).values // bm * bm).tolist()
    hi = (ends[seq_at(row0 + hi_pos)] - row0).max(0).values.tolist()
    if cfg.slab_masked != 2:
        work = sum((min(r0 + R, L) if causal else h) - k for r0, k, h in zip(lo.tolist(), k0, hi)) * R * rows
        if work > SLAB_PAIR_RATIO * _tile_pairs(lengths, cfg.bm, causal):
            return None
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    tok = torch.arange(N, device=device, dtype=torch.int32)
    seq = torch.searchsorted(cu, tok, right=True) - 1
    first = tok // L * L
    return RowMask(L, R, cu[seq] - first, cu[seq + 1] - first, k0, hi)


def _geometry(T: int, cfg: GauLaunch) -> tuple[int, int, int]:
    """``(R, BM, NTD)``: the slab height (:func:`slab_rows`), the score tile and the number of bias tile
    diagonals."""
    return slab_rows(T, cfg), cfg.bm_slab, 2 * cdiv(T, cfg.bm_slab) - 1


def _pad(n: int, m: int = 64) -> int:  # buffer row length: 16-byte aligned rows for cuBLAS, whole tiles
    return cdiv(n, m) * m


def slab_fwd(q, k, v, rel_bias, scale: float, causal: bool, cfg: GauLaunch, mask: RowMask | None = None):
    """``o [B, T, H, E]`` of GAU attention by query slabs (q, k ``[B, T, H, S]``, v ``[B, T, H, E]``, each
    contiguous within a sequence -- views of a packed call qualify -- rel_bias ``[H, 2T - 1]`` or None).  ``mask``: the rows hold several sequences each (a packed call's
    ``[n, L]`` view, :func:`packed_rows`), pairs across them are zero and each slab reads only the keys its rows'
    sequences reach."""
    B, T, H, S = q.shape
    o = torch.empty_like(v)
    if B * T == 0:
        return o
    R, bm, ntd = _geometry(T, cfg)
    bias = bias_tiles(kernel_bias(rel_bias)[0], ntd, T - 1, bm)
    P = torch.empty(B, R, _pad(T), dtype=q.dtype, device=q.device)
    BS, PREC = block(S), dot_config(q.dtype)[1]
    st, en = (mask.st, mask.en) if mask is not None else (q, q)
    for r0 in range(0, T, R):
        r1 = min(r0 + R, T)
        k0, kend = mask.keys(r0, r1, causal) if mask is not None else (0, r1 if causal else T)
        for h in range(H):
            slab_fwd_scores_kernel[(cdiv(kend - k0, bm), cdiv(r1 - r0, bm), B)](
                q, k, P, bias if bias is not None else q, st, en, r0, r1, k0, kend, T, H, h, S, ntd, P.stride(0),
                P.stride(1), float(scale), BM=bm, BS=BS, CAUSAL=causal, HAS_BIAS=bias is not None,
                MASKED=mask is not None, PREC=PREC, num_warps=cfg.warps_slab,
            )
            torch.bmm(P[:, : r1 - r0, : kend - k0], v[:, k0:kend, h], out=o[:, r0:r1, h])
    return o


def slab_bwd(do, q, k, v, rel_bias, scale: float, causal: bool, need_db: bool, cfg: GauLaunch, *,
             db_dtype: torch.dtype | None = None, mask: RowMask | None = None):
    """``(dq, dk, dv, db)`` of :func:`slab_fwd`, by key slabs (``db``: ``[H, 2T - 1]`` in ``db_dtype``, default
    ``rel_bias``'s, or an empty tensor when not asked for); ``mask`` as in :func:`slab_fwd`."""
    B, T, H, S = q.shape
    do = do.contiguous()
    dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    bias, LB = kernel_bias(rel_bias)
    need_db = need_db and bias is not None
    db_dtype = db_dtype or (rel_bias.dtype if rel_bias is not None else None)
    if B * T == 0:
        dk.zero_()
        dv.zero_()
        db = torch.zeros(rel_bias.shape, dtype=db_dtype, device=q.device) if need_db else q.new_empty(0)
        return dq32.to(q.dtype), dk, dv, db
    R, bm, ntd = _geometry(T, cfg)
    tiles = bias_tiles(bias, ntd, T - 1, bm)
    db_tiles = (torch.zeros((H, ntd, bm, bm), dtype=torch.float32, device=q.device) if need_db
                else torch.empty(1, dtype=torch.float32, device=q.device))
    # dP (then dS, in place) and P for the rows of one key slab: [B, T, R], R a multiple of 64
    dP = torch.empty(B, T, R, dtype=q.dtype, device=q.device)
    P = torch.empty(B, T, R, dtype=q.dtype, device=q.device)
    BS, PREC = block(S), dot_config(q.dtype)[1]
    st, en = (mask.st, mask.en) if mask is not None else (q, q)
    for c0 in range(0, T, R):
        c1 = min(c0 + R, T)
        q0, q1 = mask.queries(c0, causal) if mask is not None else (c0 if causal else 0, T)
        n, w = q1 - q0, c1 - c0
        dp, p = dP[:, :n, :w], P[:, :n, :w]
        for h in range(H):
            torch.bmm(do[:, q0:q1, h], v[:, c0:c1, h].transpose(1, 2), out=dp)
            slab_bwd_scores_kernel[(cdiv(n, bm), B)](
                q, k, dP, P, dq32, db_tiles, tiles if tiles is not None else q, st, en, c0, c1, q0, q1, T, H, h, S,
                ntd, dP.stride(0), dP.stride(1), float(scale),
                BM=bm, BS=BS, CAUSAL=causal, HAS_BIAS=tiles is not None, NEED_DB=need_db, MASKED=mask is not None,
                PREC=PREC, num_warps=cfg.warps_slab,
            )
            torch.bmm(p.transpose(1, 2), do[:, q0:q1, h], out=dv[:, c0:c1, h])
            torch.bmm(dp.transpose(1, 2), q[:, q0:q1, h], out=dk[:, c0:c1, h])
    db = fold_bias_grad(db_tiles, LB, T - 1, bm, db_dtype) if need_db else q.new_empty(0)
    return dq32.to(q.dtype), dk, dv, db
