"""Pieces shared by the GAU, FLASH and MC-TFM++ mixers (private to ``lintime.layers``).

* :func:`append_kv` -- write the new tokens of a ``[B, T]`` (or packed) call into a
  :class:`~lintime.layers.attention.KVCache` (out of place, or in place into a static cache) and
  say where each token went;
* :func:`step_backend` -- the op backend of a one-token decoding step;
* :func:`to_rows` / :func:`from_rows` -- move tokens between the call's ``[B, T]`` layout and a
  ``[N, L]`` row-per-sequence layout;
* :func:`dense_attention` -- the textbook masked attention (relu^2 or softmax kernel, optional
  Toeplitz bias) of queries held in rows against keys held in rows.  It is the decoding /
  reference form; full-sequence training goes through the ops (:mod:`lintime.ops`);
* :func:`bias_diagonals` -- a :class:`~lintime.layers.positional.ToeplitzRelativeBias`'s
  diagonals for any length (zero beyond a direct table, for packed rows whose sequences fit it).

Notation: ``B`` batch, ``T`` new tokens, ``N`` sequences (rows), ``Lq`` query slots per row,
``L`` key slots per row, ``H`` heads, ``K`` key width, ``V`` value width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.layers.attention import KVCache, write_kv
from lintime.layers.positional import ToeplitzRelativeBias


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rows_of_tokens(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> tuple:
    """Coordinates of the tokens of a ``[B, T]`` (or packed ``[1, T]``) batch in a ``[N, Lq]`` row
    layout: ``row [B*T]``, ``t [B*T]`` (index inside its sequence's new tokens) and the python
    list ``counts [N]`` of new tokens per sequence."""
    if cu_seqlens is None:
        row = torch.arange(B, device=device).repeat_interleave(T)
        t = torch.arange(T, device=device).repeat(B)
        return row, t, [T] * B
    cu_t = cu_seqlens.to(device=device, dtype=torch.long)
    counts = cu_t.diff().tolist()
    tok = torch.arange(T, device=device)
    row = torch.searchsorted(cu_t, tok, right=True) - 1
    return row, tok - cu_t.index_select(0, row), counts


def to_rows(x: torch.Tensor, row: torch.Tensor, t: torch.Tensor, N: int, Lq: int) -> torch.Tensor:
    """``[B, T, *rest]`` -> ``[N, Lq, *rest]`` (zeros in the slots no token fills)."""
    rest = x.shape[2:]
    return x.new_zeros((N, Lq, *rest)).index_put((row, t), x.reshape(-1, *rest))


def from_rows(y: torch.Tensor, row: torch.Tensor, t: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """``[N, Lq, *rest]`` -> ``[B, T, *rest]``."""
    return y[row, t].view(B, T, *y.shape[2:])


def empty_cache(N: int, H: int, K: int, V: int, device, dtype) -> KVCache:
    return KVCache(
        k=torch.zeros(N, 0, H, K, device=device, dtype=dtype),
        v=torch.zeros(N, 0, H, V, device=device, dtype=dtype),
        lengths=torch.zeros(N, dtype=torch.long, device=device),
        max_length=0,
    )


def append_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, who: str):
    """Append the call's keys ``k [B, T, H, K]`` and values ``v [B, T, H, V]`` after each
    sequence's cached tokens (out of place: states are values; in place into a static cache).

    Returns ``(new_cache, row, t, Lq)``: the token at flat index ``m`` of the call went to row
    ``row[m]``, slot ``cache.lengths[row[m]] + t[m]``; ``Lq`` is the most new tokens of a row.
    """
    B, T, H, K = k.shape
    N = cache.k.shape[0]
    row, t, counts = rows_of_tokens(B, T, cu_seqlens, k.device)
    if len(counts) != N:
        what = "packed sequences" if cu_seqlens is not None else "batch rows"
        raise ValueError(f"{who}: the state holds {N} sequences but the input has {len(counts)} {what}")
    Lq = max(counts, default=0)
    slot = cache.lengths.index_select(0, row) + t
    kc, vc, need = write_kv(cache, row, slot, k.reshape(B * T, H, K), v.reshape(B * T, H, -1),
                            cache.max_length + Lq)
    # a constant without packing: no host->device copy of the counts
    added = T if cu_seqlens is None else torch.tensor(counts, dtype=torch.long, device=k.device)
    lengths = cache.lengths + added
    return KVCache(kc, vc, lengths, need, cache.static), row, t, Lq


def step_backend(backend: str | None, T: int, cu_seqlens: torch.Tensor | None, state) -> str | None:
    """The mixed chunk op's backend for a call: a one-token decoding step (state, ``T == 1``, no
    packing) with no explicit backend runs the op's ``recurrent`` form on every device -- fixed
    shapes and no host read, so a CUDA graph can capture it (the fused kernels' path reads the
    chunk fill back to the host and prepends the partial chunk: shapes that change per token)."""
    if backend is None and state is not None and T == 1 and cu_seqlens is None:
        return "recurrent"
    return backend


def bias_diagonals(bias: ToeplitzRelativeBias, T: int) -> torch.Tensor:
    """``[H, 2T - 1]`` diagonals for any ``T``.  A direct table (``max_len < 512``) holds offsets
    up to ``max_len - 1``; beyond it the diagonals are zero.  Callers check that no sequence is
    longer than ``max_len``, so the zeros are only ever paired with tokens of *other* packed
    sequences (which the ops mask) or padding."""
    if bias.mode == "direct" and T > bias.max_len:
        pad = T - bias.max_len
        return F.pad(bias.diagonals(bias.max_len), (pad, pad))
    return bias.diagonals(T)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qslot: torch.Tensor,
    kvalid: torch.Tensor,
    *,
    kernel: str,
    scale: float,
    bias: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Masked attention of row queries over row keys, the textbook way.

    ``q [N, Lq, H, K]``, ``k [N, L, H, K]``, ``v [N, L, H, V]``; ``qslot [N, Lq]`` int64 the key
    slot (= position in the sequence) of each query; ``kvalid [N, L]`` bool, the slot holds a key.
    Query ``i`` sees key ``j`` when ``kvalid[j]`` and, if ``causal``, ``j <= qslot[i]``.

    ``kernel='relu2'``: ``o_i = sum_j relu(scale q_i.k_j + b[i-j])^2 v_j`` (seed Eq. 5);
    ``kernel='softmax'``: ``o_i = sum_j softmax_j(scale q_i.k_j + b[i-j]) v_j`` (a query that
    sees no key gives 0).  ``bias``: ``[H, 2L - 1]`` diagonals, ``b[d] = bias[:, d + L - 1]``.
    Computed in fp32 (fp64 for fp64 inputs); returns ``[N, Lq, H, V]`` in ``q``'s dtype.
    """
    dt = _acc(q.dtype)
    L = k.shape[1]
    s = torch.einsum("nqhk,nlhk->nhql", q.to(dt), k.to(dt)) * scale  # [N, H, Lq, L]
    j = torch.arange(L, device=q.device)
    if bias is not None:
        off = (qslot[:, :, None] - j + L - 1).clamp(0, 2 * L - 2)  # [N, Lq, L]
        s = s + bias.to(dt)[:, off].transpose(0, 1)
    mask = kvalid[:, None, :].expand(-1, qslot.shape[1], -1)  # [N, Lq, L]
    if causal:
        mask = mask & (j <= qslot[:, :, None])
    mask = mask[:, None]  # [N, 1, Lq, L]
    zero = torch.zeros((), dtype=dt, device=q.device)
    if kernel == "relu2":
        w = torch.where(mask, torch.relu(s) ** 2, zero)
    elif kernel == "softmax":
        # a row without any key (a padding query) softmaxes zeros instead of all -inf, so neither
        # its output nor its gradient is NaN; its weights are then masked to 0
        s = torch.where(mask.any(-1, keepdim=True), s.masked_fill(~mask, float("-inf")), zero)
        w = torch.where(mask, torch.softmax(s, dim=-1), zero)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return torch.einsum("nhql,nlhv->nqhv", w, v.to(dt)).to(q.dtype)
