"""The gated linear attention layer (``lintime.layers.gla``, seed ``gated-linear-attention-zh.txt`` §4.4) against the
seed's recurrence written out here, and the gate's parameterisation, widths and parameter count.

(Not ``test_gla.py``: that basename belongs to ``tests/ops/``.)"""

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.gla import GatedLinearAttention
from lintime.layers.norms import LayerNorm, RMSNorm
from tolerances import assert_exact

D64 = torch.float64


def seed_recurrence(layer, x):
    """Seed §4.1 / §4.4, one token at a time: ``alpha_t = sigmoid(x W_a1 W_a2 + b)^(1/16)``,
    ``S_t = diag(alpha_t) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t / sqrt(d_k)``, per-head LayerNorm,
    ``y = (silu(x W_r) * o) W_O``."""
    B, T, _ = x.shape
    H, K, V = layer.n_heads, layer.head_k, layer.head_v
    q = layer.q_proj(x).view(B, T, H, K)
    k = layer.k_proj(x).view(B, T, H, K)
    v = layer.v_proj(x).view(B, T, H, V)
    alpha = torch.sigmoid(layer.gate_up(layer.gate_down(x))) ** (1 / 16)  # seed: tau = 16
    alpha = alpha.view(B, T, H, K)
    S = torch.zeros(B, H, K, V, dtype=x.dtype)
    outs = []
    for t in range(T):
        S = alpha[:, t, :, :, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * K**-0.5)
    o = torch.stack(outs, 1)  # [B, T, H, V]
    o = F.layer_norm(o, (V,), layer.head_norm.weight, layer.head_norm.bias, 1e-5)
    o = o * F.silu(layer.r_proj(x)).view(B, T, H, V)
    return layer.out(o.reshape(B, T, H * V))


def test_layer_is_the_seed_recurrence():
    layer = GatedLinearAttention(32, 4, chunk_size=8).double()
    with torch.no_grad():  # a non-trivial gate bias and norm gain
        layer.gate_up.bias.normal_(0, 2)
        layer.head_norm.weight.normal_()
        layer.head_norm.bias.normal_()
    x = torch.randn(2, 19, 32, dtype=D64)
    y, state = layer(x, positions=torch.arange(19).expand(2, 19))
    assert state is None
    assert_exact("gla layer vs seed recurrence", seed_recurrence(layer, x), y)


def test_gate_and_shapes():
    layer = GatedLinearAttention(64, 4).double()
    x = torch.randn(1, 5, 64, dtype=D64)
    g = layer.log_gate(x)
    ref = torch.sigmoid(layer.gate_up(layer.gate_down(x))).view(1, 5, 4, 8) ** (1 / 16)
    assert_exact("alpha = sigmoid(.)^(1/16)", ref, g.exp())
    assert (g <= 0).all()
    # 4 heads, d_k = d/2 (8 per head), d_v = d (16 per head), gate rank 16
    assert (layer.head_k, layer.head_v, layer.gate_down.out_features) == (8, 16, 16)
    assert isinstance(layer.head_norm, LayerNorm)
    assert isinstance(GatedLinearAttention(64, 4, head_norm="rmsnorm").head_norm, RMSNorm)
    d = 64  # "about 4 d^2" (seed §4.4): W_Q, W_K d x d/2; W_V, W_r, W_O d x d; + the low-rank gate
    n = sum(p.numel() for p in layer.parameters())
    assert n == 4 * d * d + (d * 16 + 16 * d // 2 + d // 2) + 2 * 16


def test_causal_only():
    with pytest.raises(ValueError, match="GatedLinearAttention is causal only"):
        GatedLinearAttention(64, 4, causal=False)
