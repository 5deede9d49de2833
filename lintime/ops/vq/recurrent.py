"""Token-by-token Transformer-VQ attention on a :class:`VQState` (decoding; seed Theorem 3.7
read one query at a time, with the running-mean cache of Remark 3.9).

One step for a token at position ``p`` (block ``n = p // L``, slot ``r = p % L``):

1. write its ``k_hat``, ``v``, code into window slot ``L + r``;
2. attend over the window (slots ``[0, L)`` = block ``n - 1`` if ``n >= 1``, slots
   ``[L, L + r]``), bias column ``j`` on slot ``j``, and over the cache
   (``q . codebook^T + log(count)``), in one softmax;
3. ``p += 1``; when that completes block ``n``, block ``n - 1`` joins the cache (its per-code
   summary merged into the running means, seed Code 2 ``scan_func``) and the window shifts by ``L``.

All sequences step together (packed ones too: a sequence that has run out of tokens keeps its
state).  Gradients: window keys -> ``k_hat``, cached keys -> ``codebook``, as in the chunked form.
"""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, row_spans
from lintime.ops.vq.state import VQState, block_summary, log_count, merge


def vq_step(state: VQState, q, k_hat, codes, v, codebook, bias=None, active=None):
    """One decoding step for ``N`` sequences.

    ``q``, ``k_hat`` ``[N, H, K]``; ``codes`` ``[N, H]``; ``v`` ``[N, H, V]``; ``codebook``
    ``[H, S, K]``; ``bias`` ``[N, H, 2L]`` or ``None``; ``active`` ``[N]`` bool (``None`` = all):
    inactive sequences keep their state.  ``state`` must hold the compute dtype.
    Returns ``o [N, H, V]`` (compute dtype) and the new state.
    """
    N = q.shape[0]
    L = state.block_len
    S = codebook.shape[1]
    dev = q.device
    pos = state.pos
    r = pos % L  # [N]
    slots = torch.arange(2 * L, device=dev)
    here = (slots[None, :] == (L + r)[:, None])  # [N, 2L] slot of the new token
    kb = torch.where(here[..., None, None], k_hat[:, None], state.k_hat)  # [N, 2L, H, K]
    vb = torch.where(here[..., None, None], v[:, None], state.v)
    zb = torch.where(here[..., None], codes[:, None].long(), state.codes)

    s_win = torch.einsum("nhk,njhk->nhj", q, kb)  # [N, H, 2L]
    if bias is not None:
        s_win = s_win + bias
    visible = torch.where(slots[None, :] < L, (pos >= L)[:, None], slots[None, :] <= (L + r)[:, None])
    s_win = s_win.masked_fill(~visible[:, None, :], float("-inf"))
    s_cache = torch.einsum("nhk,hsk->nhs", q, codebook) + log_count(state.cache_count)  # [N, H, S]
    p = torch.softmax(torch.cat([s_cache, s_win], -1), -1)
    o = torch.einsum("nhs,nhsv->nhv", p[..., :S], state.cache_mean)
    o = o + torch.einsum("nhj,njhv->nhv", p[..., S:], vb)

    # block completed: the previous block (valid once n >= 1) joins the cache, the window shifts
    pos1 = pos + 1
    done = (pos1 % L) == 0  # [N]
    prev_ok = (pos >= L)[:, None].expand(N, L)
    bc, bm = block_summary(zb[:, :L], vb[:, :L], prev_ok, S)
    cc, cm = merge(state.cache_count, state.cache_mean, bc, bm)
    d1, d2 = done[:, None, None], done[:, None, None, None]
    cc = torch.where(d1, cc, state.cache_count)
    cm = torch.where(d2, cm, state.cache_mean)
    shift = lambda x: torch.cat([x[:, L:], torch.zeros_like(x[:, L:])], 1)
    kb = torch.where(d2, shift(kb), kb)
    vb = torch.where(d2, shift(vb), vb)
    zb = torch.where(d1, shift(zb), zb)
    new = VQState(cache_mean=cm, cache_count=cc, k_hat=kb, v=vb, codes=zb, pos=pos1)
    if active is not None:
        new = VQState(*(
            torch.where(active.view(-1, *([1] * (a.dim() - 1))), a, b)
            for a, b in zip(_fields(new), _fields(state))
        ))
    return o, new


def _fields(s: VQState):
    return (s.cache_mean, s.cache_count, s.k_hat, s.v, s.codes, s.pos)


def recurrent_vq_attention(
    q, k_hat, codes, v, codebook, *, block_len, bias=None, reduction="serial",
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    # reduction: one block joins the cache at a time (the serial merge); the value is irrelevant.
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = codebook.shape[1]
    L = block_len
    dt = acc_dtype(q)
    dev = q.device
    seqs = row_spans(B, T, cu_seqlens)
    N = len(seqs)
    if initial_state is None:
        st = VQState.initial(N, H, S, K, V, L, dtype=dt, device=dev)
    else:
        st = initial_state.to(dtype=dt).canonical()
    lens = [e - s for _, s, e in seqs]
    Tm = max(lens, default=0)
    if cu_seqlens is None:  # row n is sequence n: the tokens are already [N, T] (no index tensors)
        lens_t = None
        steps = lambda x: x.unbind(1)
    else:
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        # token t of sequence n, [N, Tm] (clamped where the sequence is shorter), gathered once
        start = torch.tensor([row * T + s for row, s, _ in seqs], dtype=torch.long, device=dev)
        idx = (start[:, None] + torch.arange(Tm, device=dev)).clamp(max=max(B * T - 1, 0)).view(-1)
        steps = lambda x: x.reshape(B * T, *x.shape[2:]).index_select(0, idx).view(N, Tm, *x.shape[2:]).unbind(1)
    qs, ks, vs = (steps(x.to(dt)) for x in (q, k_hat, v))
    zs = steps(codes)
    bs = [None] * Tm if bias is None else steps(bias.to(dt))
    cb = codebook.to(dt)
    outs = []
    for t in range(Tm):
        active = None if all(n > t for n in lens) else t < lens_t  # [N]
        o_t, st = vq_step(st, qs[t], ks[t], zs[t], vs[t], cb, bs[t], active=active)
        outs.append(o_t)
    if outs and cu_seqlens is None:
        o = torch.stack(outs, 1)  # [B, T, H, V]
    elif outs:
        on = torch.stack(outs, 1).reshape(N * Tm, H, V)  # [N * Tm, H, V]
        src = torch.cat([n * Tm + torch.arange(ln) for n, ln in enumerate(lens)]).to(dev)
        # token order of row_spans is the flat [B * T] order
        o = on.index_select(0, src).view(B, T, H, V)
    else:
        o = q.new_zeros(B, T, H, V, dtype=dt)
    final = None
    if output_final_state:
        final = VQState(
            st.cache_mean, st.cache_count, st.k_hat.to(k_hat.dtype), st.v.to(v.dtype), st.codes, st.pos,
        )
    return o.to(q.dtype), final
