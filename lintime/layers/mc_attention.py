"""Multi-head attention with mixed chunk attention: the mixer of MC-TFM++ (FLASH seed Section 4.4,
"Significance of GAU", Figure 7 and Table 5).

The seed: "we apply the same idea of mixed chunk attention to Transformer++ ... MC-TFM++ uses
quadratic MHSA within each chunk and multi-head linear attention across chunks".  Transformer++'s
MHSA is softmax attention with RoPE, so per head ``h`` and token ``i`` in chunk ``c(i)``::

    q, k, v      = split(dense(x))                                 # [B, T, H, K] each
    ql, kl       = q * gamma[0] + beta[0], k * gamma[1] + beta[1]   # per-head, per-dim (our choice)
    q, k, ql, kl = rope(.)                                          # in-sequence positions
    local_i      = sum_{j in c(i), j <= i} softmax_j(q_i . k_j / sqrt(K)) v_j
    linear_i     = ql_i . (sum_{j < s(c(i))} kl_j^T v_j) / N_i      # seed Eq. 8, per head
    y            = dense(local + linear)

The seed does not say where the linear heads' queries and keys come from; we derive them from
the MHSA's own ``q, k`` with a per-head, per-dimension scale and offset (initialised to the
identity), the analogue of FLASH's extra scale+offset heads (``4 H K`` parameters per layer,
nothing else added to Transformer++).  ``N_i`` is the op's ``linear_norm`` (default ``'tokens'``).

Implementation: the linear part, its chunk bookkeeping and its decoding state are
:func:`lintime.ops.mixed_chunk_attention` called with a zero quadratic query (its relu^2 part is
then exactly 0) and the softmax keys as ``k_quad``, so the op's state buffers the current chunk's
softmax keys and values; the local softmax part goes through :func:`lintime.ops.softmax_attention`
on the chunks.  The zero quadratic part still costs the op's ``C x C`` scores (a follow-up:
an op flag to skip it).

Decoding state: the op's :class:`~lintime.ops.MixedChunkState` as it is (``kv [N, H, K, K]`` plus
the partial chunk): O(C) per sequence, constant in ``T``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.layers._rows import step_backend
from lintime.layers.base import Mixer
from lintime.layers.positional import apply_rope
from lintime.ops import MixedChunkState, mixed_chunk_attention, softmax_attention
from lintime.ops.utils import chunk_layout, row_spans

LINEAR_NORMS = ("tokens", "chunk", "none")


def chunk_local_softmax(q, k, v, *, chunk_size: int, causal: bool, scale: float, cu_seqlens=None):
    """Softmax attention inside each chunk of ``C`` tokens (chunks counted from every sequence's
    first token): ``q, k [B, T, H, K]``, ``v [B, T, H, V]`` -> ``[B, T, H, V]``."""
    B, T, H, _ = q.shape
    C = chunk_size
    layout = chunk_layout(B, T, C, cu_seqlens, q.device)
    qc, kc, vc = (layout.to_chunks(x).flatten(0, 1) for x in (q, k, v))  # [chunks, C, H, *]
    if causal:
        # one batched call; a partial chunk's zero padding sits after its tokens, out of reach
        o = softmax_attention(qc, kc, vc, causal=True, scale=scale)
    else:
        # bidirectional: padding would be attended, so the chunks' real tokens are packed
        valid = layout.valid.flatten(0, 1)  # [chunks, C]
        cu = torch.cat([valid.new_zeros(1, dtype=torch.long), valid.sum(1).cumsum(0)])
        of = softmax_attention(qc[valid][None], kc[valid][None], vc[valid][None], causal=False, scale=scale,
                               cu_seqlens=cu)
        o = vc.new_zeros(vc.shape).index_put((valid,), of[0])
    return layout.from_chunks(o.view(layout.R, layout.NC, C, *o.shape[2:]))


class MixedChunkMHA(Mixer):
    """MC-TFM++ attention (see the module docstring).

    Args:
        dim: model width; n_heads: ``H``; head_dim: ``K`` (``None``: ``dim // n_heads``).
        chunk_size: ``C`` (the seed: 256, as FLASH).
        causal: causal (Eq. 8) or bidirectional (Eq. 7) linear part, causal / full local part.
        linear_norm: ``'tokens'`` | ``'chunk'`` | ``'none'`` (see :func:`lintime.ops.mixed_chunk_attention`).
        rope: rotate q, k, ql, kl (Transformer++: yes); rope_base: its base.
        bias: biases on the q/k/v and output projections.
        backend: passed to :func:`lintime.ops.mixed_chunk_attention`.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        chunk_size: int = 256,
        causal: bool = True,
        linear_norm: str = "tokens",
        rope: bool = True,
        rope_base: float = 10000.0,
        bias: bool = True,
        backend: str | None = None,
    ):
        super().__init__()
        if head_dim is None:
            if dim % n_heads:
                raise ValueError(f"MixedChunkMHA: dim {dim} is not divisible by n_heads {n_heads}")
            head_dim = dim // n_heads
        if linear_norm not in LINEAR_NORMS:
            raise ValueError(f"MixedChunkMHA: linear_norm must be one of {LINEAR_NORMS}, got {linear_norm!r}")
        if chunk_size < 1:
            raise ValueError(f"MixedChunkMHA: chunk_size must be >= 1, got {chunk_size}")
        if rope and head_dim % 2:
            raise ValueError(f"MixedChunkMHA: RoPE needs an even head_dim, got {head_dim}")
        H, K = n_heads, head_dim
        self.dim, self.n_heads, self.head_dim, self.chunk_size = dim, H, K, chunk_size
        self.causal, self.linear_norm, self.backend = causal, linear_norm, backend
        self.rope, self.rope_base = rope, rope_base
        self.qkv = nn.Linear(dim, 3 * H * K, bias=bias)
        self.out = nn.Linear(H * K, dim, bias=bias)
        # linear-attention heads: per-head, per-dim scale and offset of q and k (identity at init)
        self.lin_scale = nn.Parameter(torch.ones(2, H, K))
        self.lin_offset = nn.Parameter(torch.zeros(2, H, K))

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        nn.init.ones_(self.lin_scale)
        nn.init.zeros_(self.lin_offset)

    def no_weight_decay(self) -> set[str]:
        return {"lin_scale", "lin_offset"}

    def _local_step(self, q, k, v, state: MixedChunkState, scale):
        """The decoding step (``T == 1``, no packing) of :meth:`_local_with_buffer`: one query per
        sequence over its buffered keys (slots ``< fill``) and itself, as one masked attention
        with no host read.  ``q, k, v [N, 1, H, K]`` -> ``[N, 1, H, K]``."""
        C = self.chunk_size
        slots = torch.arange(C + 1, device=q.device)
        keep = (slots < state.fill[:, None]) | (slots == C)  # [N, C + 1]: the chunk so far + the token
        kb = torch.cat([state.k_quad.to(k.dtype), k], 1)  # [N, C + 1, H, K]
        # slots beyond fill hold no token: zero their values so nothing left there reaches the output
        vb = torch.where(keep[:, :, None, None], torch.cat([state.v.to(v.dtype), v], 1), v.new_zeros(()))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                           attn_mask=keep[:, None, None, :], scale=scale)
        return o.transpose(1, 2)

    def _local_with_buffer(self, q, k, v, state: MixedChunkState, cu_seqlens, scale):
        """Local softmax of new tokens that continue the partial chunks held in ``state``: each
        sequence's buffered keys / values (with dummy queries) are put in front of its new tokens,
        so every packed sequence starts on a chunk boundary."""
        B, T, H, K = q.shape
        if T == 1 and cu_seqlens is None:
            return self._local_step(q, k, v, state, scale)
        fills = state.fill.tolist()
        parts = ([], [], [])
        cu, keep, pos = [0], [], 0
        for n, (row, s, e) in enumerate(row_spans(B, T, cu_seqlens)):
            f = fills[n]
            dummy = q.new_zeros((f, H, K))
            for i, (x, pre) in enumerate(zip((q, k, v), (dummy, state.k_quad[n, :f], state.v[n, :f]))):
                parts[i].extend([pre.to(x.dtype), x[row, s:e]])
            keep.append(torch.arange(pos + f, pos + f + e - s))
            pos += f + e - s
            cu.append(pos)
        qv, kv, vv = (torch.cat(p)[None] for p in parts)
        o = chunk_local_softmax(qv, kv, vv, chunk_size=self.chunk_size, causal=True, scale=scale,
                                cu_seqlens=torch.tensor(cu, device=q.device))
        return o[0].index_select(0, torch.cat(keep).to(q.device)).view(B, T, H, -1)

    def forward(
        self,
        x: torch.Tensor,
        state: MixedChunkState | None = None,
        *,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        aux_losses: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, MixedChunkState | None]:
        B, T, _ = x.shape
        H, K, C = self.n_heads, self.head_dim, self.chunk_size
        q, k, v = self.qkv(x).view(B, T, 3, H, K).unbind(2)  # [B, T, H, K] each
        ql = q * self.lin_scale[0].to(q.dtype) + self.lin_offset[0].to(q.dtype)
        kl = k * self.lin_scale[1].to(k.dtype) + self.lin_offset[1].to(k.dtype)
        if self.rope:
            q, k, ql, kl = (apply_rope(t, positions, self.rope_base) for t in (q, k, ql, kl))
        scale = K**-0.5
        # the op's relu^2 quadratic part is switched off by a zero query; it carries the softmax
        # keys in its state buffers (k_quad) for the local part of later calls
        zero = torch.zeros_like(q)
        kwargs = dict(chunk_size=C, causal=self.causal, rel_bias=None, linear_norm=self.linear_norm,
                      cu_seqlens=cu_seqlens, backend=step_backend(self.backend, T, cu_seqlens, state))
        if state is None:
            local = chunk_local_softmax(q, k, v, chunk_size=C, causal=self.causal, scale=scale, cu_seqlens=cu_seqlens)
            linear, new_state = mixed_chunk_attention(zero, k, ql, kl, v, **kwargs)
        else:
            if not self.causal:
                raise ValueError("MixedChunkMHA: a decoding state needs causal attention")
            local = self._local_with_buffer(q, k, v, state, cu_seqlens, scale)
            linear, new_state = mixed_chunk_attention(zero, k, ql, kl, v, initial_state=state,
                                                      output_final_state=True, **kwargs)
        return self.out((local + linear).reshape(B, T, H * K)), new_state

    def init_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> MixedChunkState:
        H, K = self.n_heads, self.head_dim
        return MixedChunkState.zeros(batch_size, self.chunk_size, H, K, K, dtype=dtype, device=device)

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_dim={self.head_dim}, chunk_size={self.chunk_size}, "
                f"causal={self.causal}, linear_norm={self.linear_norm}, rope={self.rope}")


__all__ = ["MixedChunkMHA", "chunk_local_softmax"]
