"""The linear attention layer (``lintime.layers.linear_attention``) against the seed's formula
(``linear-self-attention-is-faster.txt`` Section 0.1 with footnote 1) written out here, every feature map, normalised
or not, causal and not."""

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.linear_attention import LinearAttention
from tolerances import assert_exact

D64 = torch.float64


def seed_formula(layer, x, causal=True):
    """Seed Section 0.1 with footnote 1: ``Y_i = sum_{j<=i} (phi(K_j)^T phi(Q_i)) V_j``, divided by
    ``sum_{j<=i} phi(K_j)^T phi(Q_i)`` when normalised; one head at a time, dense masked matrices."""
    B, T, _ = x.shape
    H, K = layer.n_heads, layer.head_dim
    q, k, v = layer.qkv(x).view(B, T, 3, H, K).unbind(2)
    phi = {"elu": lambda t: F.elu(t) + 1, "relu": lambda t: F.relu(t) + layer.feature_eps,
           "identity": lambda t: t}[layer.feature_map]
    outs = []
    for h in range(H):
        A = phi(q[:, :, h]) @ phi(k[:, :, h]).transpose(1, 2) * K**-0.5  # [B, T, T], no exponential
        if causal:
            A = A * torch.ones(T, T, dtype=torch.bool).tril()
        o = A @ v[:, :, h]
        if layer.normalize:
            o = o / A.sum(-1, keepdim=True)
        outs.append(o)
    return layer.out(torch.stack(outs, 2).reshape(B, T, H * K))


@pytest.mark.parametrize("fmap,normalize", [("elu", True), ("relu", True), ("elu", False), ("identity", False)])
@pytest.mark.parametrize("causal", [True, False])
def test_layer_is_the_seed_formula(fmap, normalize, causal):
    layer = LinearAttention(24, 3, feature_map=fmap, normalize=normalize, causal=causal, chunk_size=5).double()
    x = torch.randn(2, 13, 24, dtype=D64)
    y, state = layer(x, positions=torch.arange(13).expand(2, 13))
    assert state is None
    assert_exact(f"linear {fmap} norm={normalize} causal={causal}", seed_formula(layer, x, causal), y)
