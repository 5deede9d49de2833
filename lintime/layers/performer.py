"""Performer attention with the ReLU kernel (Choromanski et al. 2020), the FLASH seed's linear
baseline (Section 4, Tables 8-9: "Attention kernel relu, Attention type Linear", augmented with
RoPE, 12 heads, MLP + GELU).

Notation: ``B`` batch, ``T`` new tokens, ``H`` heads, ``D`` head width of q / k / v, ``M``
features of the kernel, ``N`` sequences (rows of the state).

``phi(x) = relu(x W^T / sqrt(M)) + eps`` (Performer's generalised-attention ReLU kernel with its
``numerical_stabilizer`` ``eps``), then causal linear attention with the normaliser
(:func:`lintime.ops.linear_attention`, docs/design/contract.md §2.4).  The projection ``W [M, D]`` (shared by the
heads of a layer) is one of

* ``random``  a fixed Gaussian orthogonal random matrix (Performer's default construction:
              orthogonal blocks, rows rescaled to chi-distributed norms), a *buffer* drawn from a
              generator seeded by ``feature_seed + layer_idx`` -- reproducible, saved in the
              state dict, never trained and never redrawn (a redraw would change the function
              the decoding state summarises);
* ``learned`` the same shape as a trainable parameter (init ``N(0, 1)`` like ``random``);
* ``none``    no projection, ``phi(x) = relu(x) + eps`` (Performer's ``deterministic``
              features; ``M = D``).

RoPE (the seed's augmentation) rotates q and k *before* the feature map: after it the features
would no longer be non-negative and the normaliser could vanish.
The decoding state is :class:`~lintime.layers.linear_attention.LinearAttentionState`:
``[N, H, M, D]`` plus ``[N, H, M]``, constant in ``T``.

On CUDA the presets' ``M`` (128, 256) is above
:data:`lintime.ops.linear.AUTO_TRITON_MAX_HEAD`, so the op runs its chunked / recurrent PyTorch
forms: the wide-head Triton kernels failed on a GPU with an illegal memory access (performer
training and decoding) and are not used automatically until verified on a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.layers.base import Mixer
from lintime.layers.linear_attention import (
    LinearAttentionState,
    empty_linear_state,
    linear_mix,
)
from lintime.layers.positional import apply_rope

FEATURES = ("random", "learned", "none")


def gaussian_orthogonal_matrix(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """``[rows, cols]`` fp32 on the CPU: stacked ``cols x cols`` orthogonal blocks (QR of Gaussian
    matrices), each row rescaled to the norm of a Gaussian ``cols``-vector (Performer's
    ``gaussian_orthogonal_random_matrix`` with ``scaling=0``)."""
    blocks = []
    for _ in range(math.ceil(rows / cols)):
        g = torch.randn(cols, cols, generator=generator, device="cpu")
        q, _ = torch.linalg.qr(g)
        blocks.append(q.T)
    w = torch.cat(blocks, 0)[:rows]
    norms = torch.randn(rows, cols, generator=generator, device="cpu").norm(dim=1)
    return w * norms[:, None]


class PerformerAttention(Mixer):
    """Multi-head Performer attention, ReLU kernel (see the module docstring)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        head_dim: int | None = None,
        features: str = "random",
        num_features: int | None = 256,
        feature_eps: float = 1e-3,
        feature_seed: int = 0,
        rope: bool = True,
        rope_base: float = 10000.0,
        causal: bool = True,
        chunk_size: int = 64,
        bias: bool = True,
    ):
        super().__init__()
        if head_dim is None:
            if dim % n_heads:
                raise ValueError(f"PerformerAttention: dim {dim} is not divisible by n_heads {n_heads}")
            head_dim = dim // n_heads
        if features not in FEATURES:
            raise ValueError(f"PerformerAttention: features must be one of {FEATURES}, got {features!r}")
        if not feature_eps > 0:
            raise ValueError(f"PerformerAttention: feature_eps must be > 0 (normaliser), got {feature_eps!r}")
        if features == "none":
            num_features = head_dim
        elif num_features is None or num_features < 1:
            raise ValueError(f"PerformerAttention: features={features!r} needs num_features >= 1")
        self.dim, self.n_heads, self.head_dim, self.num_features = dim, n_heads, head_dim, num_features
        self.features, self.feature_eps = features, float(feature_eps)
        self.rope, self.rope_base, self.causal, self.chunk_size = rope, rope_base, causal, chunk_size
        self.qkv = nn.Linear(dim, 3 * n_heads * head_dim, bias=bias)
        self.out = nn.Linear(n_heads * head_dim, dim, bias=bias)
        if features != "none":
            gen = torch.Generator(device="cpu").manual_seed(int(feature_seed))
            w = gaussian_orthogonal_matrix(num_features, head_dim, gen)  # [M, D]
            if features == "random":
                self.register_buffer("projection", w)
            else:  # the model's blanket init touches only nn.Linear / nn.Embedding: w keeps this init
                self.projection = nn.Parameter(w)
        else:
            self.projection = None

    def no_weight_decay(self) -> set[str]:
        # random-feature directions, not a dense layer: decaying them would shrink the kernel
        return {"projection"} if self.features == "learned" else set()

    def _phi(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, D]`` -> ``[B, T, H, M]`` non-negative features (+ eps)."""
        if self.projection is not None:
            x = torch.einsum("bthd,md->bthm", x, self.projection.to(x.dtype)) * self.num_features**-0.5
        return F.relu(x) + self.feature_eps

    def forward(self, x, state=None, *, positions, cu_seqlens=None, aux_losses=None):
        B, T, _ = x.shape
        H, D = self.n_heads, self.head_dim
        q, k, v = self.qkv(x).view(B, T, 3, H, D).unbind(2)  # [B, T, H, D] each
        if self.rope:
            q = apply_rope(q, positions, self.rope_base)
            k = apply_rope(k, positions, self.rope_base)
        o, new_state = linear_mix(self._phi(q), self._phi(k), v, state, causal=self.causal, normalize=True,
                                  scale=None, chunk_size=self.chunk_size, cu_seqlens=cu_seqlens,
                                  where="PerformerAttention")
        return self.out(o.reshape(B, T, H * D)), new_state

    def init_state(self, batch_size, device, dtype) -> LinearAttentionState:
        return empty_linear_state(batch_size, self.n_heads, self.num_features, self.head_dim, True, device, dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_dim={self.head_dim}, features={self.features}, "
                f"num_features={self.num_features}, rope={self.rope}, causal={self.causal}")


__all__ = ["PerformerAttention", "gaussian_orthogonal_matrix"]
