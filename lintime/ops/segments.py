"""The chunk / segment layout of the Triton kernels' walks over (packed) sequences.

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
but per segment, not per chunk (:mod:`lintime.ops.state_passing`).  ``ns`` is chosen per shape
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

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lintime.ops.launching import next_pow2, sm_count
from lintime.ops.utils import is_static, packed_cache

BT = 64  # chunk length (tokens) of every kernel


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
    A static ``cu_seqlens`` is planned on the device at every call, nothing read or kept."""
    if cu_seqlens is None:
        return _regular_segments(B, T, ns)
    if is_static(cu_seqlens):
        return _static_segments(B, T, cu_seqlens, ns, device)
    entry = packed_cache(cu_seqlens, ("segments", B, T, ns, str(device)))
    if "seg" not in entry:
        entry["seg"] = _packed_segments(B, T, cu_seqlens, ns, device)
    return entry["seg"]


@functools.lru_cache(maxsize=256)
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
    cu = cu_seqlens.detach().cpu().long()  # the one device sync of a packed call
    N = cu.numel() - 1
    bos, eos = cu[:-1], cu[1:]
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

