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

from dataclasses import dataclass

import torch

from lintime.ops.utils import acc_dtype, num_seqs
from lintime.ops.vq.bias import rel_table, rel_window
from lintime.ops.vq.state import VQState, _nonzero, block_sums, log_count, merge


@dataclass
class _BlockLayout:
    """Where every key / query of a call (and of the initial state's buffers) sits.

    ``dest_tok`` ``[B * T]`` flat slot of each token in ``[R * NE * L]``; ``dest_buf`` ``[N * 2L]``
    flat slot of each state-buffer entry (``R * NE * L``, a scratch slot past the end, for the
    entries that hold no key), or ``None`` without a state; ``kvalid`` ``[R, NE, L]`` the slot holds
    a key; ``first`` ``[R, NE]`` the block is a sequence's pseudo-block; ``pseudo`` ``[N]`` flat
    index of that block; ``fin_cache`` ``[N]`` flat block whose inclusive cache is the final cache;
    ``fin_win`` ``[N, 2]`` flat blocks of the final window (``R * NE`` = an empty block); ``pos1``
    ``[N]`` final positions.  Query blocks (every block but the pseudo and previous blocks; the
    only ones that hold queries): ``qblk`` ``[NQ]`` their flat block index, ``dest_q`` ``[B * T]``
    flat slot of each token in ``[NQ * L]``.  Every tensor is on the call's device.
    """

    R: int
    NE: int
    L: int
    dest_tok: torch.Tensor
    dest_buf: torch.Tensor | None
    kvalid: torch.Tensor
    first: torch.Tensor
    pseudo: torch.Tensor
    fin_cache: torch.Tensor
    fin_win: torch.Tensor
    pos1: torch.Tensor
    NQ: int
    qblk: torch.Tensor
    dest_q: torch.Tensor

    def qplace(self, tok: torch.Tensor) -> torch.Tensor:
        """``tok`` ``[B * T, *rest]`` -> ``[NQ, L, *rest]`` over the query blocks, zero in empty slots."""
        rest = tok.shape[1:]
        return tok.new_zeros((self.NQ * self.L, *rest)).index_copy(0, self.dest_q, tok).view(self.NQ, self.L, *rest)

    def place(self, tok: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
        """``tok`` ``[B * T, *rest]`` (and ``buf`` ``[N * 2L, *rest]``) -> ``[R, NE, L, *rest]``,
        zero in empty slots."""
        rest = tok.shape[1:]
        out = tok.new_zeros((self.R * self.NE * self.L + 1, *rest)).index_copy(0, self.dest_tok, tok)
        if buf is not None and self.dest_buf is not None:
            out = out.index_copy(0, self.dest_buf, buf)  # dead entries all land in the scratch slot
        return out[:-1].view(self.R, self.NE, self.L, *rest)


def read_host(cu_seqlens: torch.Tensor | None, pos: torch.Tensor | None):
    """``(cu_seqlens, pos)`` as Python lists (``None`` where absent) in one device-to-host
    transfer (none when both are absent)."""
    parts = [x.reshape(-1).long() for x in (cu_seqlens, pos) if x is not None]
    if not parts:
        return None, None
    if len(parts) == 2 and parts[0].device != parts[1].device:
        parts[0] = parts[0].to(parts[1].device)
    vals = torch.cat(parts).tolist()
    cu = None if cu_seqlens is None else vals[: cu_seqlens.numel()]
    return cu, None if pos is None else vals[len(vals) - pos.numel():]


def num_blocks(B: int, T: int, L: int, cu_host: list[int] | None, pos_host: list[int] | None) -> int:
    """``NE``, blocks per row of the layout, from host integers (no device work): every sequence
    takes ``ceil((pos % L + len) / L) + 2`` blocks; packed sequences share row 0."""
    lens = [T] * B if cu_host is None else [b - a for a, b in zip(cu_host, cu_host[1:])]
    offs = [0] * len(lens) if pos_host is None else [p % L for p in pos_host]
    nblk = [-(-(o + n) // L) + 2 for o, n in zip(offs, lens)]
    if not nblk:
        return 1
    return max(nblk) if cu_host is None else sum(nblk)


def _layout(B, T, L, cu_seqlens, pos0: torch.Tensor | None, device, NE: int) -> _BlockLayout:
    """The block layout, built with tensor ops on ``device`` (no loop over sequences, no host
    transfer).  ``pos0`` ``[N]`` the initial positions (``None``: all zero, no state buffers);
    ``NE`` from :func:`num_blocks`."""
    lng = dict(dtype=torch.long, device=device)
    R = B if cu_seqlens is None else 1
    if cu_seqlens is None:
        N = B
        row = torch.arange(N, **lng)
        start = torch.zeros(N, **lng)
        ln = torch.full((N,), T, **lng)
    else:
        cu = cu_seqlens.to(**lng)
        N = cu.numel() - 1
        row = torch.zeros(N, **lng)
        start, ln = cu[:-1], cu[1:] - cu[:-1]
    o = torch.zeros(N, **lng) if pos0 is None else pos0 % L
    nblk = (o + ln + L - 1) // L + 2  # pseudo + previous + call blocks
    base = torch.zeros(N, **lng) if cu_seqlens is None else nblk.cumsum(0) - nblk
    blk0 = row * NE + base  # flat index of each sequence's pseudo-block
    # tokens: the sequence of every token, then its slot after the buffered part of its block
    f = torch.arange(B * T, **lng)
    if cu_seqlens is None:
        n, loc = f // T if T else f, f % T if T else f
    else:
        n = torch.searchsorted(cu[1:], f, right=True)  # number of sequence ends <= f
        loc = f - start[n]
    dest_tok = (blk0[n] + 2) * L + o[n] + loc
    kvalid = torch.zeros(R * NE * L + 1, dtype=torch.bool, device=device).index_fill_(0, dest_tok, True)
    dest_buf = None
    if pos0 is not None:
        # state buffers: slots [0, L) the previous block (live once pos >= L), slots [L, L + o)
        # the current block's first o keys; the rest go to the scratch slot R * NE * L
        r = torch.arange(2 * L, **lng)[None]
        live = torch.where(r < L, (pos0 >= L)[:, None], (r - L) < o[:, None])  # [N, 2L]
        slot = (blk0[:, None] + 1) * L + r  # prev block then the first call block, contiguous
        dest_buf = torch.where(live, slot, R * NE * L).reshape(-1)
        kvalid.index_fill_(0, dest_buf, True)
    kvalid = kvalid[:-1].view(R, NE, L)
    first = torch.zeros(R * NE, dtype=torch.bool, device=device).index_fill_(0, blk0, True).view(R, NE)
    q1 = (o + ln) // L  # the final cache covers blocks up to call block q1 - 2
    fin_cache = blk0 + q1
    fin_win = torch.stack([blk0 + q1 + 1, torch.where(q1 + 2 < nblk, blk0 + q1 + 2, R * NE)], 1)
    pos1 = ln if pos0 is None else pos0 + ln
    # query blocks: sequence n's blocks after its pseudo and previous blocks (row padding included)
    NQ = R * NE - 2 * N
    qcount = nblk - 2 if cu_seqlens is not None else torch.full((N,), NE - 2, **lng)
    i = torch.arange(NQ, **lng)
    qblk = i + 2 * (torch.searchsorted(qcount.cumsum(0), i, right=True) + 1)
    dest_q = dest_tok - 2 * L * (n + 1)
    return _BlockLayout(R, NE, L, dest_tok, dest_buf, kvalid, first, blk0, fin_cache, fin_win, pos1,
                        NQ, qblk, dest_q)


# ----------------------------------------------------------------------------------------------
# segmented inclusive reductions of per-block (count [R, NE, H, S], value sum [R, NE, H, S, V])
# into (count, mean); a block flagged ``first`` starts a new segment


def _reduce_serial(first, cnt, sumv):
    """Seed Code 2 in closed form: the serial scan's running (count, mean) after block ``e`` is
    ``(sum of counts, sum of value sums / sum of counts)`` over blocks ``start(e)..e`` of the
    segment, so both are segmented prefix sums, taken as one cumulative sum per row minus its
    value before the segment start.  The sums run in fp64 (the difference of two prefixes loses
    nothing that fp32 results could see), the mean is formed in the input dtype.  O(NE) memory
    and depth O(1) in Python; the same result as the step-by-step scan (:func:`_reduce_scan`)."""
    R, NE = first.shape
    idx = torch.arange(NE, device=first.device)
    seg0 = torch.where(first, idx, 0).cummax(1).values  # [R, NE] first block of each segment
    flat0 = (seg0 + NE * torch.arange(R, device=first.device)[:, None]).reshape(-1)

    def seg_cumsum(x):
        c = x.to(torch.float64).cumsum(1)
        excl = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], 1)  # sum of the blocks before
        return c - excl.reshape(R * NE, *x.shape[2:]).index_select(0, flat0).view(c.shape)

    tot = seg_cumsum(cnt).to(cnt.dtype)
    return tot, seg_cumsum(sumv).to(sumv.dtype) / _nonzero(tot)[..., None]


def _reduce_scan(first, cnt, sumv):
    """Seed Code 2 as written: a loop over blocks carrying (count, running mean), reset at
    sequence starts.  O(NE) Python steps; the reference the tests check the closed form with."""
    mean = sumv / _nonzero(cnt)[..., None]
    c, m = torch.zeros_like(cnt[:, 0]), torch.zeros_like(mean[:, 0])
    cs, ms = [], []
    for f, ce, me in zip(first.unbind(1), cnt.unbind(1), mean.unbind(1)):
        c, m = merge(c.masked_fill(f[:, None, None], 0), m.masked_fill(f[:, None, None, None], 0), ce, me)
        cs.append(c)
        ms.append(m)
    return torch.stack(cs, 1), torch.stack(ms, 1)


def _reduce_matmul(first, cnt, sumv):
    """Seed Code 3: every block's cache as a lower-triangular (same-sequence) matrix of count
    fractions times the block means.  O(NE^2 * S) memory, as in the seed."""
    mean = sumv / _nonzero(cnt)[..., None]
    NE = cnt.shape[1]
    seg = first.long().cumsum(1)  # [R, NE] sequence id within the row
    tri = torch.ones(NE, NE, dtype=torch.bool, device=cnt.device).tril()
    w = (seg[:, :, None] == seg[:, None, :]) & tri  # [R, E, G]
    wc = w[..., None, None].to(cnt.dtype) * cnt[:, None]  # [R, E, G, H, S]
    tot = wc.sum(2)  # [R, E, H, S]
    frac = wc / _nonzero(tot)[:, :, None]
    return tot, torch.einsum("reghs,rghsv->rehsv", frac, mean)


def _reduce_assoc(first, cnt, sumv):
    """Seed Code 4: an associative (Hillis-Steele, log2(NE) steps) segmented scan with the
    count-weighted mean merge; a flag marks a segment start, which the merge does not cross."""
    f, c, m = first, cnt, sumv / _nonzero(cnt)[..., None]
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



def call_layout(B: int, T: int, L: int, cu_seqlens, initial_state, host_values, dev):
    """``(state, N, layout, host_values)`` of one call: the canonical initial state (or ``None``), the number of
    sequences, the :class:`_BlockLayout` and ``(cu_seqlens, pos)`` on the host (read here, in one transfer, when
    the caller has not)."""
    st = None if initial_state is None else initial_state.canonical()
    N = num_seqs(B, cu_seqlens)
    if host_values is None:
        host_values = read_host(cu_seqlens, None if st is None else st.pos)
    NE = num_blocks(B, T, L, *host_values)
    lay = _layout(B, T, L, cu_seqlens, None if st is None else st.pos.to(dev), dev, NE)
    return st, N, lay, host_values


def chunk_vq_attention(
    q, k_hat, codes, v, codebook, *, block_len, bias=None, reduction="serial",
    initial_state=None, output_final_state=False, cu_seqlens=None, host_values=None, rel_bias=None,
):
    """The blockwise form (see the module docstring).  ``host_values``: ``(cu_seqlens, pos)`` as
    Python lists (either ``None`` where absent), when the caller already has them on the host
    (:func:`lintime.ops.vq.vq_attention` reads them in its one device-to-host transfer); without
    them the block count costs one transfer here when ``cu_seqlens`` or a state is given, and
    none otherwise.  ``rel_bias`` ``(qv, r)``: the window bias as a relative table (see
    :func:`lintime.ops.vq_attention`), shifted into the query blocks by :func:`~lintime.ops.vq.bias.rel_window`."""
    B, T, H = q.shape[:3]
    V = v.shape[-1]
    S = codebook.shape[1]
    L = block_len
    dt = acc_dtype(q)
    dev = q.device
    st, N, lay, host_values = call_layout(B, T, L, cu_seqlens, initial_state, host_values, dev)
    R, NE = lay.R, lay.NE
    flat = lambda x: x.reshape(B * T, *x.shape[2:])
    bufs = lambda x: None if st is None else x.reshape(N * 2 * L, *x.shape[2:])

    kc = lay.place(flat(k_hat).to(dt), bufs(st.k_hat.to(dt)) if st is not None else None)  # [R, NE, L, H, K]
    vc = lay.place(flat(v).to(dt), bufs(st.v.to(dt)) if st is not None else None)  # [R, NE, L, H, V]
    zc = lay.place(flat(codes).long(), bufs(st.codes.long()) if st is not None else None)  # [R, NE, L, H]
    qc = lay.qplace(flat(q).to(dt))  # [NQ, L, H, K], only the blocks that hold queries
    prev, cur, back2 = lay.qblk - 1, lay.qblk, lay.qblk - 2
    blocks = lambda x, idx: x.reshape(R * NE, *x.shape[2:]).index_select(0, idx)  # [NQ, ...]

    # window: previous + current block (seed Eq. 29-30, Code 1 scores_prev / scores_present)
    kw = torch.cat([blocks(kc, prev), blocks(kc, cur)], 1)  # [NQ, 2L, H, K]
    vw = torch.cat([blocks(vc, prev), blocks(vc, cur)], 1)  # [NQ, 2L, H, V]
    okw = torch.cat([blocks(lay.kvalid, prev), blocks(lay.kvalid, cur)], 1)  # [NQ, 2L]
    s_win = torch.einsum("nihk,njhk->nhij", qc, kw)  # [NQ, H, L, 2L]
    if bias is not None:
        s_win = s_win + lay.qplace(flat(bias).to(dt)).permute(0, 2, 1, 3)
    elif rel_bias is not None:  # row a of a query block is offset a: the table shifted row by row
        s_win = s_win + rel_window(lay.qplace(flat(rel_table(*rel_bias)))).to(dt).permute(0, 2, 1, 3)
    causal = torch.ones(L, 2 * L, dtype=torch.bool, device=dev).tril(L)  # key slot j <= L + i
    visible = causal & okw[:, None, None, :]  # [NQ, 1, L, 2L]
    s_win = s_win.masked_fill(~visible, float("-inf"))

    # cache: per-block summaries, initial cache in each pseudo-block, reduction, blocks <= e - 2
    cum_c, cum_m = cache_summaries(lay, zc, vc, st, S, reduction)  # [R, NE, H, S], [R, NE, H, S, V]
    cache_c = blocks(cum_c, back2)  # [NQ, H, S] (seed Code 2: pad 2, drop last 2)
    cache_m = blocks(cum_m, back2)  # [NQ, H, S, V]
    s_cache = torch.einsum("nihk,hsk->nhis", qc, codebook.to(dt))  # [NQ, H, L, S]
    s_cache = s_cache + log_count(cache_c)[:, :, None, :]

    # joint log-sum-exp over window and cache (seed Code 1)
    mx = torch.maximum(s_win.amax(-1), s_cache.amax(-1)).detach()  # [NQ, H, L]
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))  # rows with no key (padding)
    p_win = torch.exp(s_win - mx[..., None])
    p_cache = torch.exp(s_cache - mx[..., None])
    den = p_win.sum(-1) + p_cache.sum(-1)  # [NQ, H, L]
    num = torch.einsum("nhij,njhv->nihv", p_win, vw)
    num = num + torch.einsum("nhis,nhsv->nihv", p_cache, cache_m)
    o = num / _nonzero(den).transpose(1, 2)[..., None]  # [NQ, L, H, V]
    o = o.reshape(lay.NQ * L, H, V).index_select(0, lay.dest_q).view(B, T, H, V).to(q.dtype)

    final = None
    if output_final_state:
        final = final_state(lay, N, kc, vc, zc, cum_c, cum_m, k_hat.dtype, v.dtype)
    return o, final


def cache_summaries(lay: _BlockLayout, zc, vc, st: VQState | None, S: int, reduction: str, sums=block_sums,
                    reduce=None):
    """Inclusive per-block cache summaries of every sequence, ``(count [R, NE, H, S], mean
    [R, NE, H, S, V])`` in the dtype of ``sums``' results (``vc``'s for the one-hot sums): the
    per-code count and value sum of each block (seed Code 2 ``delta1_by_block`` /
    ``deltav_by_block``; ``sums`` computes them, with :func:`~lintime.ops.vq.state.block_sums`'
    signature), the initial cache in each pseudo-block, then the segmented ``reduction``
    (``reduce``, when given, replaces it: same signature and result as :data:`REDUCTIONS`'
    entries).  ``zc`` ``[R, NE, L, H]`` codes and ``vc`` ``[R, NE, L, H, V]`` values as placed by
    :meth:`_BlockLayout.place`; ``st`` the canonical initial state or ``None``."""
    R, NE = lay.R, lay.NE
    cnt, sumv = sums(zc, vc, lay.kvalid, S)  # [R, NE, H, S], [R, NE, H, S, V]
    dt = sumv.dtype
    H, V = sumv.shape[2], sumv.shape[-1]
    if st is not None:
        c0 = st.cache_count.to(dt)
        cnt = cnt.view(R * NE, H, S).index_copy(0, lay.pseudo, c0).view(R, NE, H, S)
        sumv = sumv.view(R * NE, H, S, V).index_copy(0, lay.pseudo, c0[..., None] * st.cache_mean.to(dt))
        sumv = sumv.view(R, NE, H, S, V)
    return (reduce or REDUCTIONS[reduction])(lay.first, cnt, sumv)  # inclusive, per sequence


def final_state(lay: _BlockLayout, N: int, kc, vc, zc, cum_c, cum_m, k_dtype, v_dtype) -> VQState:
    """The canonical state after the call: the final block's inclusive cache and the last two
    blocks as the window (``kc``, ``vc``, ``zc`` placed ``[R, NE, L, ...]``; ``cum_*`` from
    :func:`cache_summaries`)."""
    R, NE, L = lay.R, lay.NE, lay.L
    H, S, V = cum_m.shape[2:]

    def window(x):  # [R, NE, L, *rest] -> final [N, 2L, *rest]
        xb = x.reshape(R * NE, *x.shape[2:])
        xb = torch.cat([xb, torch.zeros_like(xb[:1])])  # block R * NE is empty
        return xb.index_select(0, lay.fin_win.view(-1)).view(N, 2 * L, *x.shape[3:])

    return VQState(
        cache_mean=cum_m.reshape(R * NE, H, S, V).index_select(0, lay.fin_cache),
        cache_count=cum_c.reshape(R * NE, H, S).index_select(0, lay.fin_cache),
        k_hat=window(kc).to(k_dtype),
        v=window(vc).to(v_dtype),
        codes=window(zc),
        pos=lay.pos1,
    )
