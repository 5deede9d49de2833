"""The one planner of the Triton kernels' walks over (packed) sequences: the chunk / segment layout of the 64-token
walks (linear attention, GLA: :func:`segments`) and the chunk plan of mixed chunk attention (chunks of ``C`` tokens,
per-chunk and per-segment rows: :func:`chunk_plan`), both kept by one caching rule (:func:`cached_plan`).  Why the
two layouts differ: ``docs/design/kernels.md`` (shared pieces, segments).

Notation: ``B, T, H, K, V`` as everywhere; ``TT = B * T`` tokens of the flat ``[TT, H, D]`` view
of a contiguous ``[B, T, H, D]`` tensor (packed sequences with ``cu_seqlens`` are already flat);
``N`` sequences; ``BT`` chunk length (64 tokens).

**Chunks and segments.**  Every sequence is cut into chunks of ``BT`` tokens, starting at the
sequence start (the last chunk of a sequence may be short; nothing ever crosses a sequence
boundary).  Consecutive chunks of one sequence are grouped into *segments* of ``ns`` chunks.
A kernel program owns one segment and walks its chunks in order, carrying the ``[K, V]`` state
in registers (the "non-materialised" form of the GLA seed §3.3): inputs are read once and no
per-chunk state touches HBM.  One segment per sequence (``ns = 0``) is the purely sequential
form; it lacks parallelism when ``B * H`` is small, so long sequences are cut into several
segments and the state entering each segment is *materialised* (seed §3.3 "materialization"),
but per segment, not per chunk (:mod:`lintime.ops.utils.state_passing`).  ``ns`` is chosen per shape
by :func:`choose_segment_chunks`.

**Layout tables.**  Without ``cu_seqlens`` the segment of a program id is arithmetic (no table,
no host work).  With ``cu_seqlens`` :func:`segments` builds an ``int32 [NSEG, 4]`` table
``(bos, eos, seq, first chunk)`` and the CSR offsets ``seq_ptr [N + 1]`` of each sequence's
segments (:func:`segment_table`, tensor ops on the sequence bounds).  An ordinary ``cu_seqlens`` is
read on the host once (one device sync, like the PyTorch chunked form), the table built there with
the exact number of segments and sent in one copy, and kept per tensor.  A static one
(:func:`lintime.ops.utils.mark_static`: its values change under a replayed CUDA graph) is never
read on the host: the same table is built on the device at every call, with ``NSEG_ALLOC`` rows (a
bound from shapes).  Rows past the real segments are *slack*: no tokens (``bos = eos = T``), no
sequence's ``seq_ptr`` range holds them, and their first chunk is their own row index, which no
real chunk uses (it is at least the number of segments, which is at least the number of chunks
when ``ns = 1``, and below the per-chunk rows :func:`seg_alloc_rows` ``(ns=1)``): a kernel that
writes per-chunk rows unmasked by tokens (the GLA chunk prep's ``G_l``) writes an unused row.
Grids then run ``NSEG_ALLOC`` programs; a slack one walks no chunk and writes no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lintime.ops.utils.launching import cdiv, next_pow2, sm_count
from lintime.ops.utils import is_static, num_seqs, packed_cache, sequence_bounds

BT = 64  # chunk length (tokens) of every kernel


# Plans of unpacked calls, by shape: at most this many kept (a model has a handful of shapes), the oldest dropped.
_REGULAR: dict = {}
_REGULAR_MAX = 256


def cached_plan(name: str, B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device, key: tuple,
                build):
    """The one caching rule of the planners (:func:`segments`, mixed chunk's tables :func:`chunk_plan`):
    ``build(cu_seqlens)`` for a call of ``B x T`` tokens whose plan also depends on ``key`` (hashable).  Unpacked
    calls reuse the plan of the same shape (no host work); packed calls that of the same ``cu_seqlens`` tensor
    (:func:`lintime.ops.utils.packed_cache`: a model's layers and backward passes skip the host read and the
    rebuild); a static ``cu_seqlens`` (:func:`lintime.ops.utils.mark_static`) is planned at every call, nothing
    read on the host or kept (its values change under a replayed CUDA graph)."""
    if cu_seqlens is None:
        k = (name, B, T, key, str(device))
        plan = _REGULAR.get(k)
        if plan is None:
            if len(_REGULAR) >= _REGULAR_MAX:
                del _REGULAR[next(iter(_REGULAR))]
            plan = _REGULAR[k] = build(None)
        return plan
    if is_static(cu_seqlens):
        return build(cu_seqlens)
    entry = packed_cache(cu_seqlens, (name, B, T, key, str(device)))
    if "plan" not in entry:
        entry["plan"] = build(cu_seqlens)
    return entry["plan"]


def choose_segment_chunks(n_seq: int, total_tokens: int, max_len: int, programs_per_segment: int,
                          device: torch.device) -> int:
    """Chunks per segment ``ns`` (0 = one segment per sequence, nothing materialised).

    The walk kernels run ``segments x programs_per_segment`` programs, each a sequential loop over
    its segment's chunks.  One segment per sequence as soon as that gives every multiprocessor a
    program (segments then only add their summary and scan passes); otherwise segments of at least 16
    chunks aiming at two programs per SM (the summary and scan passes cost about one extra read of k
    and v, so shorter segments were slower), rounded up to a power of two so that power-of-two lengths
    split evenly (an uneven split was slower).  Measurements: ``docs/design/kernels.md`` (linear attention).
    """
    sms = sm_count(device)
    if n_seq * programs_per_segment >= sms:
        return 0
    chunks = max(1, math.ceil(total_tokens / BT))
    want_segments = math.ceil(2 * sms / max(1, programs_per_segment))
    ns = max(16, next_pow2(math.ceil(chunks / want_segments)))
    if ns >= math.ceil(max_len / BT):
        return 0
    return ns


@dataclass(frozen=True)
class Segments:
    """The segment layout of one call (see the module docstring).

    ``ns``          chunks per segment, 0 = one segment per sequence (nothing materialised);
    ``NSEG``        segments (programs along the segment axis); with a static ``cu_seqlens``
                    ``NSEG_ALLOC``, slack rows included;
    ``NSEG_ALLOC``  rows to allocate for per-segment states: a bound that depends only on the
                    shapes (custom ops must know output shapes without reading ``cu_seqlens``);
    ``NCH``         chunks in all (static ``cu_seqlens``: their bound, the per-chunk rows);
    regular layout (no ``cu_seqlens``): ``NSPS`` segments per sequence, ``SEG_LEN`` tokens per
    segment, ``NT`` chunks per sequence, ``NSC`` chunks per segment;
    varlen layout: ``table`` int32 ``[NSEG, 4]`` = (bos, eos, seq, first chunk), ``seq_ptr``
    int32 ``[N + 1]``.
    """

    N: int
    T: int
    ns: int
    NSEG: int
    NSEG_ALLOC: int
    NCH: int
    NSPS: int
    SEG_LEN: int
    NT: int
    NSC: int
    varlen: bool
    table: torch.Tensor | None
    seq_ptr: torch.Tensor | None

    @property
    def materialized(self) -> bool:
        return self.ns > 0

    def kernel_args(self) -> dict:
        """The layout arguments every segment kernel takes (a fresh dict: callers may extend it)."""
        return dict(seg=self.table, seq_ptr=self.seq_ptr, T=self.T, NSPS=self.NSPS, SEG_LEN=self.SEG_LEN,
                    NT=self.NT, NSC=self.NSC, VARLEN=self.varlen)


def seg_alloc_rows(B: int, T: int, n_seq: int, varlen: bool, ns: int) -> int:
    """``Segments.NSEG_ALLOC`` from shapes alone (used by the fake implementations too).  Packed:
    a sequence of ``L > 0`` tokens has ``ceil(ceil(L / BT) / ns) <= 1 + (L - 1) // (ns * BT)``
    segments and an empty one none (``ns > 0``), so ``N + TT // (ns * BT)`` bound them all."""
    if ns == 0:
        return n_seq
    if not varlen:
        return B * math.ceil(math.ceil(T / BT) / ns)
    return n_seq + (B * T) // (ns * BT)


def segments(B: int, T: int, cu_seqlens: torch.Tensor | None, ns: int, device: torch.device) -> Segments:
    """Build the segment layout of a ``[B, T]`` batch, or of packed sequences (``B == 1``).
    Without ``cu_seqlens`` the layout is arithmetic and cached per ``(B, T, ns)``; a packed layout
    costs one device-to-host read of ``cu_seqlens`` and is kept per tensor
    (:func:`lintime.ops.utils.packed_cache`), so a model's layers, forward and backward, share it.
    A static ``cu_seqlens`` is planned on the device at every call, nothing read or kept (:func:`cached_plan`)."""
    return cached_plan("segments", B, T, cu_seqlens, device, (ns,), lambda cu: _build_segments(B, T, cu, ns, device))


def _build_segments(B: int, T: int, cu_seqlens: torch.Tensor | None, ns: int, device: torch.device) -> Segments:
    if cu_seqlens is None:
        return _regular_segments(B, T, ns)
    if is_static(cu_seqlens):
        return _static_segments(B, T, cu_seqlens, ns, device)
    return _packed_segments(B, T, cu_seqlens, ns, device)


def _regular_segments(B: int, T: int, ns: int) -> Segments:
    NT = -(-T // BT)
    if ns == 0:
        return Segments(B, T, 0, B, B, B * NT, 1, NT * BT, NT, NT, False, None, None)
    NSPS = -(-NT // ns)
    return Segments(B, T, ns, B * NSPS, B * NSPS, B * NT, NSPS, ns * BT, NT, ns, False, None, None)


def segment_counts(bos: torch.Tensor, eos: torch.Tensor, ns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks ``nt [N]`` and segments ``nseg [N]`` of the sequences ``[bos, eos)`` (int64, any
    device): one segment per sequence for ``ns = 0`` (an empty one too: its walk writes the final
    state), else ``ceil(nt / ns)`` (none for an empty sequence)."""
    nt = (eos - bos + BT - 1) // BT
    return nt, (torch.ones_like(nt) if ns == 0 else (nt + ns - 1) // ns)


def segment_table(bos: torch.Tensor, eos: torch.Tensor, ns: int, rows: int,
                  T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``table [rows, 4]``, ``seq_ptr [N + 1]`` (int64, on the device of ``bos``, computed there by
    tensor ops of sizes ``rows`` and ``N``: no host read, no value-sized output) of the sequences
    ``[bos, eos)`` (int64 ``[N]``, ``N >= 1``).  Segment ``j`` of sequence ``n`` covers its chunks
    ``[j ns, (j + 1) ns)``; rows past the segments are slack rows (module docstring)."""
    N = bos.numel()
    nt, nseg = segment_counts(bos, eos, ns)
    ch_first = torch.cumsum(nt, 0) - nt
    i = torch.arange(rows, device=bos.device)
    if ns == 0:  # one segment per sequence, no slack: row i is sequence i
        return torch.stack([bos, eos, i, ch_first], 1), torch.arange(N + 1, device=bos.device)
    seg_end = torch.cumsum(nseg, 0)
    seq_ptr = torch.cat([seg_end.new_zeros(1), seg_end])
    n = torch.searchsorted(seg_end, i, right=True)  # the sequence of row i; N past the segments
    real = n < N
    n = n.clamp_(max=N - 1)
    j = i - seq_ptr[n]
    s_bos = bos[n] + j * (ns * BT)
    s_eos = torch.minimum(s_bos + ns * BT, eos[n])
    s_ch = ch_first[n] + j * ns
    table = torch.stack([torch.where(real, s_bos, T), torch.where(real, s_eos, T), n, torch.where(real, s_ch, i)], 1)
    return table, seq_ptr


def _packed_segments(B: int, T: int, cu_seqlens: torch.Tensor, ns: int, device: torch.device) -> Segments:
    bos, lengths = sequence_bounds(B, T, cu_seqlens)  # the one device sync of a packed call
    N, eos = bos.numel(), bos + lengths
    nt, nseg = segment_counts(bos, eos, ns)
    NSEG, NCH = torch.stack([nseg.sum(), nt.sum()]).tolist()  # host tensors: no sync
    table, ptr = segment_table(bos, eos, ns, max(NSEG, 1), T)  # one slack row when there is no segment
    both = torch.cat([table.reshape(-1), ptr]).to(device=device, dtype=torch.int32)  # one host-to-device copy
    table, ptr = both[: table.numel()].view(-1, 4), both[table.numel():]
    return Segments(N, T, ns, NSEG, seg_alloc_rows(B, T, N, True, ns), NCH, 0, 0, 0, 0, True, table, ptr)


def _static_segments(B: int, T: int, cu_seqlens: torch.Tensor, ns: int, device: torch.device) -> Segments:
    N = cu_seqlens.numel() - 1
    cu = cu_seqlens.detach().to(device=device, dtype=torch.long)
    rows = seg_alloc_rows(B, T, N, True, ns)
    table, ptr = segment_table(cu[:-1], cu[1:], ns, rows, T)
    return Segments(N, T, ns, rows, rows, seg_alloc_rows(B, T, N, True, 1), 0, 0, 0, 0, True,
                    table.to(torch.int32), ptr.to(torch.int32))


def chunks(B: int, T: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> Segments:
    """One segment per chunk: the layout of kernels that are parallel over chunks."""
    return segments(B, T, cu_seqlens, 1, device)


# ---------------------------------------------------------------------------------------------
# the chunk plan of mixed chunk attention (chunks of C tokens, per-chunk rows)


def chunk_bound(B: int, T: int, C: int, cu_seqlens) -> int:
    """Chunks of ``C`` tokens in the call, or an upper bound from shapes alone (custom-op outputs must be sized
    without reading ``cu_seqlens``): ``sum_n ceil(L_n / C) <= N + T // C``."""
    if cu_seqlens is None:
        return B * math.ceil(T / C)
    return num_seqs(B, cu_seqlens) + T // C


def chunk_seg_bound(B: int, T: int, C: int, cu_seqlens, G: int) -> int:
    """Segments of ``G`` chunks, or a bound from shapes: ``sum_n max(1, ceil(nc_n / G)) <= N + NC // G``."""
    if cu_seqlens is None:
        return B * math.ceil(math.ceil(T / C) / G)
    return num_seqs(B, cu_seqlens) + chunk_bound(B, T, C, cu_seqlens) // G


@dataclass
class ChunkPlan:
    """Tables of one call (device int32, :func:`plan_kernel`) in chunks of ``C`` tokens and segments of ``G`` chunks,
    and their sizes.

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
    weights: dict  # what the op derives from the tables and keeps with them (mixed chunk: per-chunk weights)


def chunk_plan(B: int, T: int, C: int, G: int, cu_seqlens: torch.Tensor | None, device: torch.device) -> ChunkPlan:
    """The tables of :func:`_chunk_tables`, built on the device from the offsets (cached by the caller through
    :func:`cached_plan`).  Their sizes: for an ordinary call the exact counts of chunks and segments, from the
    sequence bounds read on the host (:func:`lintime.ops.utils.sequence_bounds`, once per ``cu_seqlens`` tensor);
    for a static ``cu_seqlens``, bounds from shapes (:func:`chunk_bound`; one segment per sequence where ``G``
    chunks cover any sequence of ``T`` tokens, else :func:`chunk_seg_bound` rows), nothing read."""
    NC_alloc = chunk_bound(B, T, C, cu_seqlens)
    N = num_seqs(B, cu_seqlens)
    if is_static(cu_seqlens):
        one = G >= cdiv(T, C)  # no sequence has more chunks than G
        NSEG = N if one else chunk_seg_bound(B, T, C, cu_seqlens, G)
        t = _chunk_tables(cu_seqlens.detach(), N, NC_alloc, NSEG, C, G, device)
        # at least ceil(T / C) chunks hold the T tokens (cu_seqlens ends at T)
        return ChunkPlan(N, NC_alloc, NSEG, NC_alloc, min(cdiv(T, C), NC_alloc), one, True, *t, weights={})
    _, lengths = sequence_bounds(B, T, cu_seqlens)
    nch = (lengths + C - 1) // C
    nseg = ((nch + G - 1) // G).clamp(min=1)  # as plan_kernel counts them
    NC, NSEG = int(nch.sum()), int(nseg.sum())
    if cu_seqlens is None:
        cu = torch.arange(B + 1, device=device) * T
    else:
        cu = cu_seqlens.detach().to(device)
    t = _chunk_tables(cu, N, NC, NSEG, C, G, device)
    return ChunkPlan(N, NC, NSEG, NC_alloc, NC, bool((nseg == 1).all()), bool((lengths % C != 0).any()), *t,
                     weights={})


def _chunk_tables(cu, N, NC, NSEG, C, G, device) -> list[torch.Tensor]:
    """``ch_start, ch_len, ch_seq, ch_k, ch_id [NC]``, ``seg_first, seg_n, seg_seq [NSEG]``, ``seq_ptr [N + 1]``,
    ``lengths [N]`` (int32 views of one buffer) of the offsets ``cu [N + 1]`` on ``device``: one launch of
    :func:`plan_kernel`."""
    sizes = [NC] * 5 + [NSEG] * 3 + [N + 1, N]
    flat = torch.empty(sum(sizes), dtype=torch.int32, device=device)
    t = list(torch.split(flat, sizes))
    BLOCK = 64  # rows per program; each program searches all N sequences, BN at a time ([BLOCK, BN] compares)
    plan_kernel[(cdiv(max(NC, NSEG, N + 1), BLOCK),)](cu, *t, N, NC, NSEG, C, G, BLOCK=BLOCK, BN=64, num_warps=4)
    return t


# ---------------------------------------------------------------------------------------------
# layout helpers (device side)


@triton.jit
def segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN: tl.constexpr):
    """Tokens ``[bos, eos)`` of segment ``i_s`` in the flat token axis, its sequence ``i_n`` and
    the global index ``ch0`` of its first chunk."""
    if VARLEN:
        bos = tl.load(seg + i_s * 4).to(tl.int64)
        eos = tl.load(seg + i_s * 4 + 1).to(tl.int64)
        i_n = tl.load(seg + i_s * 4 + 2).to(tl.int64)
        ch0 = tl.load(seg + i_s * 4 + 3).to(tl.int64)
    else:
        i_n = (i_s // NSPS).to(tl.int64)
        j = (i_s % NSPS).to(tl.int64)
        bos = i_n * T + j * SEG_LEN
        eos = tl.minimum(bos + SEG_LEN, i_n * T + T)
        ch0 = i_n * NT + j * NSC
    return bos, eos, i_n, ch0


@triton.jit
def sequence_segments(seq_ptr, i_n, NSPS, VARLEN: tl.constexpr):
    """Segments ``[s0, s1)`` of sequence ``i_n``."""
    if VARLEN:
        s0 = tl.load(seq_ptr + i_n).to(tl.int64)
        s1 = tl.load(seq_ptr + i_n + 1).to(tl.int64)
    else:
        s0 = i_n.to(tl.int64) * NSPS
        s1 = s0 + NSPS
    return s0, s1


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
