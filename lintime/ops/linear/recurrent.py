"""Linear attention in the seed's recurrent mode, token by token (decoding; ``T == 1`` dispatches
here): ``S_i = S_{i-1} + k_i^T v_i``, ``z_i = z_{i-1} + k_i``, ``o_i = scale q_i S_i / (scale q_i . z_i)``.

Non-causal: the same recurrence runs over the whole sequence first, then every query reads the
final ``(S, z)``.  Sequences of equal length (the batch without ``cu_seqlens``) step together;
packed sequences are run one after another so their states never mix.
"""

from __future__ import annotations

import torch

from lintime.ops.utils import acc_dtype, row_spans


def _recur(q, k, v, S, z, causal: bool, normalize: bool, scale: float):
    """``q, k [N, L, H, K]``, ``v [N, L, H, V]``, ``S [N, H, K, V]``, ``z [N, H, K]`` or ``None``.
    Returns ``o [N, L, H, V]`` and the final ``S, z``."""
    # unbind once: indexing k[:, t] inside the loop would make autograd build a full-size
    # gradient for every step (O(T^2) memory traffic in the backward)
    qs, ks, vs = q.unbind(1), k.unbind(1), v.unbind(1)
    outs = []
    for q_t, k_t, v_t in zip(qs, ks, vs):
        S = S + k_t[..., :, None] * v_t[..., None, :]  # seed: S_i = S_{i-1} + V_i K_i^T
        if normalize:
            z = z + k_t
        if causal:
            outs.append(_read(q_t, S, z, normalize, scale))
    if not causal:  # every query reads the state of the whole sequence
        return _read(q, S[:, None], None if z is None else z[:, None], normalize, scale), S, z
    o = torch.stack(outs, dim=1) if outs else q.new_zeros(*q.shape[:3], v.shape[-1])
    return o, S, z


def _read(q, S, z, normalize: bool, scale: float):
    # q [..., H, K], S [..., H, K, V], z [..., H, K] -> [..., H, V]; seed: Y_i = S_i Q_i
    num = scale * (q[..., None] * S).sum(-2)
    if not normalize:
        return num
    return num / (scale * (q * z).sum(-1))[..., None]


def recurrent_linear_attention(
    q, k, v, *, causal=True, normalize=True, scale=None, chunk_size=None,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Same arguments and results as :func:`lintime.ops.linear_attention` (``chunk_size`` is
    accepted for a common signature and unused)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dt, out_dtype = acc_dtype(q), q.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is None:
        S0 = q.new_zeros(N, H, K, V)
        z0 = q.new_zeros(N, H, K) if normalize else None
    elif normalize:
        S0, z0 = (x.to(dt) for x in initial_state)
    else:
        S0, z0 = initial_state.to(dt), None
    if cu_seqlens is None:
        # all rows have length T: one recurrence, batched over B
        o, S, z = _recur(q, k, v, S0, z0, causal, normalize, scale)
        Ss, zs = [S], [z]
    else:
        parts, Ss, zs = [], [], []
        for n, (_, s, e) in enumerate(row_spans(B, T, cu_seqlens)):
            o_n, S, z = _recur(q[:, s:e], k[:, s:e], v[:, s:e], S0[n : n + 1],
                               None if z0 is None else z0[n : n + 1], causal, normalize, scale)
            parts.append(o_n)
            Ss.append(S)
            zs.append(z)
        o = torch.cat(parts, dim=1)
    state = None
    if output_final_state:
        S = torch.cat(Ss)
        state = (S, torch.cat(zs)) if normalize else S
    return o.to(out_dtype), state
