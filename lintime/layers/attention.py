"""Multi-head softmax self-attention with a KV cache (Transformer, Transformer+, Transformer++).

Notation: ``B`` batch, ``T`` new tokens, ``H`` heads, ``K`` head width, ``N`` sequences (rows of
the state: ``B``, or the number of packed sequences), ``S`` cache capacity.

Full-sequence calls (``state=None``: training, scoring, packed batches) go through
:func:`lintime.ops.softmax_attention`.  Calls with a state attend the new queries to the cached
keys plus the new ones; docs/design/contract.md §2.1's op takes equal-length ``q`` and ``k`` and has no cache form,
so that path is :func:`_attend_cache` below (PyTorch SDPA with an explicit bottom-right causal
mask).  Moving it into ``lintime.ops`` is a follow-up.
"""

from __future__ import annotations

import dataclasses
import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.layers.base import BatchState, Mixer
from lintime.layers.positional import apply_rope
from lintime.ops import softmax_attention


@dataclasses.dataclass
class KVCache(BatchState):
    """Decoding state of :class:`MultiHeadAttention`.

    ``k``          ``[N, S, H, K]`` keys after RoPE, slot ``t`` of row ``n`` holds token ``t``
                   of sequence ``n`` for ``t < lengths[n]``, zeros beyond;
    ``v``          ``[N, S, H, V]`` values, same layout;
    ``lengths``    ``[N]`` int64 tokens held per sequence;
    ``max_length`` python int, an upper bound of ``lengths`` (kept on the host so a decoding
                   step needs no device sync); the capacity ``S >= max_length`` grows by doubling.
    ``static``     ``False``: calls return a new cache (states are values).  ``True`` (made by
                   :meth:`with_capacity`): ``S`` is fixed, ``max_length == S``, and calls write the
                   new tokens into ``k`` / ``v`` *in place*, so a decoding step has fixed shapes
                   (attention runs over all ``S`` slots, masked) and a CUDA graph can replay it.
    """

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor
    max_length: int = 0
    static: bool = False

    def with_capacity(self, capacity: int) -> "KVCache":
        """The static form (see ``static``): fresh ``[N, capacity, H, *]`` buffers holding this
        cache's tokens.  ``capacity`` must cover every token the cache will ever hold."""
        if capacity < self.max_length:
            raise ValueError(f"KVCache: capacity {capacity} is below the {self.max_length} tokens already held")
        keep = min(self.k.shape[1], capacity)

        def buf(x):
            out = x.new_zeros(x.shape[0], capacity, *x.shape[2:])
            out[:, :keep] = x[:, :keep]
            return out

        return KVCache(buf(self.k), buf(self.v), self.lengths.clone(), capacity, static=True)


def write_kv(cache: KVCache, row, slot, k, v, need: int):
    """The cache's key / value buffers with ``k [M, H, K]``, ``v [M, H, V]`` written at
    ``(row [M], slot [M])`` and the new host bound of the lengths.  A static cache is written in
    place (its bound stays its capacity); otherwise out of place, into a copy grown by doubling
    when ``need`` (the new bound) exceeds the capacity."""
    kc, vc = cache.k, cache.v
    if cache.static:
        kc.index_put_((row, slot), k.to(kc.dtype))
        vc.index_put_((row, slot), v.to(vc.dtype))
        return kc, vc, kc.shape[1]
    N, S = kc.shape[:2]
    if need > S:
        grow = max(need, 2 * S) - S
        kc = torch.cat([kc, kc.new_zeros(N, grow, *kc.shape[2:])], dim=1)
        vc = torch.cat([vc, vc.new_zeros(N, grow, *vc.shape[2:])], dim=1)
    return kc.index_put((row, slot), k.to(kc.dtype)), vc.index_put((row, slot), v.to(vc.dtype)), need


def _rows_of_tokens(B: int, T: int, cu_seqlens: torch.Tensor | None, device) -> tuple:
    """Map the tokens of a ``[B, T]`` (or packed ``[1, T]``) batch to ``(row, t)`` coordinates of
    a ``[N, Lq]`` row layout.  Returns ``row [B*T]``, ``t [B*T]``, ``counts [N]`` (python ints)."""
    if cu_seqlens is None:
        row = torch.arange(B, device=device).repeat_interleave(T)
        t = torch.arange(T, device=device).repeat(B)
        return row, t, [T] * B
    cu = cu_seqlens.tolist()
    counts = [b - a for a, b in zip(cu, cu[1:])]
    cu_t = cu_seqlens.to(device=device, dtype=torch.long)
    tok = torch.arange(T, device=device)
    row = torch.searchsorted(cu_t, tok, right=True) - 1
    return row, tok - cu_t.index_select(0, row), counts


def _attend_cache(q, k, v, cache: KVCache, cu_seqlens, scale):
    """Causal attention of new tokens over ``cache`` + themselves; returns ``(o, new_cache)``."""
    B, T, H, K = q.shape
    N = cache.batch_size
    row, t, counts = _rows_of_tokens(B, T, cu_seqlens, q.device)
    if len(counts) != N:
        what = "packed sequences" if cu_seqlens is not None else "batch rows"
        raise ValueError(f"MultiHeadAttention: the state holds {N} sequences but the input has {len(counts)} {what}")
    Lq = max(counts) if counts else 0
    # write the new keys / values after each row's cached tokens (out of place unless static)
    slot = cache.lengths.index_select(0, row) + t  # [B*T] cache slot of every new token
    kc, vc, need = write_kv(cache, row, slot, k.reshape(B * T, H, K), v.reshape(B * T, H, -1),
                            cache.max_length + Lq)
    # lengths grow by the new tokens of each row: a constant without packing (no host->device copy)
    added = T if cu_seqlens is None else torch.tensor(counts, device=q.device)
    new = KVCache(kc, vc, cache.lengths + added, need, cache.static)

    # queries in a [N, Lq] row layout (the identity without packing)
    q_rows = q if cu_seqlens is None else q.new_zeros(N, Lq, H, K).index_put((row, t), q[0])
    qpos = cache.lengths[:, None] + torch.arange(Lq, device=q.device)  # [N, Lq] slot of each query
    mask = torch.arange(need, device=q.device)[None, None, :] <= qpos[:, :, None]  # [N, Lq, need]
    o = F.scaled_dot_product_attention(
        q_rows.transpose(1, 2), kc[:, :need].to(q.dtype).transpose(1, 2), vc[:, :need].to(q.dtype).transpose(1, 2),
        attn_mask=mask[:, None], scale=scale,
    ).transpose(1, 2)  # [N, Lq, H, V]
    if cu_seqlens is not None:
        o = o[row, t][None]
    return o, new


class MultiHeadAttention(Mixer):
    """Softmax multi-head self-attention (Vaswani et al.), optionally with RoPE on q and k.

    ``qkv = dense(x)`` split into ``H`` heads of width ``K = head_dim``; ``o = softmax(q k^T /
    sqrt(K)) v`` (causal or not); ``y = dense(o)``.  With RoPE (Transformer+, ++) q and k are
    rotated by their in-sequence positions before attention and before caching.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        causal: bool = True,
        rope: bool = False,
        rope_base: float = 10000.0,
        bias: bool = True,
        backend: str | None = None,
    ):
        super().__init__()
        if head_dim is None:
            if dim % n_heads:
                raise ValueError(f"MultiHeadAttention: dim {dim} is not divisible by n_heads {n_heads}")
            head_dim = dim // n_heads
        self.dim, self.n_heads, self.head_dim = dim, n_heads, head_dim
        self.causal, self.rope, self.rope_base, self.backend = causal, rope, rope_base, backend
        self.qkv = nn.Linear(dim, 3 * n_heads * head_dim, bias=bias)
        self.out = nn.Linear(n_heads * head_dim, dim, bias=bias)

    def static_packing(self) -> bool:
        """Softmax attention's varlen path takes a static ``cu_seqlens`` with a static bound on its lengths."""
        return True

    def forward(
        self,
        x: torch.Tensor,
        state: KVCache | None = None,
        *,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        aux_losses: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, KVCache | None]:
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        q, k, v = self.qkv(x).view(B, T, 3, H, K).unbind(2)  # [B, T, H, K] each
        if self.rope:
            q = apply_rope(q, positions, self.rope_base)
            k = apply_rope(k, positions, self.rope_base)
        if state is None:
            o = softmax_attention(q, k, v, causal=self.causal, cu_seqlens=cu_seqlens, backend=self.backend)
            new_state = None
        else:
            if not self.causal:
                raise ValueError("MultiHeadAttention: a decoding state needs causal attention")
            o, new_state = _attend_cache(q, k, v, state, cu_seqlens, K**-0.5)
        return self.out(o.reshape(B, T, H * K)), new_state

    def init_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        H, K = self.n_heads, self.head_dim
        return KVCache(
            k=torch.zeros(batch_size, 0, H, K, device=device, dtype=dtype),
            v=torch.zeros(batch_size, 0, H, K, device=device, dtype=dtype),
            lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
            max_length=0,
        )

    def extra_repr(self) -> str:
        return f"heads={self.n_heads}, head_dim={self.head_dim}, causal={self.causal}, rope={self.rope}"


__all__ = ["KVCache", "MultiHeadAttention", "write_kv"]
