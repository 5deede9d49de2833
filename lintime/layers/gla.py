"""Gated linear attention layer (seed ``gated-linear-attention-zh.txt`` §4.4, "GLA Transformer").

Notation: ``B`` batch, ``T`` new tokens, ``d`` model width, ``H`` heads, ``K`` key width per head
(``expand_k * d / H``), ``V`` value width per head (``expand_v * d / H``), ``R`` gate rank,
``N`` sequences (rows of the state).

Per token (seed §4.4, multi-head GLA)::

    q, k = x W_Q, x W_K                          [H, K]   (d_k = d/2 in total)
    v    = x W_V                                 [H, V]   (d_v = d)
    alpha = sigmoid(x W_a1 W_a2 + b_a) ** (1/tau)        low-rank gate, W_a1 [d, R=16], tau = 16
    g    = log(alpha) = logsigmoid(x W_a1 W_a2 + b_a) / tau   (log space: what the op takes)
    S_t  = diag(alpha_t) S_{t-1} + k_t^T v_t,  o_t = q_t S_t / sqrt(K)   (docs/design/contract.md §2.5)
    r    = silu(x W_r)                           output gate
    y    = (r * concat_h norm(o_h)) W_O          per-head norm (LayerNorm in the seed)

Parameters: ``W_Q, W_K`` ``d x d/2``, ``W_V, W_r, W_O`` ``d x d``: ``4 d^2`` plus the gate's
``R (d + d_k) + d_k`` -- the seed's "about 4d^2, like a softmax attention layer".  The seed's
prose also calls ``W_r`` low-rank, but then the layer would hold ``3 d^2``; we follow the stated
``4 d^2`` total (and the authors' released code) with a full-rank ``W_r``.  No biases except the
gate's ``b_a`` (LLaMA-style, as the seed's Transformer++ comparison).

The decoding state is the op's own ``[N, H, K, V]`` fp32 tensor ``S``: constant in ``T``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.layers.base import Mixer
from lintime.layers.linear_attention import state_dtype
from lintime.layers.norms import build_norm
from lintime.ops import gated_linear_attention
from lintime.ops.utils.launching import MAX_HEAD_DIM

HEAD_NORMS = ("layernorm", "rmsnorm")


class GatedLinearAttention(Mixer):
    """Multi-head GLA (see the module docstring).  Causal only (the recurrence has no
    bidirectional form); the block's SwiGLU FFN is the model's ``FFNConfig``."""

    def __init__(
        self,
        dim: int,
        n_heads: int = 4,
        *,
        expand_k: float = 0.5,
        expand_v: float = 1.0,
        gate_rank: int = 16,
        gate_temperature: float = 16.0,
        head_norm: str = "layernorm",
        norm_eps: float = 1e-5,
        output_gate: bool = True,
        causal: bool = True,
        chunk_size: int = 64,
    ):
        super().__init__()
        if not causal:
            raise ValueError("GatedLinearAttention is causal only (a gated recurrence); it cannot build a "
                             "bidirectional / masked-LM mixer")
        key_dim, value_dim = round(expand_k * dim), round(expand_v * dim)
        if key_dim % n_heads or value_dim % n_heads:
            raise ValueError(f"GatedLinearAttention: key width {key_dim} and value width {value_dim} must be "
                             f"divisible by n_heads={n_heads}")
        if head_norm not in HEAD_NORMS:
            raise ValueError(f"GatedLinearAttention: head_norm must be one of {HEAD_NORMS}, got {head_norm!r}")
        self.dim, self.n_heads = dim, n_heads
        self.head_k, self.head_v = key_dim // n_heads, value_dim // n_heads
        self.gate_temperature, self.causal, self.chunk_size = float(gate_temperature), causal, chunk_size
        self.q_proj = nn.Linear(dim, key_dim, bias=False)
        self.k_proj = nn.Linear(dim, key_dim, bias=False)
        self.v_proj = nn.Linear(dim, value_dim, bias=False)
        # low-rank gate x W_a1 W_a2 + b_a (seed §4.4 "parameter allocation")
        self.gate_down = nn.Linear(dim, gate_rank, bias=False)
        self.gate_up = nn.Linear(gate_rank, key_dim, bias=True)
        self.r_proj = nn.Linear(dim, value_dim, bias=False) if output_gate else None
        # one norm over each head's V features, its gain shared by the heads
        self.head_norm = build_norm(head_norm, self.head_v, norm_eps)
        self.out = nn.Linear(value_dim, dim, bias=False)
        # the head norm and the output gate in one pass per direction (Norm.gated_forward); False: the norm, then
        # the gate as separate passes (CausalLM.set_fused)
        self.fused = True

    def log_gate(self, x: torch.Tensor) -> torch.Tensor:
        """``g = log(alpha) = logsigmoid(x W_a1 W_a2 + b_a) / tau`` ``[B, T, H, K]``, in fp32 (the op
        sums it in log space; ``<= 0`` always)."""
        B, T, _ = x.shape
        logit = self.gate_up(self.gate_down(x)).to(state_dtype(x.dtype))
        return (F.logsigmoid(logit) / self.gate_temperature).view(B, T, self.n_heads, self.head_k)

    def forward(self, x, state=None, *, positions, cu_seqlens=None, aux_losses=None):
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_k, self.head_v
        q = self.q_proj(x).view(B, T, H, K)
        k = self.k_proj(x).view(B, T, H, K)
        v = self.v_proj(x).view(B, T, H, V)
        g = self.log_gate(x)
        if state is not None and not isinstance(state, torch.Tensor):
            raise TypeError(f"GatedLinearAttention: the state is the op's [N, H, K, V] tensor, got "
                            f"{type(state).__name__}")
        o, new_state = gated_linear_attention(
            q, k, v, g, chunk_size=self.chunk_size, initial_state=state,
            output_final_state=state is not None, cu_seqlens=cu_seqlens,
        )  # o [B, T, H, V]
        if self.r_proj is None:
            o = self.head_norm(o)
        elif self.fused:
            o = self.head_norm.gated_forward(o, self.r_proj(x).view(B, T, H, V))
        else:
            o = self.head_norm(o) * F.silu(self.r_proj(x)).view(B, T, H, V)
        return self.out(o.reshape(B, T, H * V)), new_state

    def static_packing(self) -> bool:
        """The op's Triton path plans a static ``cu_seqlens`` on the device (heads narrower than its tiles padded to
        them); heads wider than the kernels take, and fp64 weights, go to the chunked form, which reads it."""
        return max(self.head_k, self.head_v) <= MAX_HEAD_DIM and self.q_proj.weight.dtype != torch.float64

    def init_state(self, batch_size, device, dtype) -> torch.Tensor:
        """Empty ``S``: ``[N, H, K, V]`` zeros, fp32 (fp64 for fp64 models)."""
        return torch.zeros(batch_size, self.n_heads, self.head_k, self.head_v, device=device,
                           dtype=state_dtype(dtype))

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, head_k={self.head_k}, head_v={self.head_v}, "
                f"gate_rank={self.gate_down.out_features}, tau={self.gate_temperature}")


__all__ = ["GatedLinearAttention", "HEAD_NORMS"]
