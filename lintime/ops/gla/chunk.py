"""Chunkwise gated linear attention in PyTorch (seed §4.2-4.3, Listing 1), forward and a
hand-written backward.

Notation: ``R`` rows / ``NC`` chunks / ``C`` chunk size of the per-sequence chunk layout
(:func:`lintime.ops.utils.chunk_layout`), ``c`` sub-chunk size, ``ns = C // c`` sub-chunks per
chunk, ``H`` heads, ``K`` key width, ``V`` value width.  Inside chunk ``n`` (tokens ``i, j``)::

    G_i   = sum of g over the chunk up to and including i   (fp32, <= 0, decreasing)
    h_n   = state entering the chunk                          [H, K, V]
    o_i   = scale * (q_i * exp(G_i)) h_n                      inter-chunk (matmul)
          + sum_{j <= i} A_ij v_j                             intra-chunk
    A_ij  = scale * sum_k q_ik k_jk exp(G_ik - G_jk)
    h_n+1 = exp(G_last) * h_n + sum_j (k_j * exp(G_last - G_j))^T v_j   (chunk_scan)

Every exponent is <= 0, so nothing overflows in any dtype:

* ``A`` between sub-chunks ``J < I`` (secondary tiling, seed Fig. 3 orange): a plain matmul of
  ``q_i * exp(G_i - z_I)`` and ``k_j * exp(z_I - G_j)`` with ``z_I`` = ``G`` at the first token
  of sub-chunk ``I`` (seed Listing 1, ``z = b[0]``); both factors are bounded by 1.
* ``A`` inside a sub-chunk (seed Fig. 3 pink): ``exp(G_i - G_j)`` in fp32, computed only where
  ``j <= i`` (the other entries are set to ``-inf`` before ``exp``).

Backward (seed §4.3, Appendix B): the per-chunk states are recomputed (never per-step ones);
``dq, dk, dv`` and the state gradients ``dh`` (a reverse chunk scan) follow from the formulas
above, and the gate gradient uses the closed form.  With ``dG_i = q_i * dq_i - k_i * dk_i`` (the
derivative with respect to the cumulative log-gate, seed "d log b_t"), and because ``G_i`` is the
sum of ``g`` up to ``i`` inside the chunk while ``G_last`` also scales the outgoing state::

    dg_i = sum_{i' >= i in chunk} dG_i'  +  sum_v (dh_{n+1} * h_{n+1})[k, v]

The second term is the state term (the "final-state term" of the chunk: ``h_{n+1}`` is the
chunk's outgoing state and ``dh_{n+1}`` its gradient, the user's ``d final_state`` for a
sequence's last chunk); the initial state enters through ``dq`` (its ``q exp(G) h`` term).
Keeping the reverse sum inside the chunk avoids a length-``T`` cumulative sum of differences.
"""

from __future__ import annotations

import torch

from lintime.ops.utils import ChunkLayout, acc_dtype, chunk_layout, chunk_scan

SUB_CHUNK = 16


def sub_chunk_size(C: int) -> int:
    """Sub-chunk size: 16 (seed Fig. 3), or the largest divisor of ``C`` below it."""
    return next(d for d in range(min(SUB_CHUNK, C), 0, -1) if C % d == 0)


class _Decays:
    """The decay factors of one chunked batch, all of the form ``exp(non-positive)``.

    ``G [R, NC, C, H, K]`` in-chunk cumulative log-gates.
    ``a [R, NC, ns, c, H, K]``          ``exp(G_i - z_I)``, ``i`` in sub-chunk ``I``;
    ``b [R, NC, ns, ns, c, H, K]``      ``exp(z_I - G_j)``, ``j`` in sub-chunk ``J < I`` (0 for ``J >= I``);
    ``e [R, NC, ns, c, c, H, K]``       ``exp(G_i - G_j)`` inside a sub-chunk, ``j <= i`` (0 above).
    """

    def __init__(self, G: torch.Tensor, c: int):
        R, NC, C, H, K = G.shape
        ns = C // c
        self.shape = (R, NC, ns, c, H, K)
        Gs = G.view(R, NC, ns, c, H, K)
        z = Gs[:, :, :, :1]  # [R, NC, ns, 1, H, K]
        self.a = (Gs - z).exp()
        before = torch.ones(ns, ns, dtype=torch.bool, device=G.device).tril(-1)  # J < I
        d = z[:, :, :, None] - Gs[:, :, None]  # [R, NC, I, J, c, H, K] = z_I - G_j
        self.b = torch.where(before[:, :, None, None, None], d, float("-inf")).exp()
        causal = torch.ones(c, c, dtype=torch.bool, device=G.device).tril()  # j <= i
        d = Gs[:, :, :, :, None] - Gs[:, :, :, None, :]  # [R, NC, ns, i, j, H, K] = G_i - G_j
        self.e = torch.where(causal[:, :, None, None], d, float("-inf")).exp()

    def _split(self, x):
        return x.reshape(self.shape)

    def _blocks(self, M):
        """``M [R, NC, C, C, H]`` -> all blocks ``[R, NC, I, i, J, j, H]`` and the diagonal
        blocks ``[R, NC, ns, i, j, H]``."""
        R, NC, ns, c, H, _ = self.shape
        Mb = M.reshape(R, NC, ns, c, ns, c, H)
        return Mb, Mb.diagonal(0, 2, 4).permute(0, 1, 5, 2, 3, 4)

    def scores(self, q, k):
        """``M_ij = sum_k q_ik k_jk exp(G_ik - G_jk)`` for ``j <= i``, 0 above: ``[R, NC, C, C, H]``."""
        R, NC, ns, c, H, K = self.shape
        qs, ks = self._split(q), self._split(k)
        # inter-sub-chunk: one matmul of bounded factors per (I, J) pair
        M = torch.einsum("rnIihk,rnIJjhk->rnIiJjh", qs * self.a, ks[:, :, None] * self.b)
        # intra-sub-chunk, fp32 log-space (seed Eq. 4 on the sub-chunk)
        diag = (qs[:, :, :, :, None] * ks[:, :, :, None] * self.e).sum(-1)  # [R, NC, ns, i, j, H]
        M.diagonal(0, 2, 4).add_(diag.permute(0, 1, 3, 4, 5, 2))
        return M.reshape(R, NC, ns * c, ns * c, H)

    def left(self, M, k):
        """``out_ik = sum_{j <= i} M_ij k_jk exp(G_ik - G_jk)`` (``dq`` from ``dA``): ``[R, NC, C, H, K]``."""
        Mb, Md = self._blocks(M)
        ks = self._split(k)
        out = self.a * torch.einsum("rnIiJjh,rnIJjhk->rnIihk", Mb, ks[:, :, None] * self.b)
        out = out + torch.einsum("rnIijh,rnIijhk->rnIihk", Md, ks[:, :, :, None] * self.e)
        return out.flatten(2, 3)

    def right(self, M, q):
        """``out_jk = sum_{i >= j} M_ij q_ik exp(G_ik - G_jk)`` (``dk`` from ``dA``): ``[R, NC, C, H, K]``."""
        Mb, Md = self._blocks(M)
        qs = self._split(q)
        P = torch.einsum("rnIiJjh,rnIihk->rnIJjhk", Mb, qs * self.a)
        out = (P * self.b).sum(2)  # [R, NC, J, j, H, K]
        out = out + (Md[..., None] * qs[:, :, :, :, None] * self.e).sum(3)
        return out.flatten(2, 3)


def _reversed(layout: ChunkLayout) -> ChunkLayout:
    """The layout with every row's chunks in reverse order, for the backward state scan: a
    sequence now opens at its last chunk and ends at its first.  Fixed shapes, no host read
    (no ``nonzero`` or boolean-mask indexing), so a CUDA graph can hold the backward."""
    R, NC = layout.R, layout.NC
    dev = layout.first.device
    flat = torch.arange(R * NC, device=dev)
    # each sequence's first chunk (-1 for an empty one): the largest flat index among its chunks that open it
    first_idx = torch.full((layout.N,), -1, dtype=torch.long, device=dev).scatter_reduce(
        0, layout.seq.reshape(-1), torch.where(layout.first.reshape(-1), flat, -1), "amax")
    hits = torch.zeros(R * NC, dtype=torch.long, device=dev)
    hits.index_put_((layout.last.clamp(min=0),), (layout.last >= 0).long(), accumulate=True)
    is_last = hits > 0
    rev_first_idx = (first_idx // NC) * NC + (NC - 1 - first_idx % NC)
    return ChunkLayout(
        layout.B, layout.T, layout.C, R, NC, layout.dest,
        first=is_last.view(R, NC).flip(1),
        seq=layout.seq.flip(1),
        valid=layout.valid.flip(1),
        last=torch.where(layout.last >= 0, rev_first_idx, -1),
        lengths=layout.lengths,
    )


def _forward_parts(q, k, v, g, h0, layout, c):
    """Recompute everything the forward and backward share, in the accumulation dtype."""
    G = g.cumsum(2)  # [R, NC, C, H, K]
    decay = G[:, :, -1]  # [R, NC, H, K]: G_last (padding slots have g = 0)
    k_out = k * (decay[:, :, None] - G).exp()  # k_j * exp(G_last - G_j)
    delta = torch.einsum("rnjhk,rnjhv->rnhkv", k_out, v)  # what the chunk adds to the state
    decay = decay.exp()[..., None]  # [R, NC, H, K, 1]
    before, final = chunk_scan(layout, delta, decay, h0)  # seed Eq. 2 (chunk recurrence)
    D = _Decays(G, c)
    return G, k_out, delta, decay, before, final, D


class ChunkGLAFunction(torch.autograd.Function):
    """Chunked GLA on chunk-layout tensors ``q, k, g [R, NC, C, H, K]``, ``v [R, NC, C, H, V]``
    (accumulation dtype), ``h0 [N, H, K, V]`` or ``None``.  Returns ``o [R, NC, C, H, V]`` and
    ``final [N, H, K, V]``."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, scale, layout, c):
        G, _, _, _, before, final, D = _forward_parts(q, k, v, g, h0, layout, c)
        A = scale * D.scores(q, k)  # [R, NC, C, C, H]
        o = scale * torch.einsum("rnihk,rnhkv->rnihv", q * G.exp(), before)  # inter-chunk
        o = o + torch.einsum("rnijh,rnjhv->rnihv", A, v)  # intra-chunk
        ctx.save_for_backward(q, k, v, g, h0)
        ctx.scale, ctx.layout, ctx.c = scale, layout, c
        ctx.device_type = q.device.type
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def backward(ctx, do, dfinal):
        # the forward ran with autocast off (:func:`chunk_gla`); a backward called inside an autocast region must too
        dev = ctx.device_type
        if dev in ("cpu", "cuda") and torch.is_autocast_enabled(dev):
            with torch.autocast(dev, enabled=False):
                return ChunkGLAFunction._backward(ctx, do, dfinal)
        return ChunkGLAFunction._backward(ctx, do, dfinal)

    @staticmethod
    def _backward(ctx, do, dfinal):
        q, k, v, g, h0 = ctx.saved_tensors
        scale, layout, c = ctx.scale, ctx.layout, ctx.c
        G, k_out, delta, decay, before, _, D = _forward_parts(q, k, v, g, h0, layout, c)
        if do is None:
            do = torch.zeros_like(v)
        q_in = q * G.exp()  # q_i * exp(G_i): how a query reads the incoming state
        # dh_{n+1} (gradient of each chunk's outgoing state): reverse chunk scan
        #   dh_n = exp(G_last) * dh_{n+1} + scale * (q * exp(G))^T do,  dh_end = d final
        dh_delta = scale * torch.einsum("rnihk,rnihv->rnhkv", q_in, do)
        rev = _reversed(layout)
        dh_after, dh0 = chunk_scan(rev, dh_delta.flip(1), decay.flip(1), dfinal)
        dh_after = dh_after.flip(1)  # [R, NC, H, K, V]
        after = decay * before + delta  # h_{n+1}

        A = scale * D.scores(q, k)
        dA = scale * torch.einsum("rnihv,rnjhv->rnijh", do, v)  # entries above the diagonal meet zero decays
        dv = torch.einsum("rnijh,rnihv->rnjhv", A, do) + torch.einsum("rnjhk,rnhkv->rnjhv", k_out, dh_after)
        dq = scale * G.exp() * torch.einsum("rnihv,rnhkv->rnihk", do, before) + D.left(dA, k)
        dk = D.right(dA, q) + (G[:, :, -1:] - G).exp() * torch.einsum("rnjhv,rnhkv->rnjhk", v, dh_after)
        # closed-form gate gradient (seed §4.3): reverse cumsum in the chunk + outgoing-state term
        dG = q * dq - k * dk
        dg = dG.flip(2).cumsum(2).flip(2) + (dh_after * after).sum(-1)[:, :, None]
        return dq, dk, dv, dg, (dh0 if ctx.needs_input_grad[4] else None), None, None, None


def chunk_gla(
    q, k, v, g, *, scale=None, chunk_size=64, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Same arguments and results as :func:`lintime.ops.gated_linear_attention`; O(T * C) memory."""
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    dt = acc_dtype(q)
    layout = chunk_layout(B, T, chunk_size, cu_seqlens, q.device)
    qc, kc, vc, gc = (layout.to_chunks(x.to(dt)) for x in (q, k, v, g))
    h0 = None if initial_state is None else initial_state.to(dt)
    # the form computes in ``dt`` itself: under autocast its einsums would run (and return) in the autocast dtype
    # and its backward would meet an fp32 state with a bf16 gradient
    with torch.autocast(q.device.type, enabled=False):
        o, final = ChunkGLAFunction.apply(qc, kc, vc, gc, h0, scale, layout, sub_chunk_size(chunk_size))
    return layout.from_chunks(o).to(q.dtype), (final if output_final_state else None)
