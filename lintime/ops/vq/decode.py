"""One Transformer-VQ decoding step, in place: ``vq_decode_step_`` (seed Theorem 3.7 read one query at a time,
the running-mean cache of Remark 3.9).

The same numbers as :func:`lintime.ops.vq_attention` on one token with a state (its recurrent form,
:func:`lintime.ops.vq.recurrent.vq_step`), but the given state's own tensors receive the next state: no new state
object, fixed shapes, no host read, so a CUDA graph can capture the step and replay it per token.  The PyTorch
composite here runs anywhere; on CUDA the fused kernels of :mod:`lintime.ops.vq.triton.decode` (three per step,
plus the position increment) replace the step's ~60 PyTorch kernels.

Notation: ``N`` sequences, ``H`` heads, ``K`` key width, ``V`` value width, ``S`` codes, ``L`` block length.
"""

from __future__ import annotations

import torch

from lintime.ops.dispatch import require_triton, triton_available
from lintime.ops.utils import acc_dtype, is_checked
from lintime.ops.vq.recurrent import vq_step
from lintime.ops.vq.state import VQState

BACKENDS = ("recurrent", "triton")


def relative_bias(qv: torch.Tensor, r: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[N, H, 2L]``: the window bias of the token at ``pos [N]`` from a relative table, column ``j`` =
    ``qv . r[m]`` at distance ``m = L + pos % L - j`` when ``0 <= m <= L``, else 0 (``qv [N, H, K]``,
    ``r [L + 1, H, K]``; Transformer-XL's position term, seed Theorem 3.6)."""
    L = r.shape[0] - 1
    N, H, _ = qv.shape
    m = (pos % L)[:, None] + L - torch.arange(2 * L, device=pos.device)  # [N, 2L]
    keep = (m >= 0) & (m <= L)
    qr = torch.einsum("nhk,mhk->nhm", qv, r)  # [N, H, L + 1]
    return qr.gather(-1, m.clamp(0, L)[:, None, :].expand(N, H, 2 * L)) * keep[:, None, :].to(qr.dtype)


def recurrent_decode_step_(q, k_hat, codes, v, codebook, state: VQState, bias=None, rel_bias=None) -> torch.Tensor:
    """:func:`vq_step` in the accumulation dtype, its new state copied into ``state``; ``o [N, H, V]`` in ``q``'s
    dtype."""
    dt = acc_dtype(q)
    st = state.to(dtype=dt).canonical()
    b = None if bias is None else bias.to(dt)
    if rel_bias is not None:
        rb = relative_bias(rel_bias[0].to(dt), rel_bias[1].to(dt), state.pos)
        b = rb if b is None else b + rb
    o, new = vq_step(st, q.to(dt), k_hat.to(dt), codes, v.to(dt), codebook.to(dt), b)
    for name in ("cache_mean", "cache_count", "k_hat", "v", "codes", "pos"):
        getattr(state, name).copy_(getattr(new, name))
    return o.to(q.dtype)


def vq_decode_step_(
    q: torch.Tensor,
    k_hat: torch.Tensor,
    codes: torch.Tensor,
    v: torch.Tensor,
    codebook: torch.Tensor,
    state: VQState,
    *,
    bias: torch.Tensor | None = None,
    rel_bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """One token per sequence of :func:`lintime.ops.vq_attention`, ``state`` updated **in place**::

        o, state = vq_attention(q[:, None], k_hat[:, None], codes[:, None], v[:, None], codebook,
                                block_len=L, bias=bias[:, None], initial_state=state, output_final_state=True)

    The token goes into window slot ``L + pos % L``; the query attends to the window (slots ``[0, L)`` the
    previous block once ``pos >= L``, slots ``[L, L + pos % L]``; bias column ``j`` on slot ``j``) and to the
    cache (``q . codebook + log count``) in one softmax; when the token completes a block, the previous block's
    per-code (count, mean) joins the cache and the window shifts by ``L``; ``pos += 1``.

    Args:
        q: ``[N, H, K]`` queries (the layer's ``q + u'``).
        k_hat: ``[N, H, K]`` the token's quantised key (``codebook[h, codes]``), ``q``'s dtype.
        codes: ``[N, H]`` int, in ``[0, S)`` (not checked: the layer's argmin).
        v: ``[N, H, V]``, ``q``'s dtype.
        codebook: ``[H, S, K]`` any float dtype.
        state: a canonical :class:`VQState` of ``N`` sequences (every op returns canonical states), window
            buffers in ``q``'s dtype, cache in fp32 (fp64 for fp64 inputs); the fused form needs contiguous
            tensors.  Overwritten with the state after the token.
        bias: ``[N, H, 2L]`` the window bias of the token, ``q``'s dtype, or ``None``.
        rel_bias: ``(qv [N, H, K], r [L + 1, H, K])`` or ``None``: a window bias given by a relative table
            (added to ``bias``): column ``j`` gets ``qv . r[m]`` at distance ``m = L + pos % L - j`` from the
            token when ``0 <= m <= L``, else 0 (the Transformer-VQ layer's XL term, seed Theorem 3.6; the
            fused step computes it in its kernel instead of a ``[N, H, 2L]`` tensor); ``q``'s dtype.
        backend: ``None`` (``'triton'`` for CUDA tensors, else ``'recurrent'``), ``'triton'`` (also on the CPU
            under ``TRITON_INTERPRET=1``; fp64 inputs, an fp64 cache or keys wider than 256 run the composite) or
            ``'recurrent'`` (PyTorch, any device).

    Returns:
        ``o`` ``[N, H, V]`` in ``q``'s dtype.
    """
    op = "vq_decode_step_"
    if not isinstance(state, VQState):
        raise TypeError(f"{op}: state must be a VQState, got {type(state).__name__}")
    N, L2, H, K = state.k_hat.shape
    V = state.v.shape[-1]
    S = state.cache_count.shape[-1]
    tensors = {"q": q, "k_hat": k_hat, "codes": codes, "v": v, "codebook": codebook}
    if bias is not None:
        tensors["bias"] = bias
    if rel_bias is not None:
        if not isinstance(rel_bias, (tuple, list)) or len(rel_bias) != 2:
            raise TypeError(f"{op}: rel_bias must be a pair (qv, r), got {type(rel_bias).__name__}")
        tensors["rel_bias qv"], tensors["rel_bias r"] = rel_bias
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != state.pos.device:
            raise ValueError(f"{op}: {name} is on {x.device}, the state on {state.pos.device}")
    want = {"q": (N, H, K), "k_hat": (N, H, K), "codes": (N, H), "v": (N, H, V), "codebook": (H, S, K),
            "bias": (N, H, L2), "rel_bias qv": (N, H, K), "rel_bias r": (L2 // 2 + 1, H, K)}
    for name, x in tensors.items():
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{op}: {name} must have shape {want[name]} (from the state), got {tuple(x.shape)}")
    same = (k_hat, v, state.k_hat, state.v, *([] if bias is None else [bias]), *(rel_bias or ()))
    if not q.is_floating_point() or any(x.dtype != q.dtype for x in same):
        raise TypeError(f"{op}: q, k_hat, v, the biases and the state's window buffers must share a floating dtype")
    if codes.is_floating_point() or codes.dtype == torch.bool:
        raise TypeError(f"{op}: codes must be an integer tensor, got {codes.dtype}")
    if not is_checked(state.pos) and bool((state.pos < 0).any()):  # one host read unless the op made the state
        raise ValueError(f"{op}: state.pos must be >= 0")
    if backend not in (None, *BACKENDS):
        raise ValueError(f"{op}: backend must be None, 'recurrent' or 'triton', got {backend!r}")
    if backend is None:
        backend = "triton" if triton_available(q.device) else "recurrent"
    if backend == "triton":
        require_triton(op)
        from lintime.ops.vq.triton.decode import fusable, triton_decode_step_

        if fusable(q, state):
            return triton_decode_step_(q, k_hat, codes, v, codebook, state, bias, rel_bias)
    return recurrent_decode_step_(q, k_hat, codes, v, codebook, state, bias, rel_bias)


__all__ = ["vq_decode_step_"]
