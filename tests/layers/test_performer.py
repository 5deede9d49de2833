"""The Performer layer (``lintime.layers.performer``, FLASH seed baseline: ReLU kernel, RoPE) against the kernel
formula written out here (random, learned and no features, causal and not), and its random features: a fixed buffer,
orthogonal blocks, drawn per layer."""

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.performer import PerformerAttention
from lintime.layers.positional import apply_rope
from lintime.models import CausalLM, get_preset
from tolerances import assert_exact

D64 = torch.float64


def kernel_formula(layer, x, pos, causal=True):
    """``phi(x) = relu(x W^T / sqrt(M)) + eps`` on RoPE'd q, k; ``o_i = sum_j (phi(q_i).phi(k_j)) v_j
    / sum_j phi(q_i).phi(k_j)`` over ``j <= i`` (dense, one head at a time)."""
    B, T, _ = x.shape
    H, D = layer.n_heads, layer.head_dim
    q, k, v = layer.qkv(x).view(B, T, 3, H, D).unbind(2)
    q, k = apply_rope(q, pos), apply_rope(k, pos)

    def phi(t):
        if layer.projection is not None:
            t = t @ layer.projection.T / layer.num_features**0.5
        return F.relu(t) + layer.feature_eps

    outs = []
    for h in range(H):
        A = phi(q[:, :, h]) @ phi(k[:, :, h]).transpose(1, 2)
        if causal:
            A = A.tril()
        outs.append(A @ v[:, :, h] / A.sum(-1, keepdim=True))
    return layer.out(torch.stack(outs, 2).reshape(B, T, H * D))


@pytest.mark.parametrize("features", ["random", "learned", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_layer_is_the_kernel_formula(features, causal):
    layer = PerformerAttention(32, 4, features=features, num_features=12, causal=causal, chunk_size=4).double()
    x = torch.randn(2, 11, 32, dtype=D64)
    pos = torch.arange(11).expand(2, 11)
    y, _ = layer(x, positions=pos)
    assert_exact(f"performer {features} causal={causal}", kernel_formula(layer, x, pos, causal), y)


def test_random_features_are_a_fixed_buffer():
    a = PerformerAttention(32, 4, num_features=20, feature_seed=3)
    b = PerformerAttention(32, 4, num_features=20, feature_seed=3)
    c = PerformerAttention(32, 4, num_features=20, feature_seed=4)
    assert torch.equal(a.projection, b.projection) and not torch.equal(a.projection, c.projection)
    assert "projection" in a.state_dict() and "projection" not in dict(a.named_parameters())
    assert a.projection.shape == (20, 8)
    # orthogonal blocks: the first D rows are orthogonal directions
    w = a.projection[:8] / a.projection[:8].norm(dim=1, keepdim=True)
    assert torch.allclose(w @ w.T, torch.eye(8), atol=1e-5)
    learned = PerformerAttention(32, 4, features="learned", num_features=20)
    assert learned.projection.requires_grad and learned.no_weight_decay() == {"projection"}
    # layers of a model draw different features (seed + layer index)
    m = CausalLM(get_preset("performer-tiny"))
    p0, p1 = (blk.mixer.projection for blk in m.backbone.blocks)
    assert not torch.equal(p0, p1)
