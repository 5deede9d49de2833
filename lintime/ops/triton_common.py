"""Pieces shared by lintime's Triton kernels: the chunk / segment layout of packed sequences,
the chunk-state passing kernels, the sub-chunk (secondary) tiling helpers of gated linear
attention, dtype rules and the custom-op registration helper.

Notation (STYLE 10): ``B, T, H, K, V`` as everywhere; ``TT = B * T`` tokens of the flat
``[TT, H, D]`` view of a contiguous ``[B, T, H, D]`` tensor (packed sequences with ``cu_seqlens``
are already flat); ``N`` sequences; ``BT`` chunk length (64 tokens); ``BC`` sub-chunk length
(16); ``NC = BT // BC``.

**Chunks and segments.**  Every sequence is cut into chunks of ``BT`` tokens, starting at the
sequence start (the last chunk of a sequence may be short; nothing ever crosses a sequence
boundary).  Consecutive chunks of one sequence are grouped into *segments* of ``ns`` chunks.
A kernel program owns one segment and walks its chunks in order, carrying the ``[K, V]`` state
in registers (the "non-materialised" form of the GLA seed §3.3): inputs are read once and no
per-chunk state touches HBM.  One segment per sequence (``ns = 0``) is the purely sequential
form; it lacks parallelism when ``B * H`` is small, so long sequences are cut into several
segments and the state entering each segment is *materialised* (seed §3.3 "materialization"),
but per segment, not per chunk:

1. :func:`seg_summary_kernel` -- in parallel over segments, what each segment adds to the state
   (``delta``) and its total log-decay (``gsum``);
2. :func:`seg_scan_kernel` -- per sequence, a short scan over its segments gives the state
   entering each one (and the final state);
3. the op's walk kernel starts each segment from that state.

Backward passes use the same machinery in reverse for the state gradients.  ``ns`` is chosen per
shape by :func:`choose_segment_chunks` (measured, see ``docs/notes/kernels_linear_gla.md``).

**Layout tables.**  Without ``cu_seqlens`` the segment of a program id is arithmetic (no table,
no host work).  With ``cu_seqlens`` :func:`segments` builds an ``int32 [NSEG, 4]`` table
``(bos, eos, seq, first chunk)`` and the CSR offsets ``seq_ptr [N + 1]`` of each sequence's
segments; this reads ``cu_seqlens`` on the host (one device sync), like the PyTorch chunked form.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # host-side TMA descriptors (Triton >= 3.4); without them the kernels take their pointer paths
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None
if tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit()) < (3, 4):  # pragma: no cover
    TensorDescriptor = None  # (3.3's descriptors are experimental, with another kernel-side API)

BT = 64  # chunk length (tokens) of every kernel
BC = 16  # sub-chunk length: secondary tiling of GLA (seed Fig. 3)
MAX_HEAD_DIM = 256  # K and V supported by the kernels


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(op: str, x: torch.Tensor) -> None:
    """The Triton backend runs CUDA tensors, or CPU tensors under the interpreter (tests)."""
    if x.device.type == "cuda" or (x.device.type == "cpu" and interpreting()):
        return
    raise ValueError(
        f"{op}: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for Triton's CPU "
        f"interpreter), got a tensor on {x.device}"
    )


def supported(*dims: int, dtype: torch.dtype) -> bool:
    """Head sizes and dtypes the kernels handle (others fall back to the chunked PyTorch form)."""
    return dtype in (torch.float16, torch.bfloat16, torch.float32) and all(1 <= d <= MAX_HEAD_DIM for d in dims)


def cdiv(a: int, b: int) -> int:
    """Ceil division of host ints (launch arithmetic).  Plain Python: ``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions in Triton 3.9 and cost ~10 us a call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), in plain Python."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block(d: int) -> int:
    """Tile width for a head dimension: a power of two >= 16 (``tl.dot``'s minimum)."""
    return max(16, next_pow2(d))


def dot_config(dtype: torch.dtype):
    """``(SDT, PREC)`` for inputs of ``dtype``.

    Matmuls of two input tiles run in the input dtype with fp32 accumulation.  ``SDT`` is the dtype
    the fp32 state is cast to when it meets an input tile in a matmul: bf16 for bf16 inputs (the
    state keeps its range), fp32 for fp16 inputs (fp16's range is too small for a long sum) and
    fp32 inputs.  ``PREC`` is the precision of fp32 matmuls: ``"ieee"`` for fp32 inputs (fp32
    users get fp32 arithmetic), ``"tf32"`` for the state matmuls of fp16 inputs (10-bit mantissa
    like fp16, with fp32's range).
    """
    if dtype == torch.bfloat16:
        return tl.bfloat16, "tf32"
    if dtype == torch.float16:
        return tl.float32, "tf32"
    return tl.float32, "ieee"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=16)
def tma_device(device: torch.device) -> bool:
    """Whether kernels on ``device`` can load through TMA tensor descriptors: NVIDIA Hopper and later
    (the interpreter emulates them), with a Triton that has host-side descriptors, unless the
    environment sets ``LINTIME_TMA=0`` (read once per device and process: every kernel then takes its
    pointer path)."""
    if TensorDescriptor is None or os.environ.get("LINTIME_TMA", "1") == "0":
        return False
    if device.type == "cuda":
        return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9
    return interpreting()


def tma_descriptors(*specs):
    """TMA descriptors of ``(tensor, rows, block)`` specs, each contiguous tensor seen as a 2-D
    ``[rows, numel / rows]`` matrix (a ``[B, T, H, D]`` input as ``[B T, H D]``: a head's tile is a
    column offset), or ``None`` when one of them is not 16-byte aligned (base or row stride) -- the
    launch then takes the kernel's pointer path."""
    out = []
    for t, rows, block in specs:
        cols = t.numel() // max(rows, 1)
        if rows == 0 or cols == 0 or t.data_ptr() % 16 or (cols * t.element_size()) % 16:
            return None
        out.append(TensorDescriptor(t, [rows, cols], [cols, 1], list(block)))
    return out


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 under the interpreter, so small tests exercise both forms)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_segment_chunks(n_seq: int, total_tokens: int, max_len: int, programs_per_segment: int,
                          device: torch.device) -> int:
    """Chunks per segment ``ns`` (0 = one segment per sequence, nothing materialised).

    The walk kernels run ``segments x programs_per_segment`` programs, each a sequential loop
    over its segment's chunks.  Measured on H200 (docs/notes/kernels_linear_gla.md): one segment
    per sequence wins as soon as that already gives every multiprocessor a program (e.g. linear
    attention at T = 2k, B * H = 256: 0.39 ms fwd+bwd against 0.51 ms with segments); otherwise
    long segments win -- the summary and scan passes cost about one extra read of k and v, and
    32 chunks per segment beat 16 (0.50 vs 0.52 ms) and 8 (0.58 ms) at T = 8k and 32k -- so
    sequences are cut into segments of at least 16 chunks, aiming at two programs per SM, rounded
    up to a power of two so that power-of-two lengths split evenly (31 chunks at T = 8k, which
    leaves a short fifth segment, measured 0.58 ms against 0.50 ms for 32 in another run).
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
    ``NSEG``        segments (programs along the segment axis);
    ``NSEG_ALLOC``  rows to allocate for per-segment states: a bound that depends only on the
                    shapes (custom ops must know output shapes without reading ``cu_seqlens``);
    ``NCH``         chunks in all;
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
    """``Segments.NSEG_ALLOC`` from shapes alone (used by the fake implementations too)."""
    if ns == 0:
        return n_seq
    if not varlen:
        return B * math.ceil(math.ceil(T / BT) / ns)
    return n_seq + (B * T) // (ns * BT)


def segments(B: int, T: int, cu_seqlens: torch.Tensor | None, ns: int, device: torch.device) -> Segments:
    """Build the segment layout of a ``[B, T]`` batch, or of packed sequences (``B == 1``).
    Without ``cu_seqlens`` the layout is arithmetic and cached per ``(B, T, ns)``."""
    if cu_seqlens is None:
        return _regular_segments(B, T, ns)
    return _packed_segments(B, T, cu_seqlens, ns, device)


@functools.lru_cache(maxsize=256)
def _regular_segments(B: int, T: int, ns: int) -> Segments:
    NT = -(-T // BT)
    if ns == 0:
        return Segments(B, T, 0, B, B, B * NT, 1, NT * BT, NT, NT, False, None, None)
    NSPS = -(-NT // ns)
    return Segments(B, T, ns, B * NSPS, B * NSPS, B * NT, NSPS, ns * BT, NT, ns, False, None, None)


def _packed_segments(B: int, T: int, cu_seqlens: torch.Tensor, ns: int, device: torch.device) -> Segments:
    cu = cu_seqlens.tolist()  # the one device sync of a packed call
    N = len(cu) - 1
    rows, seq_ptr, ch = [], [0], 0
    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        nt = math.ceil((eos - bos) / BT)
        if ns == 0:
            rows.append((bos, eos, n, ch))  # empty sequences too: their walk writes the final state
        else:
            for j in range(math.ceil(nt / ns)):
                b = bos + j * ns * BT
                rows.append((b, min(b + ns * BT, eos), n, ch + j * ns))
        ch += nt
        seq_ptr.append(len(rows))
    flat_rows = [x for r in (rows if rows else [(0, 0, 0, 0)]) for x in r]
    both = torch.tensor(flat_rows + seq_ptr, dtype=torch.int32).to(device)  # one host-to-device copy
    table, ptr = both[: len(flat_rows)].view(-1, 4), both[len(flat_rows):]
    return Segments(N, T, ns, len(rows), seg_alloc_rows(B, T, N, True, ns), ch, 0, 0, 0, 0, True, table, ptr)


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


# ---------------------------------------------------------------------------------------------
# chunk-state passing


@triton.jit
def seg_summary_kernel(
    x, y, g, w, rdiv, delta, dz, gsum, alpha,
    seg, seq_ptr, T, NSPS, SEG_LEN, NT, NSC,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, USE_G: tl.constexpr, REVERSE: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr,
    HAS_RDIV: tl.constexpr, SDT: tl.constexpr, PREC: tl.constexpr,
):
    """What segment ``i_s`` adds to a ``[K, V]`` state: ``delta = alpha * sum_t d_t x_t^T y_t``
    with the decays ``d_t`` of the walk direction, and (``NORM``) the key-sum column
    ``dz = alpha * sum_t d_t x_t w_t`` (``w = 1`` when absent); ``gsum`` = total log-decay.

    Forward (``REVERSE=False``, x = k, y = v): the chunk recurrence ``S <- exp(G_last) S +
    (x exp(G_last - G))^T y`` (seed §4.2), chunks in order.  Reverse (x = q, y = do): the state
    gradient ``dS <- exp(G_last) dS + (x exp(G))^T y``, chunks from last to first.  ``G`` is the
    in-chunk cumulative log-gate (fp32, every exponent <= 0).  ``rdiv`` divides each row of ``y``
    (the normaliser of linear attention: ``do / den``).  Grid ``(NK * NV * NSEG, H)``.
    """
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_s = i_p // (NK * NV)
    i_k = (i_p % (NK * NV)) // NV
    i_v = i_p % NV
    bos, eos, i_n, ch0 = segment_bounds(seg, i_s, T, NSPS, SEG_LEN, NT, NSC, VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    b_d = tl.zeros([BK, BV], dtype=tl.float32)
    b_z = tl.zeros([BK], dtype=tl.float32)
    b_gs = tl.zeros([BK], dtype=tl.float32)
    n_c = tl.cdiv(eos - bos, BT)
    for c in range(n_c):
        if REVERSE:
            t0 = bos + (n_c - 1 - c) * BT
        else:
            t0 = bos + c * BT
        o_t = t0 + tl.arange(0, BT)
        m_t = o_t < eos
        b_x = tl.load(x + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.)
        b_y = tl.load(y + (o_t * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.)
        if HAS_RDIV:
            b_r = tl.load(rdiv + o_t * H + i_h, mask=m_t, other=1.)
            b_y = (b_y.to(tl.float32) / b_r[:, None]).to(b_x.dtype)
        if NORM:
            if HAS_W:
                b_w = tl.load(w + o_t * H + i_h, mask=m_t, other=0.)
            else:
                b_w = tl.where(m_t, 1., 0.)
        if USE_G:
            b_g = tl.load(g + (o_t * H + i_h)[:, None] * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :],
                          other=0.).to(tl.float32)
            b_gl = tl.sum(b_g, 0)  # G at the chunk's last token (padding rows add 0)
            if REVERSE:
                b_xd = b_x.to(tl.float32) * tl.exp(tl.cumsum(b_g, 0))
            else:
                # G_last - G_j as the sum of the gates after j (not a difference of large sums)
                b_xd = b_x.to(tl.float32) * tl.exp(tl.cumsum(b_g, 0, reverse=True) - b_g)
            b_d = b_d * tl.exp(b_gl)[:, None]
            b_d = tl.dot(tl.trans(b_xd.to(b_x.dtype)), b_y, b_d, input_precision=PREC)
            b_gs += b_gl
        else:
            b_d = tl.dot(tl.trans(b_x), b_y, b_d, input_precision=PREC)
            if NORM:
                b_z += tl.sum(b_x.to(tl.float32) * b_w[:, None], 0)
    p_d = delta + ((i_s * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p_d, b_d * alpha, mask=m_k[:, None] & m_v[None, :])
    if i_v == 0:
        if NORM:
            tl.store(dz + (i_s * H + i_h) * K + o_k, b_z * alpha, mask=m_k)
        if USE_G:
            tl.store(gsum + (i_s * H + i_h) * K + o_k, b_gs, mask=m_k)


@triton.jit
def seg_scan_kernel(
    delta, dz, gsum, init, init_z, start, start_z, final, final_z,
    seq_ptr, NSPS,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    VARLEN: tl.constexpr, USE_G: tl.constexpr, REVERSE: tl.constexpr, NORM: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_START: tl.constexpr,
):
    """Per sequence, pass the state along its segments: ``start[s]`` = state entering segment
    ``s`` in the walk direction, ``final[n]`` = state after the sequence (forward: the final
    state; reverse: the gradient of the initial state).  ``init`` (``[N, H, K, V]``) is the
    state a sequence starts from (forward: ``initial_state``, reverse: ``d final_state``).
    Empty sequences have no segments: ``final = init``.  Grid ``(NK * NV, N, H)``; small tiles
    so that the sequential loop has many programs.
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    i_kv, i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    i_k, i_v = i_kv // NV, i_kv % NV
    s0, s1 = sequence_segments(seq_ptr, i_n, NSPS, VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_kv = m_k[:, None] & (o_v < V)[None, :]
    o_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_z = tl.zeros([BK], dtype=tl.float32)
    if HAS_INIT:
        b_h += tl.load(init + (i_n * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(init_z + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.)
    for i in range(s1 - s0):
        if REVERSE:
            s = s1 - 1 - i
        else:
            s = s0 + i
        if STORE_START:
            tl.store(start + (s * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
            if NORM:
                if i_v == 0:
                    tl.store(start_z + (s * H + i_h) * K + o_k, b_z, mask=m_k)
        b_d = tl.load(delta + (s * H + i_h) * K * V + o_kv, mask=m_kv, other=0.)
        if USE_G:
            b_h = b_h * tl.exp(tl.load(gsum + (s * H + i_h) * K + o_k, mask=m_k, other=0.))[:, None]
        b_h += b_d
        if NORM:
            b_z += tl.load(dz + (s * H + i_h) * K + o_k, mask=m_k, other=0.)
    tl.store(final + (i_n * H + i_h) * K * V + o_kv, b_h, mask=m_kv)
    if NORM:
        if i_v == 0:
            tl.store(final_z + (i_n * H + i_h) * K + o_k, b_z, mask=m_k)


def segment_states(x, y, seg: Segments, *, H: int, g=None, w=None, rdiv=None, reverse=False, alpha=1.0,
                   init=None, init_z=None, norm=False, store_start=True):
    """States entering each segment (``[NSEG_ALLOC, H, K, V]`` fp32, and the key-sum column
    ``[NSEG_ALLOC, H, K]`` when ``norm``) and after each sequence (``[N, H, K, V]``, ``[N, H, K]``).

    ``x [TT, H, K]``, ``y [TT, H, V]`` flat token-major views; see :func:`seg_summary_kernel`
    for ``g, w, rdiv, reverse, alpha``.  Returns ``(start, start_z, final, final_z)``; the
    ``*_z`` are empty tensors unless ``norm``.
    """
    K, V = x.shape[-1], y.shape[-1]
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    SDT, PREC = dot_config(x.dtype)
    NSEG = seg.NSEG
    delta = torch.empty(max(NSEG, 1), H, K, V, **f32)
    dz = torch.empty(max(NSEG, 1), H, K, **f32) if norm else delta
    gsum = torch.empty(max(NSEG, 1), H, K, **f32) if g is not None else delta
    la = seg.kernel_args()
    BK, BV = min(64, block(K)), min(64, block(V))
    if NSEG > 0:
        grid = (cdiv(K, BK) * cdiv(V, BV) * NSEG, H)
        seg_summary_kernel[grid](
            x, y, g, w, rdiv, delta, dz, gsum, float(alpha), **la, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            USE_G=g is not None, REVERSE=reverse, NORM=norm, HAS_W=w is not None, HAS_RDIV=rdiv is not None,
            SDT=SDT, PREC=PREC, num_warps=4,
        )
    start = torch.empty(seg.NSEG_ALLOC, H, K, V, **f32) if store_start else delta
    start_z = (torch.empty(seg.NSEG_ALLOC, H, K, **f32) if (store_start and norm)
               else x.new_empty(0, dtype=torch.float32))
    final = torch.empty(seg.N, H, K, V, **f32)
    final_z = torch.empty(seg.N, H, K, **f32) if norm else x.new_empty(0, dtype=torch.float32)
    if seg.N > 0:
        SK, SV = min(32, block(K)), min(32, block(V))
        grid = (cdiv(K, SK) * cdiv(V, SV), seg.N, H)
        seg_scan_kernel[grid](
            delta, dz, gsum, init, init_z, start, start_z, final, final_z, seg.seq_ptr, seg.NSPS,
            H=H, K=K, V=V, BK=SK, BV=SV, VARLEN=seg.varlen, USE_G=g is not None, REVERSE=reverse, NORM=norm,
            HAS_INIT=init is not None, STORE_START=store_start, num_warps=2,
        )
    return start, start_z, final, final_z


# ---------------------------------------------------------------------------------------------
# secondary (sub-chunk) tiling of GLA: seed §4.3, Fig. 3
#
# Inside a chunk (rows i, j; sub-chunks I, J of BC rows), with g the log-gates (<= 0):
#   A_ij = sum_k q_ik k_jk exp(G_ik - G_jk),  j <= i,   G_i - G_j = sum_{j < t <= i} g_t.
#
# * Pairs in different sub-chunks (J < I, "inter", orange in Fig. 3): one half-precision matmul
#   per sub-chunk I of the bounded factors q_i exp(G_i - z_I) and k_j exp(z_I - G_j), z_I = G at
#   the last row before sub-chunk I; both exponents are <= 0.
# * Pairs in the same sub-chunk ("intra", pink): fp32.  With gcs the cumulative gate inside each
#   sub-chunk and M its total (per row, M <= gcs), exp(gcs_i - gcs_j) = exp(gcs_i - M) exp(M - gcs_j):
#   when no sub-chunk of the chunk decays by more than SPAN_MAX nats (exp(SPAN_MAX) is far inside
#   fp32's range) the whole diagonal band is one fp32 (IEEE) matmul of these factors; otherwise
#   the chunk takes the direct log-space form, exp(gcs_i - gcs_j) per pair, row by row (seed
#   Eq. 4 on the sub-chunk), which never overflows.  Both are fp32 and exact in real arithmetic;
#   the guard only decides which one cannot overflow.
#
# Every exponent is built from sums local to the sub-chunks involved (gcs and the sub-chunk
# totals), never as the difference of two chunk-wide cumulative sums: those carry an absolute
# rounding error of ulp(|G|), i.e. a relative error of |G| * 6e-8 on every term, which strong
# decays (|G| in the hundreds) make visible.

SPAN_MAX = tl.constexpr(60.0)
# One-level in-chunk products (GLA kernels, ``ONE_LEVEL``): factors e^{+-G} of a chunk-wide cumulative
# gate |G| < ONE_SPAN stay within [e^-40, e^40] = [4e-18, 2e17] -- inside bf16 / fp32 range with room
# for the products and sums of the matmul.
ONE_SPAN = tl.constexpr(40.0)


@triton.jit
def subchunk_stats(b_g, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """From the gate tile ``b_g [BT, BK]`` (fp32): ``gcs`` (cumulative gate of each row inside its
    sub-chunk), ``M`` (its sub-chunk's total, per row) and ``tot [NC, BK]`` (the totals)."""
    NC: tl.constexpr = BT // BC
    b_g3 = tl.reshape(b_g, (NC, BC, BK))
    b_gcs = tl.reshape(tl.cumsum(b_g3, 1), (BT, BK))
    b_tot = tl.sum(b_g3, 1)
    b_M = tl.reshape(tl.broadcast_to(tl.expand_dims(b_tot, 1), (NC, BC, BK)), (BT, BK))
    return b_gcs, b_M, b_tot


@triton.jit
def subchunk_ek(b_gcs, b_M, b_tot, I: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """``z_I - G_j = sum_{j < t < I*BC} g_t`` for rows ``j`` before sub-chunk ``I`` (<= 0): the rest
    of ``j``'s own sub-chunk plus the totals of the sub-chunks in between (other rows: junk <= 0)."""
    NC: tl.constexpr = BT // BC
    sub = tl.arange(0, BT) // BC
    o_nc = tl.arange(0, NC)
    b_ek = b_M - b_gcs
    for L in tl.static_range(1, I):
        b_tot_L = tl.sum(tl.where(o_nc[:, None] == L, b_tot, 0.), 0)
        b_ek += tl.where((sub < L)[:, None], b_tot_L[None, :], 0.)
    return b_ek


@triton.jit
def subchunk_intra_direct(b_A, b_q, b_gcs, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE,
                          BT: tl.constexpr, BC: tl.constexpr):
    """``b_A += sum_k q_ik k_jk exp(gcs_ik - gcs_jk)`` for ``j <= i`` in the same sub-chunk, the
    direct log-space form, row ``j`` of every sub-chunk at a time (``k_ptr``/``g_ptr`` point at
    the head's first feature, row stride ``STRIDE``; rows ``t0 + r >= eos`` read as zero)."""
    o = tl.arange(0, BT)
    r_in = o % BC
    base = o - r_in
    b_run = tl.zeros_like(b_gcs)  # gcs at row base + j of each sub-chunk
    for j in range(BC):
        o_r = t0 + base + j
        m_r = (o_r < eos)[:, None] & m_k[None, :]
        b_kj = tl.load(k_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
        b_run += tl.load(g_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
        b_e = tl.exp(tl.where((r_in >= j)[:, None], b_gcs - b_run, float("-inf")))
        b_a = tl.sum(b_q * b_kj * b_e, 1)
        b_A += tl.where(o[None, :] == (base + j)[:, None], b_a[:, None], 0.)
    return b_A


@triton.jit
def subchunk_A(b_q, b_k, b_gcs, b_M, b_tot, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE,
               BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """The in-chunk score block ``A_ij = sum_k q_ik k_jk exp(G_ik - G_jk)`` (``j <= i``, else 0),
    ``[BT, BT]`` fp32, from fp32 tiles ``b_q, b_k [BT, BK]`` and :func:`subchunk_stats`."""
    NC: tl.constexpr = BT // BC
    o = tl.arange(0, BT)
    sub = o // BC
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for I in tl.static_range(1, NC):  # inter-sub-chunk (seed Fig. 3 orange)
        b_ek = subchunk_ek(b_gcs, b_M, b_tot, I, BT, BC)
        b_qg = tl.where((sub == I)[:, None], b_q * tl.exp(b_gcs), 0.)
        b_kg = tl.where((sub < I)[:, None], b_k * tl.exp(b_ek), 0.)
        b_A = tl.dot(b_qg.to(DT), tl.trans(b_kg.to(DT)), b_A, input_precision=PREC)
    m_band = (sub[:, None] == sub[None, :]) & (o[:, None] >= o[None, :])
    if tl.max(tl.max(-b_tot, 1), 0) < SPAN_MAX:  # intra-sub-chunk (pink), fp32
        b_qf = b_q * tl.exp(b_gcs - b_M)
        b_kf = b_k * tl.exp(b_M - b_gcs)
        b_A += tl.where(m_band, tl.dot(b_qf, tl.trans(b_kf), input_precision="ieee"), 0.)
    else:
        b_A = subchunk_intra_direct(b_A, b_q, b_gcs, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE, BT, BC)
    return b_A


@triton.jit
def subchunk_dqdk(b_dq, b_dk, b_dA, b_q, b_k, b_gcs, b_M, b_tot, q_ptr, k_ptr, g_ptr, t0, eos, o_k, m_k, STRIDE,
                  BT: tl.constexpr, BC: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr):
    """``b_dq += sum_{j <= i} dA_ij k_j exp(G_i - G_j)`` and ``b_dk += sum_{i >= j} dA_ij q_i
    exp(G_i - G_j)`` (``b_dA [BT, BT]`` fp32, masked to ``j <= i``), the same tiling as
    :func:`subchunk_A`."""
    NC: tl.constexpr = BT // BC
    o = tl.arange(0, BT)
    sub = o // BC
    for I in tl.static_range(1, NC):  # inter-sub-chunk, half precision
        b_ek = subchunk_ek(b_gcs, b_M, b_tot, I, BT, BC)
        b_eq = tl.where((sub == I)[:, None], tl.exp(b_gcs), 0.)
        b_ekx = tl.where((sub < I)[:, None], tl.exp(b_ek), 0.)
        b_dAI = tl.where((sub == I)[:, None] & (o[None, :] < I * BC), b_dA, 0.).to(DT)
        b_dq += b_eq * tl.dot(b_dAI, (b_k * b_ekx).to(DT), input_precision=PREC)
        b_dk += b_ekx * tl.dot(tl.trans(b_dAI), (b_q * b_eq).to(DT), input_precision=PREC)
    b_dAd = tl.where(sub[:, None] == sub[None, :], b_dA, 0.)
    if tl.max(tl.max(-b_tot, 1), 0) < SPAN_MAX:  # intra-sub-chunk, fp32
        b_eu = tl.exp(b_gcs - b_M)  # >= 1
        b_ed = tl.exp(b_M - b_gcs)  # <= 1
        b_dq += b_eu * tl.dot(b_dAd, b_k * b_ed, input_precision="ieee")
        b_dk += b_ed * tl.dot(tl.trans(b_dAd), b_q * b_eu, input_precision="ieee")
    else:  # direct log space, row by row
        r_in = o % BC
        base = o - r_in
        b_dAt = tl.trans(b_dAd)  # [j, i]
        b_run = tl.zeros_like(b_gcs)
        for j in range(BC):
            o_r = t0 + base + j
            m_r = (o_r < eos)[:, None] & m_k[None, :]
            b_kj = tl.load(k_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
            b_qj = tl.load(q_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
            b_run += tl.load(g_ptr + o_r[:, None] * STRIDE + o_k[None, :], mask=m_r, other=0.).to(tl.float32)
            m_c = o[None, :] == (base + j)[:, None]
            # dq: row i meets column base_i + j (j <= r_in(i))
            b_e = tl.exp(tl.where((r_in >= j)[:, None], b_gcs - b_run, float("-inf")))
            b_dq += tl.sum(tl.where(m_c, b_dAd, 0.), 1)[:, None] * b_kj * b_e
            # dk: row j' meets row base_j' + j of dA (j >= r_in(j'))
            b_e = tl.exp(tl.where((r_in <= j)[:, None], b_run - b_gcs, float("-inf")))
            b_dk += tl.sum(tl.where(m_c, b_dAt, 0.), 1)[:, None] * b_qj * b_e
    return b_dq, b_dk


# ---------------------------------------------------------------------------------------------
# custom ops


def custom_op(name: str, fake: Callable, *, backward: Callable | None = None,
              setup_context: Callable | None = None) -> Callable:
    """Decorator: register ``fn`` as the ``torch.library.custom_op`` ``lintime::<name>`` with its
    fake (shape) implementation and, when given, its autograd rule -- so ``torch.compile``
    traces calls to it (STYLE 9).  The op never mutates its inputs."""

    def wrap(fn: Callable):
        op = torch.library.custom_op(f"lintime::{name}", fn, mutates_args=())
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return wrap


def none_if_empty(x: torch.Tensor | None) -> torch.Tensor | None:
    """Custom ops cannot return ``None``: absent outputs travel as empty tensors."""
    return None if x is None or x.numel() == 0 else x


def empty_f32(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0, dtype=torch.float32)


def flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` -> contiguous ``[B * T, H, D]`` (a view when already contiguous)."""
    return x.contiguous().view(-1, *x.shape[2:])
