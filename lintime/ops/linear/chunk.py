"""Linear attention in the seed's chunked mode (the default for training), in PyTorch.

Notation: ``R`` rows and ``NC`` chunks of the per-sequence chunk layout, ``C`` chunk size,
``V' = V + 1`` when normalising (see below), otherwise ``V``.

For token ``i`` of chunk ``n`` (seed, chunked mode)::

    o_i = scale * q_i S_{s(n)}  +  sum_{s(n) <= j <= i} scale * (q_i . k_j) v_j
    S_{s(n+1)} = S_{s(n)} + sum_{j in chunk n} k_j^T v_j

The first term reads the state entering the chunk (passed along with ``chunk_scan``, which
restarts it at every sequence start from that sequence's initial state); the second is a
masked ``[C, C]`` score matrix.  Memory is O(T * C): no ``T x T`` tensor.

Normalisation rides along for free: the key sum ``z = sum k_j`` is the state of a value that is
constant 1, so ``v`` gets a ones column (``V' = V + 1``) and the last output column is the
normaliser ``scale * q_i . z_i``.  Everything is accumulated in fp32 (fp64 for fp64 inputs);
the output is cast back to the input dtype.

Non-causal: every query reads the state of its whole sequence, ``o_i = scale * q_i S_total``.
"""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, chunk_layout, chunk_scan


def chunk_linear_attention(
    q, k, v, *, causal=True, normalize=True, scale=None, chunk_size=64,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Same arguments and results as :func:`lintime.ops.linear_attention`."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt, out_dtype = acc_dtype(q), q.dtype
    # a chunk longer than the input only adds padding (and a C x C block): cap it at T
    C = max(1, min(chunk_size, T))
    lay = chunk_layout(B, T, C, cu_seqlens, q.device)

    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # [B, T, H, V']
    S0 = None
    if initial_state is not None:
        # [N, H, K, V']: the key sum is the state column of the ones value
        S0 = torch.cat([initial_state[0].to(dt), initial_state[1].to(dt)[..., None]], -1) \
            if normalize else initial_state.to(dt)

    qc, kc, vc = lay.to_chunks(q), lay.to_chunks(k), lay.to_chunks(v)  # [R, NC, C, H, *]
    delta = torch.einsum("rnjhk,rnjhv->rnhkv", kc, vc)  # [R, NC, H, K, V'] what each chunk adds
    before, final = chunk_scan(lay, delta, initial=S0)  # [R, NC, H, K, V'], [N, H, K, V']
    if causal:
        # seed chunked mode: Y_i = S_{cn} Q_i + sum_{j=cn+1}^{i} K_j^T Q_i V_j
        A = torch.einsum("rnihk,rnjhk->rnhij", qc, kc)  # [R, NC, H, C, C]
        A = A * torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        oc = torch.einsum("rnihk,rnhkv->rnihv", qc, before) + torch.einsum("rnhij,rnjhv->rnihv", A, vc)
    else:
        total = final.index_select(0, lay.seq.reshape(-1)).view(lay.R, lay.NC, H, K, -1)
        oc = torch.einsum("rnihk,rnhkv->rnihv", qc, total)
    oc = oc * scale  # [R, NC, C, H, V']
    if normalize:
        # padding slots have q = 0 and a zero normaliser; give them 1 so neither the output
        # nor its gradient (0 / 0) turns into NaN that would leak into the real tokens
        den = torch.where(lay.valid[..., None], oc[..., V], torch.ones_like(oc[..., V]))
        oc = oc[..., :V] / den[..., None]
    o = lay.from_chunks(oc).to(out_dtype)  # [B, T, H, V]
    state = None
    if output_final_state:
        state = (final[..., :V].contiguous(), final[..., V].contiguous()) if normalize else final
    return o, state
