"""Softmax attention through PyTorch SDPA (FlashAttention / memory-efficient / cuDNN on CUDA,
the flash CPU kernel elsewhere): never a T x T tensor on the fast paths.

Packed sequences (``cu_seqlens``): on CUDA in half precision one variable-length FlashAttention
call (``torch.nn.attention.varlen.varlen_attn``) covers all of them -- a training batch packs
hundreds of documents, and one SDPA call per document made a 1024-token Transformer++ step
several times slower than the linear-time families'.  Elsewhere (CPU,
fp32/fp64, head sizes FlashAttention does not take) the sequences are attended one by one.
Packed sequences that are rows of one length (one document per row, as in long-context training and
the model benchmark) are attended as a plain ``[N, L]`` batch through SDPA's own kernel choice (the
one HF's SDPA models get), reading ``cu_seqlens`` once per tensor.

While ``torch.compile`` traces, or when ``cu_seqlens`` is static (``lintime.ops.utils.mark_static``: a buffer a
CUDA graph replays with new offsets, its trailing entries empty sequences), nothing reads ``cu_seqlens`` on the host:
packed calls go to the varlen kernel, or elsewhere to one SDPA call with a block-diagonal ``[T, T]`` mask (O(T^2)
memory: CPU / fp32 calls).  The varlen kernel then needs a host bound of the sequence lengths, its grid's extent:
the caller's ``max_seqlen``, else the packed length ``T``.  Its grid has one block per tile of ``bound`` (64-128
queries in the forward, keys in the backward) per sequence and head, the padding entries of a static buffer
included; a block past its sequence's end returns at once, so an empty sequence costs only such blocks, and a loose
bound only adds them -- ``T`` instead of a row length ``L`` makes their count ``T / L`` times larger, which with
hundreds of entries costs several times the attention itself: callers that know ``L`` pass it."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from lintime.ops.utils import is_static, packed_cache, row_spans


@functools.lru_cache(maxsize=None)
def _varlen_fn():
    """``(varlen_attn, causal keyword style)`` or ``None`` where this PyTorch has no varlen
    FlashAttention.  The causal flag is ``is_causal=`` in PyTorch 2.10-2.11 and
    ``window_size=(-1, 0)`` from 2.12 on."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        return varlen_attn, "window"
    if "is_causal" in params:
        return varlen_attn, "is_causal"
    return None


def _varlen_ok(q, k, v) -> bool:
    K = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and v.shape[-1] == K
        and K % 8 == 0
        and K <= 256
        and _varlen_fn() is not None
    )


def _row_length(cu_seqlens: torch.Tensor, T: int) -> tuple[int, int]:
    """``(L, longest)``: ``L`` the common length when the packed sequences are ``T / L`` rows of one
    length (``cu_seqlens = 0, L, 2L, ..., T``), else 0; ``longest`` the longest sequence.  Read on
    the host once per ``cu_seqlens`` tensor (every layer of a model passes the same one)."""
    entry = packed_cache(cu_seqlens, ("row length", T))
    if not entry:
        cu = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        L = lengths[0] if lengths else 0
        entry["L"] = L if L > 0 and all(n == L for n in lengths) and cu[0] == 0 and cu[-1] == T else 0
        entry["longest"] = max(lengths, default=0)
    return entry["L"], entry["longest"]


def check_max_seqlen(op: str, max_seqlen: int | None, cu_seqlens: torch.Tensor | None, T: int) -> None:
    """``max_seqlen`` must be a positive int at least the longest sequence of ``cu_seqlens``: a smaller bound would
    leave the varlen kernel's output rows past it unwritten.  Checked on the host from the lengths the packed path
    reads anyway, or, where no host read is allowed, by a device-side assert (no sync)."""
    if max_seqlen is None or cu_seqlens is None:
        return
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, torch.SymInt)) or max_seqlen < 1:
        raise ValueError(f"{op}: max_seqlen must be a positive int, got {max_seqlen!r}")
    if max_seqlen >= T:  # no sequence is longer than the packed length
        return
    if torch.compiler.is_compiling() or is_static(cu_seqlens):
        torch._assert_async((cu_seqlens.diff() <= max_seqlen).all(),
                            f"{op}: a sequence of cu_seqlens is longer than max_seqlen={max_seqlen}")
        return
    longest = _row_length(cu_seqlens, T)[1]
    if longest > max_seqlen:
        raise ValueError(f"{op}: max_seqlen={max_seqlen} is shorter than the longest sequence ({longest})")


def _sdpa(q, k, v, causal, scale):
    """SDPA on ``[B, T, H, D]`` tensors."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal, scale=scale)
    return o.transpose(1, 2)


def _varlen_attention(q, k, v, cu_seqlens, causal, scale, max_len):
    """One varlen FlashAttention call; ``max_len`` a host bound of the sequence lengths (the grid's extent)."""
    fn, style = _varlen_fn()
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if max_len == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    kw = {"window_size": (-1, 0) if causal else (-1, -1)} if style == "window" else {"is_causal": causal}
    o = fn(q[0], k[0], v[0], cu, cu, max_len, max_len, scale=scale, **kw)  # [T, H, V]
    return o[None]


def _masked_sdpa(q, k, v, cu_seqlens, causal, scale):
    """Packed ``[1, T]`` sequences as one SDPA call with a block-diagonal (and causal) mask, no host read."""
    T = q.shape[1]
    pos = torch.arange(T, device=q.device)
    seq = torch.searchsorted(cu_seqlens.to(device=q.device, dtype=torch.long), pos, right=True)  # [T]
    mask = seq[:, None] == seq[None, :]
    if causal:
        mask = mask & (pos[None, :] <= pos[:, None])
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       scale=scale)
    return o.transpose(1, 2)


def sdpa_softmax_attention(q, k, v, *, causal=True, scale=None, cu_seqlens=None, max_seqlen=None):
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens is None:
        return _sdpa(q, k, v, causal, scale)
    if torch.compiler.is_compiling() or is_static(cu_seqlens):  # no host read of cu_seqlens
        if _varlen_ok(q, k, v):
            bound = T if max_seqlen is None else min(max_seqlen, T)
            return _varlen_attention(q, k, v, cu_seqlens, causal, scale, bound)
        return _masked_sdpa(q, k, v, cu_seqlens, causal, scale)
    L, longest = _row_length(cu_seqlens, T)
    if L:  # rows of one length: one batched SDPA call
        rows = lambda x: x.view(T // L, L, *x.shape[2:])  # noqa: E731
        return _sdpa(rows(q), rows(k), rows(v), causal, scale).reshape(1, T, H, v.shape[-1])
    if _varlen_ok(q, k, v):  # the exact longest length: the tightest grid
        return _varlen_attention(q, k, v, cu_seqlens, causal, scale, longest)
    outs = []
    for _, s, e in row_spans(B, T, cu_seqlens):
        if e == s:
            continue
        outs.append(_sdpa(q[:, s:e], k[:, s:e], v[:, s:e], causal, scale))
    if not outs:
        return q.new_zeros(B, T, H, v.shape[-1])
    return torch.cat(outs, dim=1)
