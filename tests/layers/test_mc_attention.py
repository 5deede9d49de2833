"""The mixed-chunk layer (``lintime.layers.mc_attention``, MC-TFM++'s mixer) against its formula written as dense
matrices: local softmax inside chunks + linear attention over earlier chunks, per head, every ``linear_norm``."""

import math

import pytest
import torch

from lintime.layers.mc_attention import MixedChunkMHA
from lintime.layers.positional import apply_rope
from tolerances import assert_exact


# ----------------------------------------------------------------------------- the formula
def _by_hand(layer: MixedChunkMHA, x, causal, linear_norm):
    B, T, _ = x.shape
    H, K, C = layer.n_heads, layer.head_dim, layer.chunk_size
    q, k, v = layer.qkv(x).view(B, T, 3, H, K).unbind(2)
    ql = q * layer.lin_scale[0] + layer.lin_offset[0]
    kl = k * layer.lin_scale[1] + layer.lin_offset[1]
    pos = torch.arange(T).expand(B, T)
    q, k, ql, kl = (apply_rope(t, pos).transpose(1, 2) for t in (q, k, ql, kl))  # [B, H, T, K]
    v = v.transpose(1, 2)
    i = torch.arange(T)
    same_chunk = (i[:, None] // C) == (i[None, :] // C)
    local_mask = same_chunk & (i[None, :] <= i[:, None]) if causal else same_chunk
    a = (q @ k.transpose(-1, -2) / math.sqrt(K)).masked_fill(~local_mask, -math.inf)
    local = torch.softmax(a, -1) @ v
    # linear: ql_i . sum_{j < s(c(i))} kl_j^T v_j / N_i (seed Eq. 8), all j when not causal (Eq. 7)
    if causal:
        lin_mask = i[None, :] < (i[:, None] // C) * C
        n_tokens = ((i // C) * C).to(x.dtype)[:, None]
    else:
        lin_mask = torch.ones(T, T, dtype=torch.bool)
        n_tokens = torch.full((T, 1), float(T), dtype=x.dtype)
    w = (ql @ kl.transpose(-1, -2)) * lin_mask
    if linear_norm == "tokens":
        w = torch.where(n_tokens > 0, w / n_tokens.clamp(min=1), torch.zeros_like(w))
    elif linear_norm == "chunk":
        w = w / C
    o = (local + w @ v).transpose(1, 2).reshape(B, T, H * K)
    return layer.out(o)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("linear_norm", ["tokens", "chunk", "none"])
def test_layer_matches_its_formula(causal, linear_norm):
    torch.manual_seed(0)
    layer = MixedChunkMHA(16, 2, chunk_size=5, causal=causal, linear_norm=linear_norm).double()
    with torch.no_grad():
        layer.lin_scale.normal_()
        layer.lin_offset.normal_()
    x = torch.randn(2, 23, 16, dtype=torch.float64)  # 4 full chunks and a partial one
    y, state = layer(x, positions=torch.arange(23).expand(2, 23))
    assert state is None
    assert_exact(f"MC-TFM++ {causal} {linear_norm}", _by_hand(layer, x, causal, linear_norm), y)

