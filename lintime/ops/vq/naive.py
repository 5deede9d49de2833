"""Textbook Transformer-VQ attention: the dense causal softmax over all keys ``k_hat`` with the
windowed bias (seed Definition 3.1, Eq. 13 with row-wise softmax), one sequence at a time.

Keys are addressed by their position inside the sequence (counted from its start, continuing
across calls).  A query at position ``i`` in block ``n = i // L`` scores the key at position
``j <= i`` with ``q_i . k_hat_j``, plus ``bias[i, j - (n - 1) L]`` when ``0 <= j - (n - 1) L < 2L``.
Keys that were compressed into an initial state's cache are ``count_s`` copies of
``codebook[s]`` with value ``mean_s`` (seed Remark 3.9); every other key is used as given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.ops.utils import acc_dtype, row_spans
from lintime.ops.vq.state import VQState, _nonzero, log_count


def naive_vq_attention(
    q, k_hat, codes, v, codebook, *, block_len, bias=None, reduction="serial",
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    # reduction: the naive form has no cross-block reduction; every value gives the same result.
    B, T, H = q.shape[:3]
    V = v.shape[-1]
    S = codebook.shape[1]
    L = block_len
    dt = acc_dtype(q)
    dev = q.device
    cb = codebook.to(dt)  # [H, S, K]
    o = torch.zeros(B, T, H, V, dtype=dt, device=dev)
    finals = []
    for n, (row, s, e) in enumerate(row_spans(B, T, cu_seqlens)):
        st = None if initial_state is None else initial_state.select(n).to(dtype=dt).canonical()
        pos0 = 0 if st is None else int(st.pos.item())
        b0 = pos0 // L
        # dense keys: the state's window buffers (positions (b0 - 1) L + r), then this call's
        kk, vv, zz, pk, ok = [], [], [], [], []
        if st is not None:
            pb = (b0 - 1) * L + torch.arange(2 * L, device=dev)
            kk.append(st.k_hat[0])
            vv.append(st.v[0])
            zz.append(st.codes[0])
            pk.append(pb)
            ok.append((pb >= 0) & (pb < pos0))
        kk.append(k_hat[row, s:e].to(dt))
        vv.append(v[row, s:e].to(dt))
        zz.append(codes[row, s:e].long())
        pk.append(pos0 + torch.arange(e - s, device=dev))
        ok.append(torch.ones(e - s, dtype=torch.bool, device=dev))
        kk, vv, zz, pk, ok = (torch.cat(x) for x in (kk, vv, zz, pk, ok))  # [J, ...]

        if e > s:
            qq = q[row, s:e].to(dt)  # [Tq, H, K]
            pq = pos0 + torch.arange(e - s, device=dev)  # [Tq]
            scores = torch.einsum("ihk,jhk->hij", qq, kk)  # [H, Tq, J]
            if bias is not None:
                # column of key j for query i: j - (n_i - 1) L, inside the window if in [0, 2L)
                col = pk[None, :] - (pq[:, None] // L - 1) * L  # [Tq, J]
                inwin = (col >= 0) & (col < 2 * L)
                bb = bias[row, s:e].to(dt)  # [Tq, H, 2L]
                idx = col.clamp(0, 2 * L - 1)[:, None, :].expand(-1, H, -1)
                bj = bb.gather(-1, idx) * inwin[:, None, :]  # [Tq, H, J]
                scores = scores + bj.permute(1, 0, 2)
            visible = ok[None, :] & (pk[None, :] <= pq[:, None])  # [Tq, J]
            scores = scores.masked_fill(~visible, float("-inf"))
            if st is not None:
                # cached keys: count_s copies of codebook[s] (seed Remark 3.9)
                sc = torch.einsum("ihk,hsk->his", qq, cb) + log_count(st.cache_count[0])[:, None, :]
                p = torch.softmax(torch.cat([sc, scores], dim=-1), dim=-1)
                out = torch.einsum("his,hsv->ihv", p[..., :S], st.cache_mean[0])
                out = out + torch.einsum("hij,jhv->ihv", p[..., S:], vv)
            else:
                p = torch.softmax(scores, dim=-1)
                out = torch.einsum("hij,jhv->ihv", p, vv)
            o[row, s:e] = out

        if output_final_state:
            pos1 = pos0 + (e - s)
            cut = (pos1 // L - 1) * L  # keys before the final window go to the cache
            old = (ok & (pk < cut)).to(dt)
            delta = F.one_hot(zz, S).to(dt) * old[:, None, None]  # [J, H, S]
            cnt = delta.sum(0)  # [H, S]
            usum = torch.einsum("jhs,jhv->hsv", delta, vv)  # seed Eq. 26 (sum of values)
            if st is not None:
                cnt = cnt + st.cache_count[0]
                usum = usum + st.cache_count[0][..., None] * st.cache_mean[0]
            mean = usum / _nonzero(cnt)[..., None]
            # window buffers: slot r holds the key at position cut + r, if seen
            slot_pos = cut + torch.arange(2 * L, device=dev)
            match = ok[None, :] & (pk[None, :] == slot_pos[:, None])  # [2L, J]
            J = pk.shape[0]
            j = (match.long() * torch.arange(J, device=dev)).sum(1)  # at most one match
            j = torch.where(match.any(1), j, J)  # no key yet: index J, a zero row appended below
            pad = lambda x, j=j: torch.cat([x, x.new_zeros((1, *x.shape[1:]))])[j]
            finals.append(VQState(
                cache_mean=mean[None],
                cache_count=cnt[None],
                k_hat=pad(kk).to(k_hat.dtype)[None],
                v=pad(vv).to(v.dtype)[None],
                codes=pad(zz)[None],
                pos=torch.tensor([pos1], dtype=torch.long, device=dev),
            ))
    final = None
    if output_final_state:
        final = VQState(*(torch.cat([getattr(f, name) for f in finals]) for name in
                          ("cache_mean", "cache_count", "k_hat", "v", "codes", "pos")))
    return o.to(q.dtype), final
