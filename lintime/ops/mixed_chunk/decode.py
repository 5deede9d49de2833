"""One FLASH decoding step from the projection, in place, as PyTorch composites (any device): the heads
(:func:`lintime.modules.heads.chunk.chunk_gau_heads`), one step of the recurrent form
(:func:`lintime.ops.mixed_chunk.recurrent.decode_one_token`) and its new state copied into the given one --
operation for operation what the FLASH layer's eager decoding step computes.  The fused form is
:mod:`lintime.ops.mixed_chunk.triton.decode`.

Notation: ``N`` sequences, ``S`` key width, ``E`` value width, ``C`` chunk size.
"""

from __future__ import annotations

import torch

from lintime.modules.heads.chunk import chunk_gau_heads
from lintime.ops.mixed_chunk.recurrent import decode_one_token
from lintime.ops.mixed_chunk.state import MixedChunkState, clean_buffers
from lintime.ops.utils import acc_dtype


def recurrent_decode_step_(h, gamma, beta, positions, state: MixedChunkState, *, rel_bias, scale, linear_norm,
                           rope_base) -> torch.Tensor:
    """``h [N, 2E + S]``, ``positions [N]``, ``rel_bias [1, 2C - 1]`` or ``None``; ``state`` (``H = 1``) is
    overwritten with the state after the token.  Returns ``u * a`` ``[N, E]`` in ``h``'s dtype."""
    S, E, C = state.k_quad.shape[-1], state.v.shape[-1], state.chunk_size
    u, v, heads = chunk_gau_heads(h[:, None], gamma, beta, positions[:, None], e=E, s=S, rope_base=rope_base)
    dt = acc_dtype(h)
    bk, bl, bv = clean_buffers(state, dt)
    cur = MixedChunkState(state.kv.to(dt), state.count, bk, bl, bv, state.fill)
    qq, kq, ql, kl = (heads[:, 0, i : i + 1].to(dt) for i in range(4))  # [N, 1, S]
    o, new = decode_one_token(cur, qq, kq, ql, kl, v[:, 0, None].to(dt), None,
                              rel_bias=None if rel_bias is None else rel_bias.to(dt),
                              scale=1.0 / C if scale is None else scale, linear_norm=linear_norm)
    for name in ("kv", "count", "k_quad", "k_lin", "v", "fill"):
        getattr(state, name).copy_(getattr(new, name))
    return u[:, 0] * o[:, 0].to(h.dtype)
