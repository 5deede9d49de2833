"""Token-by-token (decoding) form of causal mixed chunk attention.

All ``N`` sequences advance one token per step through :func:`decode_one_token`, which reads and
returns a :class:`MixedChunkState`: ``O(C * H * (S + E) + H * S * E)`` work and memory per token,
whatever the position (seed §3.2.1, "constant per-step decoding memory").
"""

from __future__ import annotations

import torch

from lintime.ops.mixed_chunk.state import MixedChunkState, clean_buffers, normalize_linear
from lintime.ops.utils import acc_dtype, row_spans


def decode_one_token(state, qq, kq, ql, kl, v, active, *, rel_bias, scale, linear_norm):
    """One step for every sequence.

    ``state``: a :class:`MixedChunkState` whose tensors are in the compute dtype; ``qq, kq, ql, kl``
    ``[N, H, S]``, ``v`` ``[N, H, E]``: this step's token of each sequence; ``active`` ``[N]`` bool,
    sequences without a token this step keep their state (``None``: every sequence has one).  Returns ``o [N, H, E]`` and the new state.
    """
    C = state.chunk_size
    dev = qq.device
    zero = torch.zeros((), dtype=qq.dtype, device=dev)
    slots = torch.arange(C, device=dev)
    fill = state.fill
    # the token enters its chunk at slot `fill`
    put = slots[None, :] == fill[:, None]
    if active is not None:
        put = put & active[:, None]
    put = put[:, :, None, None]  # [N, C, 1, 1]
    bk = torch.where(put, kq[:, None], state.k_quad)
    bl = torch.where(put, kl[:, None], state.k_lin)
    bv = torch.where(put, v[:, None], state.v)

    # quadratic part over the chunk so far (seed Eq. 6 with the causal mask)
    s = torch.einsum("nhs,nchs->nch", qq, bk) * scale  # [N, C, H]
    if rel_bias is not None:
        idx = (fill[:, None] - slots[None, :] + C - 1).clamp(0, 2 * C - 2)  # b[i-j], [N, C]
        s = s + rel_bias[:, idx].permute(1, 2, 0)
    seen = (slots[None, :] <= fill[:, None])[:, :, None]  # [N, C, 1]
    w = torch.where(seen, torch.relu(s) ** 2, zero)
    o = torch.einsum("nch,nche->nhe", w, bv)

    # linear part: the completed chunks (seed Eq. 8)
    lin = torch.einsum("nhs,nhse->nhe", ql, state.kv)
    o = o + normalize_linear(lin, state.count[:, None, None], linear_norm, C)

    # a full chunk moves into the linear sum and the buffers start over
    fill = fill + (1 if active is None else active.long())
    full = fill == C
    kv = state.kv + torch.where(full[:, None, None, None], torch.einsum("nchs,nche->nhse", bl, bv), zero)
    keep = ~full[:, None, None, None]
    new = MixedChunkState(
        kv=kv,
        count=state.count + full.long() * C,
        k_quad=torch.where(keep, bk, zero), k_lin=torch.where(keep, bl, zero), v=torch.where(keep, bv, zero),
        fill=torch.where(full, torch.zeros_like(fill), fill),
    )
    return o, new


def recurrent_mixed_chunk_attention(
    q_quad, k_quad, q_lin, k_lin, v, *, chunk_size=256, causal=True, rel_bias=None, scale=None,
    linear_norm="tokens", initial_state=None, output_final_state=False, cu_seqlens=None,
):
    if not causal:
        raise ValueError("mixed_chunk_attention: the recurrent form is causal only")
    B, T, H, S = q_quad.shape
    E = v.shape[-1]
    C = chunk_size
    scale = 1.0 / C if scale is None else scale
    dt = acc_dtype(q_quad)
    dev = q_quad.device
    bounds = row_spans(B, T, cu_seqlens)
    N = len(bounds)
    init = initial_state if initial_state is not None else MixedChunkState.zeros(
        N, C, H, S, E, dtype=q_quad.dtype, device=dev
    )
    bk, bl, bv = clean_buffers(init, dt)
    state = MixedChunkState(init.kv.to(dt), init.count, bk, bl, bv, init.fill)
    bias = rel_bias.to(dt) if rel_bias is not None else None

    # token t of every sequence, gathered once into [steps, N, H, *] and unbound, so the backward
    # pass does not touch the whole sequence at every step
    if cu_seqlens is None:  # row n is sequence n: no index tensors, no masking
        tokens = [x.to(dt).unbind(1) for x in (q_quad, k_quad, q_lin, k_lin, v)]
        outs = []
        for step in range(T):
            o_t, state = decode_one_token(
                state, *(x[step] for x in tokens), None, rel_bias=bias, scale=scale, linear_norm=linear_norm
            )
            outs.append(o_t)
        o = (torch.stack(outs, 1) if outs else q_quad.new_zeros(B, T, H, E, dtype=dt)).to(q_quad.dtype)
        return _finish(o, state, q_quad.dtype, output_final_state)
    starts = torch.tensor([row * T + s for row, s, _ in bounds], device=dev)
    lengths = torch.tensor([e - s for _, s, e in bounds], device=dev)
    steps = max([e - s for _, s, e in bounds], default=0)
    t = torch.arange(steps, device=dev)
    valid = t[:, None] < lengths[None, :]  # [steps, N]
    src = (starts[None, :] + t[:, None]).clamp(max=max(B * T - 1, 0))  # [steps, N]
    tokens = [
        x.reshape(B * T, H, x.shape[-1]).to(dt).index_select(0, src.reshape(-1)).view(steps, N, H, x.shape[-1])
        .unbind(0)
        for x in (q_quad, k_quad, q_lin, k_lin, v)
    ]
    outs = []
    for step in range(steps):
        o_t, state = decode_one_token(
            state, *(x[step] for x in tokens), valid[step], rel_bias=bias, scale=scale, linear_norm=linear_norm
        )
        outs.append(o_t)
    o = torch.zeros(B * T, H, E, dtype=dt, device=dev)
    if outs:
        o = o.index_copy(0, src[valid], torch.stack(outs)[valid])  # [steps, N, H, E] -> tokens
    o = o.view(B, T, H, E).to(q_quad.dtype)
    return _finish(o, state, q_quad.dtype, output_final_state)


def _finish(o, state, dtype, output_final_state):
    if not output_final_state:
        return o, None
    state.k_quad, state.k_lin, state.v = (x.to(dtype) for x in (state.k_quad, state.k_lin, state.v))
    return o, state
