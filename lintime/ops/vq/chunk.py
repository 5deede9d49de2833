"""Blockwise Transformer-VQ attention in PyTorch (seed Theorem 3.7 with Remark 3.9, Appendix E
Code 1): O(T * (2L + S)) time and memory, never a T x T tensor.

Notation: ``L`` block length, ``S`` codes, ``R`` rows of the block layout, ``NE`` blocks per row,
``N`` sequences.  Each sequence occupies consecutive blocks of one row, aligned to its *global*
block boundaries (positions continue from ``initial_state.pos``):

* block 0 of a sequence is a pseudo-block that holds no keys; its summary is the initial cache;
* block 1 is the block before the first call block (the state's previous-block buffer);
* block 2 onwards are the call's blocks; the first one starts with the state's ``pos % L``
  buffered keys of the current block, then this call's tokens.

A query in block ``e`` attends to (a) the window, blocks ``e - 1`` and ``e`` (``[L, 2L]`` scores
with the bias and the causal mask, seed Eq. 29-30), and (b) the cache, the per-code summaries of
blocks ``<= e - 2`` (``q . codebook^T + log(count)``, seed Eq. 28 / Remark 3.9), combined in one
stable log-sum-exp (seed Code 1).  The cache of every block comes from a segmented inclusive
reduction of the per-block summaries, ``reduction`` in ``serial`` (Code 2), ``matmul`` (Code 3),
``assoc`` (Code 4).

Gradients: the window uses ``k_hat`` and the cache uses ``codebook``, so ``d k_hat`` covers only
the keys a query saw inside its window; older keys send their gradient to ``codebook``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lintime.ops.utils import acc_dtype, seq_bounds
from lintime.ops.vq.state import VQState, _nonzero, block_summary, log_count, merge


@dataclass
class _BlockLayout:
    """Where every key / query of a call (and of the initial state's buffers) sits.

    ``dest_tok`` ``[B * T]`` flat slot of each token in ``[R * NE * L]``;
    ``dest_buf`` / ``src_buf`` slot of each live state-buffer entry and its flat index in
    ``[N * 2L]``; ``kvalid`` ``[R, NE, L]`` the slot holds a key; ``first`` ``[R, NE]`` the block
    is a sequence's pseudo-block; ``pseudo`` ``[N]`` flat index of that block; ``fin_cache``
    ``[N]`` flat block whose inclusive cache is the final cache; ``fin_win`` ``[N, 2]`` flat
    blocks of the final window (``R * NE`` = an empty block); ``pos1`` ``[N]`` final positions.
    """

    R: int
    NE: int
    L: int
    dest_tok: torch.Tensor
    dest_buf: torch.Tensor
    src_buf: torch.Tensor
    kvalid: torch.Tensor
    first: torch.Tensor
    pseudo: torch.Tensor
    fin_cache: torch.Tensor
    fin_win: torch.Tensor
    pos1: torch.Tensor

    def place(self, tok: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
        """``tok`` ``[B * T, *rest]`` (and ``buf`` ``[N * 2L, *rest]``) -> ``[R, NE, L, *rest]``,
        zero in empty slots."""
        rest = tok.shape[1:]
        out = tok.new_zeros((self.R * self.NE * self.L, *rest)).index_copy(0, self.dest_tok, tok)
        if buf is not None and self.src_buf.numel():
            out = out.index_copy(0, self.dest_buf, buf.index_select(0, self.src_buf))
        return out.view(self.R, self.NE, self.L, *rest)


def _layout(B, T, L, cu_seqlens, pos0: list[int], device) -> _BlockLayout:
    seqs = seq_bounds(B, T, cu_seqlens)
    R = B if cu_seqlens is None else 1
    used = [0] * R
    plan = []
    for n, (row, s, e) in enumerate(seqs):
        o, ln = pos0[n] % L, e - s
        nblk = math.ceil((o + ln) / L) + 2  # pseudo + previous + call blocks
        plan.append((row, s, e, used[row], nblk))
        used[row] += nblk
    NE = max(used)
    dest_tok, dest_buf, src_buf = [], [], []
    kvalid = torch.zeros(R, NE, L, dtype=torch.bool)
    first = torch.zeros(R, NE, dtype=torch.bool)
    pseudo, fin_cache, fin_win, pos1 = [], [], [], []
    for n, (row, s, e, base, nblk) in enumerate(plan):
        b0, o, ln = pos0[n] // L, pos0[n] % L, e - s
        blk0 = row * NE + base  # flat index of the pseudo-block
        first[row, base] = True
        if b0 >= 1:  # the previous block exists
            dest_buf.append((blk0 + 1) * L + torch.arange(L))
            src_buf.append(n * 2 * L + torch.arange(L))
            kvalid[row, base + 1] = True
        dest_buf.append((blk0 + 2) * L + torch.arange(o))
        src_buf.append(n * 2 * L + L + torch.arange(o))
        dest_tok.append((blk0 + 2) * L + o + torch.arange(ln))
        kv = kvalid[row].view(-1)
        kv[(base + 2) * L : (base + 2) * L + o + ln] = True
        pseudo.append(blk0)
        q1 = (o + ln) // L  # the final cache covers blocks up to call block q1 - 2
        fin_cache.append(blk0 + q1)
        fin_win.append([blk0 + q1 + 1, blk0 + q1 + 2 if q1 + 2 < nblk else R * NE])
        pos1.append(pos0[n] + ln)
    cat = lambda xs: torch.cat(xs).to(device) if xs else torch.zeros(0, dtype=torch.long, device=device)
    tens = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    return _BlockLayout(
        R, NE, L, cat(dest_tok), cat(dest_buf), cat(src_buf), kvalid.to(device), first.to(device),
        tens(pseudo), tens(fin_cache), tens(fin_win).view(-1, 2), tens(pos1),
    )


# ----------------------------------------------------------------------------------------------
# segmented inclusive reductions of per-block (count [R, NE, H, S], mean [R, NE, H, S, V])


def _reduce_serial(first, cnt, mean):
    """Seed Code 2: a scan over blocks carrying (count, running mean), reset at sequence starts."""
    c, m = torch.zeros_like(cnt[:, 0]), torch.zeros_like(mean[:, 0])
    cs, ms = [], []
    for e in range(cnt.shape[1]):
        f = first[:, e, None, None]
        c, m = merge(c.masked_fill(f, 0), m.masked_fill(f[..., None], 0), cnt[:, e], mean[:, e])
        cs.append(c)
        ms.append(m)
    return torch.stack(cs, 1), torch.stack(ms, 1)


def _reduce_matmul(first, cnt, mean):
    """Seed Code 3: every block's cache as a lower-triangular (same-sequence) matrix of count
    fractions times the block means.  O(NE^2 * S) memory, as in the seed."""
    NE = cnt.shape[1]
    seg = first.long().cumsum(1)  # [R, NE] sequence id within the row
    tri = torch.ones(NE, NE, dtype=torch.bool, device=cnt.device).tril()
    w = (seg[:, :, None] == seg[:, None, :]) & tri  # [R, E, G]
    wc = w[..., None, None].to(cnt.dtype) * cnt[:, None]  # [R, E, G, H, S]
    tot = wc.sum(2)  # [R, E, H, S]
    frac = wc / _nonzero(tot)[:, :, None]
    return tot, torch.einsum("reghs,rghsv->rehsv", frac, mean)


def _reduce_assoc(first, cnt, mean):
    """Seed Code 4: an associative (Hillis-Steele, log2(NE) steps) segmented scan with the
    count-weighted mean merge; a flag marks a segment start, which the merge does not cross."""
    f, c, m = first, cnt, mean
    d = 1
    while d < c.shape[1]:
        # left operand x[e - d]; positions e < d merge with the identity (no flag, count 0)
        fl = torch.nn.functional.pad(f[:, :-d], (d, 0), value=False)
        cl = torch.cat([torch.zeros_like(c[:, :d]), c[:, :-d]], 1)
        ml = torch.cat([torch.zeros_like(m[:, :d]), m[:, :-d]], 1)
        cn, mn = merge(cl, ml, c, m)
        keep = f[:, :, None, None]
        c = torch.where(keep, c, cn)
        m = torch.where(keep[..., None], m, mn)
        f = f | fl
        d *= 2
    return c, m


REDUCTIONS = {"serial": _reduce_serial, "matmul": _reduce_matmul, "assoc": _reduce_assoc}


def chunk_vq_attention(
    q, k_hat, codes, v, codebook, *, block_len, bias=None, reduction="serial",
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    B, T, H = q.shape[:3]
    V = v.shape[-1]
    S = codebook.shape[1]
    L = block_len
    dt = acc_dtype(q)
    dev = q.device
    st = None if initial_state is None else initial_state.canonical()
    N = len(seq_bounds(B, T, cu_seqlens))
    pos0 = [0] * N if st is None else st.pos.tolist()
    lay = _layout(B, T, L, cu_seqlens, pos0, dev)
    R, NE = lay.R, lay.NE
    flat = lambda x: x.reshape(B * T, *x.shape[2:])
    bufs = lambda x: None if st is None else x.reshape(N * 2 * L, *x.shape[2:])

    qc = lay.place(flat(q).to(dt))  # [R, NE, L, H, K]
    kc = lay.place(flat(k_hat).to(dt), bufs(st.k_hat.to(dt)) if st is not None else None)
    vc = lay.place(flat(v).to(dt), bufs(st.v.to(dt)) if st is not None else None)  # [R, NE, L, H, V]
    zc = lay.place(flat(codes).long(), bufs(st.codes.long()) if st is not None else None)  # [R, NE, L, H]
    shift = lambda x: torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)

    # window: previous + current block (seed Eq. 29-30, Code 1 scores_prev / scores_present)
    kw = torch.cat([shift(kc), kc], 2)  # [R, NE, 2L, H, K]
    vw = torch.cat([shift(vc), vc], 2)  # [R, NE, 2L, H, V]
    okw = torch.cat([shift(lay.kvalid), lay.kvalid], 2)  # [R, NE, 2L]
    s_win = torch.einsum("rnihk,rnjhk->rnhij", qc, kw)  # [R, NE, H, L, 2L]
    if bias is not None:
        s_win = s_win + lay.place(flat(bias).to(dt)).permute(0, 1, 3, 2, 4)
    causal = torch.ones(L, 2 * L, dtype=torch.bool, device=dev).tril(L)  # key slot j <= L + i
    visible = causal & okw[:, :, None, None, :]  # [R, NE, 1, L, 2L]
    s_win = s_win.masked_fill(~visible, float("-inf"))

    # cache: per-block summaries, initial cache in each pseudo-block, reduction, shift by two
    cnt, mean = block_summary(zc, vc, lay.kvalid, S)  # [R, NE, H, S], [R, NE, H, S, V]
    if st is not None:
        cnt = cnt.view(R * NE, H, S).index_copy(0, lay.pseudo, st.cache_count.to(dt)).view(R, NE, H, S)
        mean = mean.view(R * NE, H, S, V).index_copy(0, lay.pseudo, st.cache_mean.to(dt)).view(mean.shape)
    cum_c, cum_m = REDUCTIONS[reduction](lay.first, cnt, mean)  # inclusive, per sequence
    cache_c = shift(shift(cum_c))  # blocks <= e - 2 (seed Code 2: pad 2, drop last 2)
    cache_m = shift(shift(cum_m))
    s_cache = torch.einsum("rnihk,hsk->rnhis", qc, codebook.to(dt))  # [R, NE, H, L, S]
    s_cache = s_cache + log_count(cache_c)[:, :, :, None, :]

    # joint log-sum-exp over window and cache (seed Code 1)
    mx = torch.maximum(s_win.amax(-1), s_cache.amax(-1)).detach()  # [R, NE, H, L]
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # rows with no key (padding)
    p_win = torch.exp(s_win - mx[..., None])
    p_cache = torch.exp(s_cache - mx[..., None])
    den = p_win.sum(-1) + p_cache.sum(-1)  # [R, NE, H, L]
    num = torch.einsum("rnhij,rnjhv->rnihv", p_win, vw)
    num = num + torch.einsum("rnhis,rnhsv->rnihv", p_cache, cache_m)
    o = num / _nonzero(den).permute(0, 1, 3, 2)[..., None]  # [R, NE, L, H, V]
    o = o.reshape(R * NE * L, H, V).index_select(0, lay.dest_tok).view(B, T, H, V).to(q.dtype)

    final = None
    if output_final_state:
        def window(x):  # [R, NE, L, *rest] -> final [N, 2L, *rest]
            xb = x.reshape(R * NE, *x.shape[2:])
            xb = torch.cat([xb, torch.zeros_like(xb[:1])])  # block R * NE is empty
            return xb.index_select(0, lay.fin_win.view(-1)).view(N, 2 * L, *x.shape[3:])

        final = VQState(
            cache_mean=cum_m.reshape(R * NE, H, S, V).index_select(0, lay.fin_cache),
            cache_count=cum_c.reshape(R * NE, H, S).index_select(0, lay.fin_cache),
            k_hat=window(kc).to(k_hat.dtype),
            v=window(vc).to(v.dtype),
            codes=window(zc),
            pos=lay.pos1,
        )
    return o, final
