"""Linear self-attention (seed ``linear-self-attention-is-faster.txt``): multi-head attention of
GPT-2 with the exponential removed, ``e^{K_j^T Q_i} -> phi(K_j)^T phi(Q_i)``.

Notation: ``B`` batch, ``T`` new tokens, ``H`` heads, ``K`` head width of q / k (after the
feature map), ``V`` head width of v, ``N`` sequences (rows of the state: ``B``, or the number of
packed sequences with ``cu_seqlens``).

The positive feature map ``phi`` keeps every ``phi(q_i) . phi(k_j) > 0`` so that the seed's
normaliser (``o_i = q_i S_i / q_i . z_i``, docs/design/contract.md §2.4) never divides by zero or flips sign:

* ``elu``      ``elu(x) + 1`` (> 0 everywhere; the default, Katharopoulos et al.);
* ``relu``     ``relu(x) + eps`` (``eps`` > 0: a row of all-negative inputs would otherwise
               give ``0 / 0``; Performer's ``numerical_stabilizer``);
* ``identity`` ``x`` itself, allowed only with the normaliser off (``q . z`` can be zero or
               negative; the check is in the config / constructor, not a device sync at run time).

The sums ``S_i = sum_{j<=i} phi(k_j)^T v_j`` and ``z_i = sum_{j<=i} phi(k_j)`` are the decoding
state (:class:`LinearAttentionState`): ``O(H K V)`` per sequence, constant in ``T``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.layers.base import BatchState, Mixer
from lintime.ops import linear_attention
from lintime.ops.linear import AUTO_TRITON_MAX_HEAD

FEATURE_MAPS = ("elu", "relu", "identity")


def feature_map(x: torch.Tensor, kind: str, eps: float = 0.0) -> torch.Tensor:
    """``phi(x)`` elementwise (see the module docstring for the kinds)."""
    if kind == "elu":
        return F.elu(x) + 1.0
    if kind == "relu":
        return F.relu(x) + eps
    if kind == "identity":
        return x
    raise ValueError(f"unknown feature map {kind!r}; choose from {FEATURE_MAPS}")


def check_feature_map(where: str, kind: str, normalize: bool, eps: float) -> None:
    """The checks shared by the linear-attention layers and their configs (clear messages)."""
    if kind not in FEATURE_MAPS:
        raise ValueError(f"{where}: feature_map must be one of {FEATURE_MAPS}, got {kind!r}")
    if not isinstance(normalize, bool):
        raise ValueError(f"{where}: normalize must be a bool, got {normalize!r}")
    if kind == "identity" and normalize:
        raise ValueError(
            f"{where}: feature_map='identity' needs normalize=False (q . z is not positive without "
            f"a positive feature map, the normaliser would divide by ~0); use 'elu' or 'relu'"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"{where}: feature_eps must be a number >= 0, got {eps!r}")
    if kind == "relu" and normalize and eps <= 0:
        raise ValueError(
            f"{where}: feature_map='relu' with normalize=True needs feature_eps > 0 (an all-negative "
            f"row gives relu(q) . z = 0 and the normaliser divides 0 by 0)"
        )


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The ops keep their sums in fp32 (fp64 for fp64 inputs), docs/design/contract.md §1."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclasses.dataclass
class LinearAttentionState(BatchState):
    """Decoding state of :class:`LinearAttention` and :class:`~lintime.layers.performer.PerformerAttention`.

    ``kv``     ``[N, H, K, V]`` fp32 (fp64 for fp64 models): ``sum_j phi(k_j)^T v_j``;
    ``k_sum``  ``[N, H, K]`` the normaliser's ``sum_j phi(k_j)``, or ``None`` when the layer
               does not normalise.

    Both are the op's own state (``linear_attention(..., output_final_state=True)``); the size
    does not depend on the number of tokens consumed.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor | None = None

    def op_state(self):
        return self.kv if self.k_sum is None else (self.kv, self.k_sum)

    @classmethod
    def from_op(cls, state) -> "LinearAttentionState":
        return cls(*state) if isinstance(state, tuple) else cls(state)


def linear_mix(q, k, v, state, *, causal, normalize, scale, chunk_size, cu_seqlens, where):
    """Run :func:`lintime.ops.linear_attention` on feature-mapped ``q, k`` (``[B, T, H, K]``),
    continuing ``state`` (``None``: a full-sequence call, no state kept)."""
    if state is None:
        o, _ = linear_attention(q, k, v, causal=causal, normalize=normalize, scale=scale,
                                chunk_size=chunk_size, cu_seqlens=cu_seqlens)
        return o, None
    if not causal:
        raise ValueError(f"{where}: a decoding state needs causal attention")
    if not isinstance(state, LinearAttentionState) or (state.k_sum is None) == normalize:
        raise TypeError(f"{where}: expected a LinearAttentionState {'with' if normalize else 'without'} "
                        f"k_sum, got {state!r:.80}")
    o, new = linear_attention(q, k, v, causal=True, normalize=normalize, scale=scale, chunk_size=chunk_size,
                              initial_state=state.op_state(), output_final_state=True, cu_seqlens=cu_seqlens)
    return o, LinearAttentionState.from_op(new)


def empty_linear_state(N, H, K, V, normalize, device, dtype) -> LinearAttentionState:
    sd = state_dtype(dtype)
    kv = torch.zeros(N, H, K, V, device=device, dtype=sd)
    return LinearAttentionState(kv, torch.zeros(N, H, K, device=device, dtype=sd) if normalize else None)


class LinearAttention(Mixer):
    """GPT-2's multi-head attention with the exponential removed (seed Section 0.1).

    ``q, k, v = dense(x)`` split into ``H`` heads of width ``K = head_dim``;
    ``o = linear_attention(phi(q), phi(k), v, normalize=normalize)``; ``y = dense(o)``.
    The chunked form trains (``chunk_size``, seed "chunked mode"), the recurrent form decodes.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        feature_map: str = "elu",
        feature_eps: float = 1e-3,
        normalize: bool = True,
        causal: bool = True,
        chunk_size: int = 64,
        bias: bool = True,
    ):
        super().__init__()
        if head_dim is None:
            if dim % n_heads:
                raise ValueError(f"LinearAttention: dim {dim} is not divisible by n_heads {n_heads}")
            head_dim = dim // n_heads
        check_feature_map("LinearAttention", feature_map, normalize, feature_eps)
        self.dim, self.n_heads, self.head_dim = dim, n_heads, head_dim
        self.feature_map, self.feature_eps, self.normalize = feature_map, float(feature_eps), normalize
        self.causal, self.chunk_size = causal, chunk_size
        self.qkv = nn.Linear(dim, 3 * n_heads * head_dim, bias=bias)
        self.out = nn.Linear(n_heads * head_dim, dim, bias=bias)

    def forward(self, x, state=None, *, positions, cu_seqlens=None, aux_losses=None):
        B, T, _ = x.shape
        H, K = self.n_heads, self.head_dim
        q, k, v = self.qkv(x).view(B, T, 3, H, K).unbind(2)  # [B, T, H, K] each
        q = feature_map(q, self.feature_map, self.feature_eps)
        k = feature_map(k, self.feature_map, self.feature_eps)
        o, new_state = linear_mix(q, k, v, state, causal=self.causal, normalize=self.normalize, scale=None,
                                  chunk_size=self.chunk_size, cu_seqlens=cu_seqlens, where="LinearAttention")
        return self.out(o.reshape(B, T, H * K)), new_state

    def static_packing(self) -> bool:
        """The op's Triton path plans a static ``cu_seqlens`` on the device; heads wider than the automatic choice
        sends there (:data:`~lintime.ops.linear.AUTO_TRITON_MAX_HEAD`), and fp64 weights, go to the chunked form,
        which reads it."""
        return self.head_dim <= AUTO_TRITON_MAX_HEAD and self.qkv.weight.dtype != torch.float64

    def init_state(self, batch_size, device, dtype) -> LinearAttentionState:
        K = self.head_dim
        return empty_linear_state(batch_size, self.n_heads, K, K, self.normalize, device, dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_dim={self.head_dim}, feature_map={self.feature_map}, "
                f"normalize={self.normalize}, causal={self.causal}")


__all__ = ["LinearAttention", "LinearAttentionState", "feature_map", "FEATURE_MAPS"]
