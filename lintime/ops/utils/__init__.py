"""What the op families share.  Here: input checks, sequence bounds, the per-sequence chunk layout used for packing
(``cu_seqlens``), and the chunk-state scan.  Its modules, for the Triton paths: :mod:`.launching` (what every launch
shares on the host: launch configs, the custom-op registration, block and dtype rules), :mod:`.segments` (the one
planner of packed calls: segment and chunk tables), :mod:`.state_passing` (the segment-state scan kernels),
:mod:`.tma` (TMA descriptors) and :mod:`.bias` (the relative-position bias of GAU and mixed chunk attention).
A family's Triton path reads its own folder and this package.

Notation: ``B`` batch, ``T`` time, ``H`` heads, ``C`` chunk size, ``R`` rows of the chunk
layout (``B`` without packing, 1 with ``cu_seqlens``), ``NC`` chunks per row, ``N`` sequences.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half inputs, the input dtype for fp32/fp64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rope_inv_freq(half: int, base: float, dtype: torch.dtype, device) -> torch.Tensor:
    """RoPE / sinusoid frequencies ``base ** (-i / half)``, ``i < half`` (FLASH seed Codes 2, 3)."""
    return base ** -(torch.arange(half, device=device, dtype=dtype) / half)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE (seed Code 3, two-halves layout) over ``x``'s last dim ``D`` (even):
    ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``, angle ``p * base ** (-i / (D/2))`` computed in
    fp32 (fp64 for fp64 ``x``); ``positions`` broadcasts against ``x.shape[:-1]``.  Result in ``x``'s
    dtype."""
    half = x.shape[-1] // 2
    adt = acc_dtype(x)
    ang = positions.to(adt)[..., None] * rope_inv_freq(half, base, adt, x.device)
    cos, sin = ang.cos(), ang.sin()
    xf = x.to(adt)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def check_tensor(op: str, name: str, x: torch.Tensor, ndim: int = 4) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dims, got shape {tuple(x.shape)}")
    if ndim == 4 and x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be a floating tensor, got {x.dtype}")


def check_same_btH(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    """All ``others`` share ``ref``'s ``[B, T, H]`` and device."""
    for name, x in others.items():
        check_tensor(op, name, x)
        if x.shape[:3] != ref.shape[:3]:
            raise ValueError(
                f"{op}: {name} has [B, T, H] = {tuple(x.shape[:3])}, but {ref_name} has {tuple(ref.shape[:3])}"
            )
        if x.device != ref.device:
            raise ValueError(f"{op}: {name} is on {x.device}, {ref_name} on {ref.device}")


# A static cu_seqlens: a buffer of fixed length whose values change between calls without any host code seeing them
# (a CUDA graph replays the ops with each batch's offsets copied in).  Its trailing entries repeat the total
# (empty sequences), so its length is a capacity, not the batch's number of documents.  An op given one reads no
# value on the host and caches nothing keyed on it: it derives its packed plan from the buffer on the device, with
# sizes bounded by shapes (the number of entries, the tokens, the chunk size).
_STATIC_ATTR = "_lintime_static_seqlens"


_STATIC_BOUND_ATTR = "_lintime_static_max_seqlen"


def mark_static(cu_seqlens: torch.Tensor, max_seqlen: int | None = None) -> torch.Tensor:
    """Mark ``cu_seqlens`` (``[Ncap + 1]`` int32 on the device) as static (see above) and return it.  ``max_seqlen``:
    a bound on every sequence it will hold (a packed batch's row length: documents never cross rows), for ops whose
    grids follow the longest sequence (softmax attention's varlen kernel); ``None``: the packed length."""
    setattr(cu_seqlens, _STATIC_ATTR, True)
    setattr(cu_seqlens, _STATIC_BOUND_ATTR, max_seqlen)
    return cu_seqlens


def static_max_seqlen(cu_seqlens: torch.Tensor) -> int | None:
    """The bound given to :func:`mark_static` (``None``: none given)."""
    return getattr(cu_seqlens, _STATIC_BOUND_ATTR, None)


def is_static(cu_seqlens: torch.Tensor | None) -> bool:
    """True for a ``cu_seqlens`` marked by :func:`mark_static`: no host read of its values, no cache keyed on it."""
    return cu_seqlens is not None and getattr(cu_seqlens, _STATIC_ATTR, False)


# Host work of packed calls, per cu_seqlens tensor: a model passes one cu_seqlens to every layer's forward and
# backward, and each packed call would otherwise read it on the host (a sync that stalls the launch queue) and rebuild
# its tables.  Entries of the last cu_seqlens seen; it is the same tensor only while the weak reference resolves to it
# and its version counter (bumped by in-place writes) is unchanged.
_PACKED: dict = {"ref": None, "version": -1, "entries": {}}


def packed_cache(cu_seqlens: torch.Tensor, key: tuple) -> dict:
    """The cache entry (a dict, empty at first) of ``key`` for this ``cu_seqlens`` tensor; all entries are dropped
    when another tensor comes, or this one was written in place.  Used by :func:`check_cu_seqlens`, the planners'
    :func:`lintime.ops.utils.segments.cached_plan` and GAU's packed plan."""
    ref = _PACKED["ref"]
    if ref is None or ref() is not cu_seqlens or _PACKED["version"] != cu_seqlens._version:
        _PACKED.update(ref=weakref.ref(cu_seqlens), version=cu_seqlens._version, entries={})
    return _PACKED["entries"].setdefault(key, {})


def check_cu_seqlens(op: str, cu_seqlens: torch.Tensor | None, B: int, T: int) -> None:
    """Shape, dtype and values of ``cu_seqlens`` (the values cost one device-to-host read, once per tensor: a model's
    layers pass the same one, :func:`packed_cache`).  While ``torch.compile`` traces, only shape and dtype: a value
    read would break the graph, and the model checks the values once at its entry (the backbone's ``_check_cu_seqlens``)."""
    if cu_seqlens is None:
        return
    check_cu_seqlens_shape(op, cu_seqlens, B)
    if torch.compiler.is_compiling() or is_static(cu_seqlens):
        return
    entry = packed_cache(cu_seqlens, ("values checked", T))
    if not entry:
        check_cu_seqlens_values(op, cu_seqlens.tolist(), T)
        entry["ok"] = True


def check_cu_seqlens_shape(op: str, cu_seqlens: torch.Tensor, B: int) -> None:
    """The checks of :func:`check_cu_seqlens` that need no values (no host read)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D tensor [N+1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype.is_floating_point:
        raise TypeError(f"{op}: cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"{op}: with cu_seqlens the batch size must be 1 (packed), got B={B}")


def check_cu_seqlens_values(op: str, cu: list[int], T: int) -> None:
    """The value checks of :func:`check_cu_seqlens`, on offsets already read to the host."""
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{op}: cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cu}")


# Tensors whose *values* an op has already validated (or produced itself), so that the next call
# that receives them (a decoding step continuing a state) can skip the value checks that would
# read them back to the host -- one device->host sync per check on CUDA.  Keyed by ``id``; each
# entry holds a weak reference (the entry goes when the tensor does) and the tensor's version
# counter at marking time, so a tensor modified in place since is checked again.  Inference
# tensors have no version counter: for them identity alone counts.
_CHECKED: dict[int, tuple[weakref.ref, int]] = {}


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


def mark_checked(*tensors: torch.Tensor | None) -> None:
    """Record that the values of ``tensors`` are valid for the op that produced or checked them
    (``None`` entries are ignored)."""
    for t in tensors:
        if t is None:
            continue
        key = id(t)
        _CHECKED[key] = (weakref.ref(t, lambda _, key=key: _CHECKED.pop(key, None)), _version(t))


def is_checked(*tensors: torch.Tensor | None) -> bool:
    """All ``tensors`` (``None`` entries count as checked) were marked by :func:`mark_checked`
    and none was modified in place since."""
    for t in tensors:
        if t is None:
            continue
        entry = _CHECKED.get(id(t))
        if entry is None or entry[0]() is not t or entry[1] != _version(t):
            return False
    return True


def num_seqs(B: int, cu_seqlens: torch.Tensor | None) -> int:
    """Number of sequences (rows of a state) in a ``[B, T]`` batch or a packed one."""
    return B if cu_seqlens is None else cu_seqlens.numel() - 1


def sequence_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``starts [N]``, ``lengths [N]`` (int64, CPU) of the sequences in the flattened ``[B * T]`` token order (one
    host read of a ``cu_seqlens``)."""
    if cu_seqlens is None:
        starts = torch.arange(B, dtype=torch.long) * T
        return starts, torch.full((B,), T, dtype=torch.long)
    cu = cu_seqlens.detach().to("cpu", torch.long)
    return cu[:-1].clone(), cu[1:] - cu[:-1]


def row_spans(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """:func:`sequence_bounds` as ``(row, start, end)`` python ints in the ``[B, T]`` layout, in order: row ``b`` and
    ``[0, T)`` without packing, row 0 and ``[cu[n], cu[n + 1])`` with ``cu_seqlens``."""
    starts, lengths = sequence_bounds(B, T, cu_seqlens)
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    return [(0, s, s + n) for s, n in zip(starts.tolist(), lengths.tolist())]


@dataclass
class ChunkLayout:
    """Chunks laid out per sequence: every sequence starts a new chunk and its last chunk is
    zero-padded.  Packed tokens of ``[B, T]`` map to slots of ``[R, NC * C]``.

    ``dest``   ``[B * T]`` flat slot index of each token in the ``[R * NC * C]`` layout;
    ``first``  ``[R, NC]`` the chunk opens a sequence (its incoming state is the initial state);
    ``seq``    ``[R, NC]`` sequence index of each chunk (padding chunks of a row point at the row's seq);
    ``valid``  ``[R, NC, C]`` the slot holds a real token;
    ``last``   ``[N]`` flat chunk index of each sequence's last chunk, ``-1`` for an empty sequence;
    ``lengths`` ``[N]`` python ints.
    """

    B: int
    T: int
    C: int
    R: int
    NC: int
    dest: torch.Tensor
    first: torch.Tensor
    seq: torch.Tensor
    valid: torch.Tensor
    last: torch.Tensor
    lengths: list[int]

    @property
    def N(self) -> int:
        return len(self.lengths)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, *rest] -> [R, NC, C, *rest]``, zero in padding slots."""
        rest = x.shape[2:]
        out = x.new_zeros((self.R * self.NC * self.C, *rest))
        out = out.index_copy(0, self.dest, x.reshape(self.B * self.T, *rest))
        return out.view(self.R, self.NC, self.C, *rest)

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """``[R, NC, C, *rest] -> [B, T, *rest]``."""
        rest = y.shape[3:]
        flat = y.reshape(self.R * self.NC * self.C, *rest)
        return flat.index_select(0, self.dest).view(self.B, self.T, *rest)

    def positions(self) -> torch.Tensor:
        """``[R, NC, C]`` position of each slot inside its sequence."""
        # chunk number inside its sequence = index - index of the sequence's first chunk
        idx = torch.arange(self.NC, device=self.dest.device).expand(self.R, self.NC)
        start = torch.where(self.first, idx, torch.zeros_like(idx))
        start = torch.cummax(start, dim=1).values
        nc = idx - start
        return nc[..., None] * self.C + torch.arange(self.C, device=self.dest.device)


def chunk_layout(B: int, T: int, C: int, cu_seqlens: torch.Tensor | None, device) -> ChunkLayout:
    """Build the per-sequence chunk layout of a ``[B, T]`` batch (or a packed ``[1, T]`` one)."""
    if C < 1:
        raise ValueError(f"chunk_size must be >= 1, got {C}")
    if cu_seqlens is None:
        NC = max(1, math.ceil(T / C))
        R = B
        t = torch.arange(T, device=device)
        dest = (torch.arange(B, device=device)[:, None] * (NC * C) + t).reshape(-1)
        first = torch.zeros(R, NC, dtype=torch.bool, device=device)
        first[:, 0] = True
        seq = torch.arange(B, device=device)[:, None].expand(R, NC).contiguous()
        valid = (torch.arange(NC * C, device=device) < T).view(1, NC, C).expand(R, NC, C).contiguous()
        nlast = math.ceil(T / C)
        last = torch.arange(B, device=device) * NC + (nlast - 1) if T > 0 else torch.full((B,), -1, device=device)
        return ChunkLayout(B, T, C, R, NC, dest, first, seq, valid, last.long(), [T] * B)
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    nchunks = [math.ceil(n / C) for n in lengths]
    NC = max(1, sum(nchunks))
    starts = [0]
    for n in nchunks:
        starts.append(starts[-1] + n)
    first = torch.zeros(1, NC, dtype=torch.bool)
    seq = torch.zeros(1, NC, dtype=torch.long)
    last = torch.full((len(lengths),), -1, dtype=torch.long)
    dest_parts = []
    for n, (L, s0, nch) in enumerate(zip(lengths, starts, nchunks)):
        if nch == 0:
            continue
        first[0, s0] = True
        seq[0, s0 : s0 + nch] = n
        last[n] = s0 + nch - 1
        dest_parts.append(torch.arange(L) + s0 * C)
    dest = torch.cat(dest_parts) if dest_parts else torch.zeros(0, dtype=torch.long)
    valid = torch.zeros(NC * C, dtype=torch.bool)
    valid[dest] = True
    return ChunkLayout(
        1, T, C, 1, NC, dest.to(device), first.to(device), seq.to(device),
        valid.view(1, NC, C).to(device), last.to(device), lengths,
    )


def chunk_scan(
    layout: ChunkLayout,
    delta: torch.Tensor,
    decay: torch.Tensor | None = None,
    initial: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass a state along the chunks of each sequence.

    ``delta``   ``[R, NC, *S]`` what each chunk adds to the state;
    ``decay``   ``[R, NC, *D]`` (broadcastable to ``S``) multiplicative factor applied to the
                incoming state by each chunk (``None`` = 1);
    ``initial`` ``[N, *S]`` state each sequence starts from (``None`` = 0).

    Returns ``before [R, NC, *S]`` (the state each chunk starts from) and ``final [N, *S]``
    (the state after each sequence's last chunk; ``initial`` for an empty sequence).
    Differentiable in all tensor inputs.
    """
    R, NC = delta.shape[:2]
    S = delta.shape[2:]
    if initial is None:
        initial = delta.new_zeros((layout.N, *S))
    h = delta.new_zeros((R, *S))
    # split along chunks once: indexing delta[:, c] inside the loop would make the backward
    # build a full-size gradient per chunk (O(NC^2) time and memory traffic)
    starts = initial.index_select(0, layout.seq.reshape(-1)).view(R, NC, *S).unbind(1)
    deltas = delta.unbind(1)
    decays = decay.unbind(1) if decay is not None else None
    befores, afters = [], []
    for c in range(NC):
        m = layout.first[:, c].view(R, *([1] * len(S)))
        h = torch.where(m, starts[c], h)
        befores.append(h)
        h = h * decays[c] + deltas[c] if decay is not None else h + deltas[c]
        afters.append(h)
    before = torch.stack(befores, dim=1)
    after = torch.stack(afters, dim=1).reshape(R * NC, *S)
    has = layout.last >= 0
    final = torch.where(
        has.view(-1, *([1] * len(S))), after.index_select(0, layout.last.clamp(min=0)), initial
    )
    return before, final
