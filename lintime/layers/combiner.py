"""Combiner attention, row-major axial variant (Ren et al. 2021), the FLASH seed's chunked
softmax baseline (Section 4 "Combiner-Axial", Appendix A, Tables 8-10: 12 / 16 heads, softmax,
"Rowmajor-Axial", chunk size 256 / 512, MLP + GELU, RoPE).

Notation: ``B`` batch, ``T`` new tokens, ``d`` model width, ``H`` heads, ``D`` head width,
``C`` row length (the tables' "chunk size"), ``N`` sequences, ``R`` rows.

Each sequence is laid out row-major in rows of ``C`` tokens (its own rows: packed sequences
never share one); token ``i`` sits in row ``r = i // C``, column ``c = i % C``.  Seed Appendix A:
``V_hat_g = Softmax(Q [K_g; K_sum]) [V_g; V_sum]`` -- one softmax over the local keys of the
query's own row and one summary per previous row::

    local    j in row r, j <= i (causal)         score q_i . k_j / sqrt(D),   value v_j
    summary  every previous row u < r            score q_i . K_sum[u, c] / sqrt(D),  value V_sum[u, c]

    V_sum[u, c] = sum_{j in row u} softmax_j(q_(u,c) . k_j / sqrt(D)) v_j     (row u's attention
                  output at column c: a complete row, so it is all in the past)
    K_sum[u, c] = rope(W_2 LN(x_(u,c) + W_1 V_sum[u, c]), position u*C + c)      (``'proj'``)

Each query thus sees ``C`` local keys and ``r`` summaries (``O(C + T/C)``), and every earlier
token through exactly one summary: the full-attention factorisation of Combiner-Axial (the
summary of row ``u`` a query meets is the one "at its column", the axial hop).  This follows the
reference implementation's ``axial_rowmajor`` (google-research ``combiner``, ``row_summary='proj'``
as in its LM config): its two summary projections ``W_1, W_2`` (``d x d`` each, with biases, and a
LayerNorm) are the ``2 d^2`` per layer by which Combiner exceeds Transformer+ in the seed's
tables (124M vs 110M, 562M vs 486M).  Other summary keys: ``'wsum'`` (``sum_j p_j k_j``, the
attention-weighted key, no parameters) and ``'none'`` (``k_(u,c)`` itself).

RoPE (the seed's augmentation) rotates q and k by their positions; the ``'proj'`` summary key is
rotated by its cell's position ``u*C + c`` (so query-summary scores see the distance ``(r-u)*C``).
Non-causal (masked LM): local keys are the whole row and the summaries are every row of the
sequence (the reference's unmasked form).

Decoding state (:class:`CombinerState`), per layer and sequence: the summaries of every complete
row, ``2 * T * H * D`` numbers (a KV cache's size: the math needs every past row's summary at every
column), plus the incomplete current row's ``q, k, v, x`` (at most ``C`` tokens).  Calls with a
state prepend that row to the new tokens, so rows are always aligned to the sequence start.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from lintime.layers.base import BatchState, Mixer
from lintime.layers.norms import LayerNorm
from lintime.layers.positional import apply_rope

ROW_SUMMARIES = ("proj", "wsum", "none")


@dataclasses.dataclass
class CombinerState(BatchState):
    """Decoding state of :class:`CombinerAttention` (model dtype).

    ``sum_k``    ``[N, S, C, H, D]`` summary keys of complete rows: ``sum_k[n, u, c]`` is
                 ``K_sum[u, c]`` of sequence ``n`` for ``u < rows[n]``, zeros beyond;
    ``sum_v``    ``[N, S, C, H, D]`` summary values, same layout (capacity ``S`` grows by doubling);
    ``rows``     ``[N]`` int64 complete rows per sequence;
    ``buf_q``, ``buf_k``, ``buf_v``  ``[N, C, H, D]`` q (after RoPE), k (after RoPE), v of the
                 current incomplete row, slot ``c`` for ``c < buf_len[n]``, zeros beyond;
    ``buf_x``    ``[N, C, d]`` the layer input of those tokens (the ``'proj'`` summary's residual);
    ``buf_len``  ``[N]`` int64 tokens in the current row (``< C``).
    ``static``   ``True`` for the form made by :meth:`with_capacity`: ``S`` rows fixed, one-token
                 calls run a fixed-shape step that writes a completed row's summaries in place.
    """

    sum_k: torch.Tensor
    sum_v: torch.Tensor
    rows: torch.Tensor
    buf_q: torch.Tensor
    buf_k: torch.Tensor
    buf_v: torch.Tensor
    buf_x: torch.Tensor
    buf_len: torch.Tensor
    static: bool = False

    def with_capacity(self, capacity: int) -> "CombinerState":
        """The static form for sequences of up to ``capacity`` tokens: room for every row they
        can complete (``capacity // C``, at least one), fresh buffers."""
        N, S, C = self.sum_k.shape[:3]
        rows = max(capacity // C, 1)
        keep = min(S, rows)

        def summaries(x):
            out = x.new_zeros(N, rows, *x.shape[2:])
            out[:, :keep] = x[:, :keep]
            return out

        return dataclasses.replace(
            self, sum_k=summaries(self.sum_k), sum_v=summaries(self.sum_v), rows=self.rows.clone(),
            buf_q=self.buf_q.clone(), buf_k=self.buf_k.clone(), buf_v=self.buf_v.clone(), buf_x=self.buf_x.clone(),
            buf_len=self.buf_len.clone(), static=True,
        )


def _token_coords(B: int, T: int, cu_seqlens, device):
    """Sequence index ``[B*T]`` and index inside this call's piece ``[B*T]`` of every token, and
    the piece lengths (python ints, one per sequence)."""
    if cu_seqlens is None:
        return (torch.arange(B, device=device).repeat_interleave(T), torch.arange(T, device=device).repeat(B),
                [T] * B)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    tok = torch.arange(T, device=device)
    seq = torch.searchsorted(cu, tok, right=True) - 1
    return seq, tok - cu.index_select(0, seq), cu.diff().tolist()


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class CombinerAttention(Mixer):
    """Multi-head Combiner-Axial (row-major) attention; see the module docstring."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        chunk_size: int = 256,
        row_summary: str = "proj",
        rope: bool = True,
        rope_base: float = 10000.0,
        causal: bool = True,
        bias: bool = True,
        norm_eps: float = 1e-5,
    ):
        super().__init__()
        if head_dim is None:
            if dim % n_heads:
                raise ValueError(f"CombinerAttention: dim {dim} is not divisible by n_heads {n_heads}")
            head_dim = dim // n_heads
        if row_summary not in ROW_SUMMARIES:
            raise ValueError(f"CombinerAttention: row_summary must be one of {ROW_SUMMARIES}, got {row_summary!r}")
        if chunk_size < 1:
            raise ValueError(f"CombinerAttention: chunk_size must be >= 1, got {chunk_size}")
        self.dim, self.n_heads, self.head_dim, self.chunk_size = dim, n_heads, head_dim, chunk_size
        self.row_summary, self.rope, self.rope_base, self.causal = row_summary, rope, rope_base, causal
        HD = n_heads * head_dim
        self.qkv = nn.Linear(dim, 3 * HD, bias=bias)
        self.out = nn.Linear(HD, dim, bias=bias)
        if row_summary == "proj":
            self.summary_in = nn.Linear(HD, dim, bias=bias)  # W_1
            self.summary_norm = LayerNorm(dim, norm_eps)
            self.summary_out = nn.Linear(dim, HD, bias=bias)  # W_2

    # ------------------------------------------------------------------ pieces
    def _row_summaries(self, q, k, v, x, valid, first_row):
        """Summaries of the rows ``[N, R, C, ...]`` (``first_row [N]``: absolute index of row 0).
        Returns ``K_sum, V_sum`` ``[N, R, C, H, D]`` (rows with invalid slots are garbage-free
        but meaningless; the caller masks them)."""
        N, R, C, H, D = q.shape
        acc = _acc(q.dtype)
        scores = torch.einsum("nrihd,nrjhd->nrhij", q.to(acc), k.to(acc)) * D**-0.5
        eye = torch.eye(C, dtype=torch.bool, device=q.device)
        keep = valid[:, :, None, None, :] | eye  # a padded slot sees itself: no empty softmax
        p = scores.masked_fill(~keep, float("-inf")).softmax(-1).to(q.dtype)
        v_sum = torch.einsum("nrhij,nrjhd->nrihd", p, v)  # row attention output at every column
        if self.row_summary == "none":
            return k, v_sum
        if self.row_summary == "wsum":
            return torch.einsum("nrhij,nrjhd->nrihd", p, k), v_sum
        h = x + self.summary_in(v_sum.reshape(N, R, C, H * D))  # residual on the layer input
        k_sum = self.summary_out(self.summary_norm(h)).view(N, R, C, H, D)
        if self.rope:
            pos = (first_row[:, None, None] + torch.arange(R, device=q.device)[:, None]) * C \
                + torch.arange(C, device=q.device)  # [N, R, C] cell positions
            k_sum = apply_rope(k_sum, pos, self.rope_base)
        return k_sum, v_sum

    # ------------------------------------------------------------------ forward
    def forward(self, x, state: CombinerState | None = None, *, positions, cu_seqlens=None, aux_losses=None):
        B, T, d = x.shape
        H, D, C = self.n_heads, self.head_dim, self.chunk_size
        dev = x.device
        q, k, v = self.qkv(x).view(B, T, 3, H, D).unbind(2)  # [B, T, H, D] each
        if self.rope:
            q = apply_rope(q, positions, self.rope_base)
            k = apply_rope(k, positions, self.rope_base)
        if state is not None and state.static:
            if T != 1 or cu_seqlens is not None:
                raise ValueError("CombinerAttention: a static state takes one token per sequence and call")
            return self._static_step(x, q, k, v, state)
        seq, t, counts = _token_coords(B, T, cu_seqlens, dev)
        N = len(counts)
        if state is not None:
            if not self.causal:
                raise ValueError("CombinerAttention: a decoding state needs causal attention")
            if state.batch_size != N:
                raise ValueError(f"CombinerAttention: the state holds {state.batch_size} sequences, the input {N}")
            r0, b = state.rows, state.buf_len
            r0_list, b_list = torch.stack([r0, b]).tolist()  # host sizes (one sync per call)
        else:
            r0 = b = torch.zeros(N, dtype=torch.long, device=dev)
            r0_list, b_list = [0] * N, [0] * N

        # ---- the segment of each sequence: its incomplete row (from the state) + the new tokens,
        # starting on a row boundary, laid out [N, R, C]
        L_list = [bb + cc for bb, cc in zip(b_list, counts)]
        R = max(1, math.ceil(max(L_list, default=0) / C))
        slot = b.index_select(0, seq) + t  # [B*T] segment slot of every new token

        def segment(new, buf, width):
            z = new.new_zeros(N, R * C, *width)
            if buf is not None:
                z = torch.cat([buf.to(new.dtype), z[:, C:]], 1)  # zeros beyond buf_len
            return z.index_put((seq, slot), new.reshape(B * T, *width)).view(N, R, C, *width)

        bq, bk, bv, bx = (None,) * 4 if state is None else (state.buf_q, state.buf_k, state.buf_v, state.buf_x)
        Q, K, Vv = segment(q, bq, (H, D)), segment(k, bk, (H, D)), segment(v, bv, (H, D))
        X = segment(x, bx, (d,))
        # the same values on the device, computed there (no host->device copy)
        counts_t = T if cu_seqlens is None else cu_seqlens.to(device=dev, dtype=torch.long).diff()
        L = b + counts_t
        valid = (torch.arange(R * C, device=dev) < L[:, None]).view(N, R, C)

        # ---- summaries of this segment's rows: causal calls need the complete ones only
        m_list = [Ln // C for Ln in L_list] if self.causal else [math.ceil(Ln / C) for Ln in L_list]
        M = max(m_list, default=0)
        if M:
            ks_new, vs_new = self._row_summaries(Q[:, :M], K[:, :M], Vv[:, :M], X[:, :M], valid[:, :M], r0)
        else:
            ks_new = vs_new = Q.new_zeros(N, 0, C, H, D)
        m = L // C if self.causal else (L + C - 1) // C  # = m_list on the device
        rows_new = torch.arange(M, device=dev)
        # a summary cell exists when its row is summarised and the cell is a token (non-causal
        # calls summarise a partial last row too: its missing columns have no summary)
        g_ok = valid[:, :M] & (rows_new < m[:, None])[..., None]  # [N, U, C]
        g_row = r0[:, None] + rows_new  # [N, U] absolute row index
        g_k, g_v = ks_new, vs_new
        if state is not None and max(r0_list, default=0):
            Rc = max(r0_list)
            rows_c = torch.arange(Rc, device=dev)
            g_k = torch.cat([state.sum_k[:, :Rc].to(Q.dtype), g_k], 1)
            g_v = torch.cat([state.sum_v[:, :Rc].to(Q.dtype), g_v], 1)
            g_ok = torch.cat([(rows_c < r0[:, None])[..., None].expand(N, Rc, C), g_ok], 1)
            g_row = torch.cat([rows_c.expand(N, Rc), g_row], 1)

        # ---- one softmax over [local keys of the row ; summaries of the rows] (seed App. A)
        acc = _acc(Q.dtype)
        scale = D**-0.5
        local = torch.einsum("nrihd,nrjhd->nrhij", Q.to(acc), K.to(acc)) * scale  # [N, R, H, C, C]
        eye = torch.eye(C, dtype=torch.bool, device=dev)
        keep_local = valid[:, :, None, None, :] | eye  # a padded query sees itself: no empty softmax
        if self.causal:
            keep_local = keep_local & torch.ones(C, C, dtype=torch.bool, device=dev).tril()
        glob = torch.einsum("nrchd,nuchd->nrhcu", Q.to(acc), g_k.to(acc)) * scale  # [N, R, H, C, U]
        keep_glob = g_ok.transpose(1, 2)[:, None]  # [N, 1, C, U]: the summary at the query's column
        if self.causal:
            q_row = r0[:, None] + torch.arange(R, device=dev)  # [N, R] absolute row of the queries
            keep_glob = keep_glob & (g_row[:, None, :] < q_row[:, :, None])[:, :, None, :]  # rows u < r
        logits = torch.cat([local.masked_fill(~keep_local, float("-inf")),
                            glob.masked_fill(~keep_glob[:, :, None], float("-inf"))], -1)
        p = logits.softmax(-1).to(Q.dtype)
        o = torch.einsum("nrhij,nrjhd->nrihd", p[..., :C], Vv) + torch.einsum("nrhcu,nuchd->nrchd", p[..., C:], g_v)
        o = o.reshape(N, R * C, H, D)[seq, slot].view(B, T, H * D)
        y = self.out(o)
        if state is None:
            return y, None
        return y, self._next_state(state, ks_new, vs_new, m, m_list, r0, r0_list, L, Q, K, Vv, X)

    def _static_step(self, x, q, k, v, state: CombinerState):
        """One token per sequence against a static state, with fixed shapes and no host read: the
        same softmax as :meth:`forward` (the row so far + the summaries at the token's column of the
        rows before it); a row the token completes is summarised and written into ``sum_k`` /
        ``sum_v`` in place.  ``x [N, 1, d]``, ``q, k, v [N, 1, H, D]`` (after RoPE)."""
        N, _, H, D = q.shape
        C, dev = self.chunk_size, x.device
        b, r0 = state.buf_len, state.rows  # [N] column of the token, its row
        q, k, v, x = q[:, 0], k[:, 0], v[:, 0], x[:, 0]
        slots = torch.arange(C, device=dev)
        put = (slots == b[:, None])[:, :, None, None]  # [N, C, 1, 1]
        bq, bk, bv = (torch.where(put, z[:, None].to(buf.dtype), buf)
                      for z, buf in ((q, state.buf_q), (k, state.buf_k), (v, state.buf_v)))
        bx = torch.where(put[..., 0], x[:, None].to(state.buf_x.dtype), state.buf_x)
        acc = _acc(q.dtype)
        scale = D**-0.5
        U = state.sum_k.shape[1]
        ar = torch.arange(N, device=dev)
        g_k = state.sum_k[ar[:, None], torch.arange(U, device=dev), b[:, None]]  # [N, U, H, D] at column b
        g_v = state.sum_v[ar[:, None], torch.arange(U, device=dev), b[:, None]]
        local = torch.einsum("nhd,njhd->nhj", q.to(acc), bk.to(acc)) * scale  # [N, H, C]
        glob = torch.einsum("nhd,nuhd->nhu", q.to(acc), g_k.to(acc)) * scale  # [N, H, U]
        keep_local = (slots[None] <= b[:, None])[:, None]  # [N, 1, C]
        keep_glob = (torch.arange(U, device=dev)[None] < r0[:, None])[:, None]  # [N, 1, U]: rows u < r
        logits = torch.cat([local.masked_fill(~keep_local, float("-inf")),
                            glob.masked_fill(~keep_glob, float("-inf"))], -1)
        p = logits.softmax(-1).to(q.dtype)
        o = torch.einsum("nhj,njhd->nhd", p[..., :C], bv.to(q.dtype)) \
            + torch.einsum("nhu,nuhd->nhd", p[..., C:], g_v.to(q.dtype))
        y = self.out(o.reshape(N, 1, H * D))

        # a completed row: its summaries go to slot rows[n] (in place), the buffers start over
        full = b + 1 == C  # [N]
        ks, vs = self._row_summaries(bq[:, None].to(q.dtype), bk[:, None].to(q.dtype), bv[:, None].to(q.dtype),
                                     bx[:, None].to(x.dtype), torch.ones(N, 1, C, dtype=torch.bool, device=dev), r0)
        dst = r0.clamp(max=U - 1)
        done = full[:, None, None, None]
        for buf, new in ((state.sum_k, ks[:, 0]), (state.sum_v, vs[:, 0])):
            buf.index_put_((ar, dst), torch.where(done, new.to(buf.dtype), buf[ar, dst]))
        clear = (~full)[:, None, None, None]
        zero = torch.zeros((), dtype=bq.dtype, device=dev)
        return y, dataclasses.replace(
            state, rows=r0 + full.long(), buf_len=torch.where(full, torch.zeros_like(b), b + 1),
            buf_q=torch.where(clear, bq, zero), buf_k=torch.where(clear, bk, zero), buf_v=torch.where(clear, bv, zero),
            buf_x=torch.where(clear[..., 0], bx, zero.to(bx.dtype)),
        )

    def _next_state(self, state, ks_new, vs_new, m, m_list, r0, r0_list, L, Q, K, Vv, X) -> CombinerState:
        """Complete rows move into the summary cache; the trailing incomplete row is the new buffer."""
        N, R, C = Q.shape[:3]
        dev = Q.device
        U = ks_new.shape[1]
        # room for rows r0[n] + u, u < U, of every sequence (>= the rows actually completed): the
        # writes below need no device-side selection of the completed rows
        need = max(r0_list, default=0) + U
        sum_k, sum_v = state.sum_k, state.sum_v
        S = sum_k.shape[1]
        if need > S:
            grow = max(need, 2 * S) - S
            sum_k = torch.cat([sum_k, sum_k.new_zeros(N, grow, *sum_k.shape[2:])], 1)
            sum_v = torch.cat([sum_v, sum_v.new_zeros(N, grow, *sum_v.shape[2:])], 1)
        if U:
            # row u of sequence n goes to slot r0[n] + u when complete (u < m[n]); the other slots
            # get their own (zero) contents back.  Distinct slots per sequence: no write collides
            done = (torch.arange(U, device=dev) < m[:, None]).view(N, U, 1, 1, 1)  # [N, U, 1, 1, 1]
            dst = r0[:, None] + torch.arange(U, device=dev)  # [N, U]
            n_idx = torch.arange(N, device=dev)[:, None].expand(N, U)
            sum_k = sum_k.index_put((n_idx, dst), torch.where(done, ks_new.to(sum_k.dtype), sum_k[n_idx, dst]))
            sum_v = sum_v.index_put((n_idx, dst), torch.where(done, vs_new.to(sum_v.dtype), sum_v[n_idx, dst]))
        # the incomplete row m[n] (empty when the segment ends on a row boundary)
        row = m.clamp(max=R - 1)
        ar = torch.arange(N, device=dev)
        blen = L - m * C
        keep = torch.arange(C, device=dev)[None, :] < blen[:, None]  # [N, C]

        def buf(z, like):
            rows_ = z[ar, row]  # [N, C, ...]
            return rows_.masked_fill(~keep.view(N, C, *([1] * (rows_.dim() - 2))), 0).to(like.dtype)

        return CombinerState(
            sum_k=sum_k, sum_v=sum_v, rows=r0 + m,
            buf_q=buf(Q, state.buf_q), buf_k=buf(K, state.buf_k), buf_v=buf(Vv, state.buf_v),
            buf_x=buf(X, state.buf_x), buf_len=blen,
        )

    def init_state(self, batch_size, device, dtype) -> CombinerState:
        N, C, H, D = batch_size, self.chunk_size, self.n_heads, self.head_dim
        z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)
        return CombinerState(
            sum_k=z(N, 0, C, H, D), sum_v=z(N, 0, C, H, D),
            rows=torch.zeros(N, dtype=torch.long, device=device),
            buf_q=z(N, C, H, D), buf_k=z(N, C, H, D), buf_v=z(N, C, H, D), buf_x=z(N, C, self.dim),
            buf_len=torch.zeros(N, dtype=torch.long, device=device),
        )

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_dim={self.head_dim}, row={self.chunk_size}, "
                f"row_summary={self.row_summary}, rope={self.rope}, causal={self.causal}")


__all__ = ["CombinerAttention", "CombinerState", "ROW_SUMMARIES"]
