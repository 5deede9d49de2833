"""Linear attention (docs/design/contract.md §2.4; seed "linear-self-attention-is-faster")."""

from __future__ import annotations

import numbers

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.ops.linear.chunk import chunk_linear_attention
from lintime.ops.linear.naive import naive_linear_attention
from lintime.ops.linear.recurrent import recurrent_linear_attention
from lintime.ops.utils import check_cu_seqlens, check_same_btH, check_tensor, num_seqs

_IMPLS = {
    "naive": naive_linear_attention,
    "chunk": chunk_linear_attention,
    "recurrent": recurrent_linear_attention,
}


def _load_triton():  # the fused kernels, when Triton is installed (picked automatically for CUDA tensors)
    from lintime.ops.linear.triton import triton_linear_attention

    return triton_linear_attention


register_triton(_IMPLS, _load_triton)

_OP = "linear_attention"

# Crash guard, cause unknown: the widest head (K and V) the automatic choice sends to the Triton kernels.  Wider
# heads' tiles (8 warps, 1 stage, split dk / dv walks) gave an "illegal memory access" on a GPU in `bench model`
# (performer-base, K = 256; performer-medium, K = 128); they pass the interpreter tests.  Automatic dispatch sends
# K or V > 64 to the PyTorch forms; backend="triton" still runs the kernels.  Open: docs/design/kernels.md (linear
# attention); reproducer (CUDA, in a subprocess): tests/ops/linear/test_linear_dispatch_wide.py.
AUTO_TRITON_MAX_HEAD = 64

def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    normalize: bool = True,
    scale: float | None = None,
    chunk_size: int = 64,
    initial_state: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Linear self-attention: softmax attention with the exponential removed.

    ``S_i = sum_{j<=i} k_j^T v_j``, ``z_i = sum_{j<=i} k_j`` and
    ``o_i = scale * q_i S_i / (scale * q_i . z_i)`` if ``normalize`` else ``scale * q_i S_i``
    (non-causal: the sums run over the whole sequence).  The feature map that keeps
    ``q . k > 0`` (needed by the normaliser) is the caller's, e.g. ``elu(x) + 1``.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (fp32, fp16, bf16 or fp64).
        causal: token ``i`` sees keys ``j <= i``; otherwise every key of its sequence.
        normalize: divide by the normaliser ``scale * q_i . z_i``.
        scale: default ``K ** -0.5``.
        chunk_size: ``C`` of the chunked form (any ``T`` works, not only multiples of ``C``).
        initial_state: the state to continue from (causal only), ``N`` = ``B`` or the number
            of packed sequences:
            ``normalize=False``: ``kv [N, H, K, V]``;
            ``normalize=True``: a tuple ``(kv [N, H, K, V], k_sum [N, H, K])``.
        output_final_state: also return the state after the last token of each sequence.
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences (``B == 1``); tokens never see
            another sequence and every sequence has its own state.
        backend: ``None`` (automatic: ``triton`` for CUDA tensors when Triton is installed and
            ``K, V <= 64`` (:data:`AUTO_TRITON_MAX_HEAD`: the wider kernels are not yet verified
            on a GPU, see there), else ``recurrent`` for ``T == 1`` and ``chunk`` otherwise), ``"naive"`` (quadratic
            attention mode), ``"chunk"``, ``"recurrent"`` or ``"triton"`` (fused kernels; CPU
            tensors only under ``TRITON_INTERPRET=1``).
    Returns:
        o: ``[B, T, H, V]`` in ``q``'s dtype;
        state: ``None`` unless ``output_final_state``; then ``kv [N, H, K, V]`` (unnormalised) or
            ``(kv [N, H, K, V], k_sum [N, H, K])`` (normalised), fp32 (fp64 for fp64 inputs).
            Non-causal calls return the sums over the whole sequence.
    """
    check_tensor(_OP, "q", q)
    check_same_btH(_OP, "q", q, k=k, v=v)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape[-1] != K:
        raise ValueError(f"{_OP}: q and k need the same feature size, got {K} and {k.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{_OP}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, flag in (("causal", causal), ("normalize", normalize), ("output_final_state", output_final_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{_OP}: {name} must be a bool, got {type(flag).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"{_OP}: scale must be a real number or None, got {type(scale).__name__}")
        if not (abs(float(scale)) < float("inf")) or scale == 0:
            raise ValueError(f"{_OP}: scale must be finite and non-zero, got {scale}")
        scale = float(scale)
    else:
        scale = K**-0.5
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral):
        raise TypeError(f"{_OP}: chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"{_OP}: chunk_size must be >= 1, got {chunk_size}")
    check_cu_seqlens(_OP, cu_seqlens, B, T)
    if initial_state is not None:
        if not causal:
            raise ValueError(f"{_OP}: initial_state needs causal=True (a non-causal call sees its whole sequence)")
        _check_state(initial_state, normalize, num_seqs(B, cu_seqlens), H, K, V, q.device)
    impls = _IMPLS
    if backend is None and max(K, V) > AUTO_TRITON_MAX_HEAD:
        impls = {name: fn for name, fn in _IMPLS.items() if name != "triton"}
    impl = select(_OP, backend, impls, q)
    return impl(
        q, k, v, causal=causal, normalize=normalize, scale=scale, chunk_size=int(chunk_size),
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )


def _check_state(state, normalize: bool, N: int, H: int, K: int, V: int, device) -> None:
    if normalize:
        if not (isinstance(state, (tuple, list)) and len(state) == 2):
            raise TypeError(
                f"{_OP}: with normalize=True initial_state must be a tuple (kv [N, H, K, V], k_sum [N, H, K]), "
                f"got {type(state).__name__}"
            )
        parts = (("initial_state kv", state[0], (N, H, K, V)), ("initial_state k_sum", state[1], (N, H, K)))
    else:
        if not isinstance(state, torch.Tensor):
            raise TypeError(
                f"{_OP}: with normalize=False initial_state must be a tensor kv [N, H, K, V], got {type(state).__name__}"
            )
        parts = (("initial_state", state, (N, H, K, V)),)
    for name, x, shape in parts:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_OP}: {name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{_OP}: {name} must be a floating tensor, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{_OP}: {name} must have shape [N, H, K{', V' if len(shape) == 4 else ''}] = "
                             f"{shape}, got {tuple(x.shape)}")
        if x.device != device:
            raise ValueError(f"{_OP}: {name} is on {x.device}, q on {device}")


__all__ = ["linear_attention"]
