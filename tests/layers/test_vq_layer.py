"""The Transformer-VQ layer (``lintime.layers.vq``) against seed Definition 3.1 written out as a dense quadratic
formula; the EMA k-means codebook (towards the assigned keys, exact update rule, lowering the quantisation error);
the commitment loss's gradient (to k only); straight-through key gradients (exact inside the window; the seed's
detached codebook beyond it).

(Not ``test_vq.py``: that basename belongs to ``tests/ops/``.)"""

import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.vq import VQAttention
from tolerances import assert_exact


def _layer(H=1, rel_bias=True, L=4, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    layer = VQAttention(16, key_dim=6, value_dim=24, n_codes=5, block_len=L, n_heads=H, rel_bias=rel_bias,
                        sin_base=50.0, **kw).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def _seed_reference(layer: VQAttention, x):
    """Seed Definition 3.1 (Eqs. 8-15 without the block's norm and residual) with the XL bias,
    as a dense causal softmax over all ``T`` keys, one head at a time.  ``x [B, T, d]``, one
    sequence per row starting at position 0."""
    B, T, d = x.shape
    H, K, E, L = layer.H, layer.K, layer.E, layer.L
    tau = math.sqrt(K)
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).add(layer.norm_eps).sqrt()
    Wk, Wv, Wg = layer.kvg_proj.weight.split([H * K, H * E, H * E])
    q = rms((x @ layer.q_proj.weight.T).view(B, T, H, K)) / math.sqrt(tau)  # Eq. 8
    k = rms((x @ Wk.T).view(B, T, H, K)) / math.sqrt(tau)  # Eq. 9
    v = F.silu(x @ Wv.T).view(B, T, H, E)  # Eq. 10
    g = F.silu(x @ Wg.T)  # Eq. 11
    C = layer.codebook_sum / layer.codebook_count[..., None]  # counts are 1 here: no clip
    i = torch.arange(T)
    dist = i[:, None] - i[None, :]  # [T, T] i - j
    out = []
    for h in range(H):
        z = ((k[:, :, h, None, :] - C[h]) ** 2).sum(-1).argmin(-1)  # Eq. 5, [B, T]
        k_hat = C[h][z]  # Eq. 12 (forward value)
        scores = q[:, :, h] @ k_hat.transpose(1, 2)  # [B, T, T]
        if layer.r_proj is not None:
            u = layer.xl_u[h] / math.sqrt(tau)
            vv = layer.xl_v[h] / math.sqrt(tau)
            m = torch.arange(T, dtype=x.dtype)[:, None]
            f = layer.sin_base ** -(torch.arange(d // 2, dtype=x.dtype) / (d // 2))
            sin = torch.cat([torch.sin(m * f), torch.cos(m * f)], -1)  # [T, d], distance m
            r = (sin @ layer.r_proj.weight.T).view(T, H, K)[:, h] / math.sqrt(tau)  # [T, K]
            content = (q[:, :, h] + u) @ k_hat.transpose(1, 2)
            position = torch.einsum("bik,ijk->bij", q[:, :, h] + vv, r[dist.clamp(0, T - 1)])
            scores = content + position * ((dist >= 0) & (dist <= L))  # Theorem 3.6 window
        scores = scores.masked_fill(dist < 0, -math.inf)  # causal
        out.append(torch.softmax(scores, -1) @ v[:, :, h])  # Eq. 13
    o = torch.stack(out, 2).reshape(B, T, H * E)
    return (o * g) @ layer.out.weight.T  # Eqs. 14-15


@pytest.mark.parametrize("H,rel_bias", [(1, True), (2, True), (1, False)])
def test_layer_is_seed_definition(H, rel_bias):
    """Linear-time layer (blocks of 4, compressed cache from block 2 on) == the quadratic
    definition, fp64, T = 19 (four full blocks and a partial one)."""
    layer = _layer(H, rel_bias).eval()
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    y, state = layer(x, positions=torch.arange(19).expand(2, 19))
    assert state is None
    assert_exact(f"VQAttention vs Definition 3.1 H={H} xl={rel_bias}", _seed_reference(layer, x), y)


def test_codebook_ema_moves_used_codes_toward_their_keys():
    """One training-mode call: ``count <- g count + (1-g) n``, ``sum <- g sum + (1-g) sum of keys``;
    every used codeword gets closer to the mean of its assigned keys (a convex combination of the
    old codeword and that mean); unused codewords keep their value."""
    layer = _layer(H=2, rel_bias=True, gamma=0.9)
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    pos = torch.arange(11).expand(3, 11)
    c0 = layer.codebook().clone()
    n0, s0 = layer.codebook_count.clone(), layer.codebook_sum.clone()
    q, k, v, g = layer.project(x)
    codes, _, _ = layer.quantize(k, c0)
    layer.train()
    layer(x, positions=pos)
    c1 = layer.codebook()
    for h in range(2):
        for s in range(layer.S):
            mask = codes[..., h] == s
            n = int(mask.sum())
            ksum = k.detach()[..., h, :][mask].sum(0)
            assert torch.allclose(layer.codebook_count[h, s], 0.9 * n0[h, s] + 0.1 * n)
            assert torch.allclose(layer.codebook_sum[h, s], 0.9 * s0[h, s] + 0.1 * ksum)
            if n == 0:
                assert torch.allclose(c1[h, s], c0[h, s])
                continue
            mean = ksum / n
            w = 0.9 * n0[h, s] / (0.9 * n0[h, s] + 0.1 * n)
            assert torch.allclose(c1[h, s], w * c0[h, s] + (1 - w) * mean)
            assert (c1[h, s] - mean).norm() < (c0[h, s] - mean).norm()


def test_kmeans_lowers_the_quantisation_error():
    """Repeated training-mode calls on the same keys are EMA k-means: the mean squared distance of
    the keys to their codewords falls."""
    layer = _layer(H=1, rel_bias=False, gamma=0.5).train()
    x = torch.randn(4, 16, 16, dtype=torch.float64)
    pos = torch.arange(16).expand(4, 16)
    with torch.no_grad():
        k = layer.project(x)[1]
        err = []
        for _ in range(8):
            _, _, c_z = layer.quantize(k, layer.codebook())
            err.append((k - c_z).pow(2).sum(-1).mean().item())
            layer(x, positions=pos)
    assert err[-1] < 0.5 * err[0], err


# ----------------------------------------------------------------------------- losses and gradients
def _commit(layer, x):
    """Seed Eq. 37 for one layer, from its keys only."""
    k = layer.project(x)[1]
    c_z = layer.quantize(k, layer.codebook())[2]
    return (k - c_z).pow(2).sum((-2, -1)).mean()


def test_commitment_gradient_flows_through_k_only():
    """d commit / d x of one layer is the gradient through its keys alone; W_V, W_G, W_Q, W_O and the XL
    parameters get none."""
    layer = _layer(H=2).eval()  # (training mode would move the codebook under the check)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    aux = {}
    layer(x, positions=torch.arange(9).expand(2, 9), aux_losses=aux)
    aux["vq_commit"].backward()
    assert_exact("d commit / d x (through k alone)", torch.autograd.grad(_commit(layer, x), x)[0], x.grad)
    assert torch.count_nonzero(layer.kvg_proj.weight.grad[2 * 6:]) == 0
    for p in (layer.q_proj.weight, layer.out.weight, layer.r_proj.weight, layer.xl_u, layer.xl_v):
        assert p.grad is None or torch.count_nonzero(p.grad) == 0


def _key_value_grads(layer, x, pos, backend, queries):
    """Gradients of ``sum(y[:, queries])`` w.r.t. the layer's keys ``k`` and values ``v``."""
    saved = {}
    project = VQAttention.project.__get__(layer)

    def keep(inp):
        q, k, v, g = project(inp)
        k.retain_grad()
        v.retain_grad()
        saved.update(k=k, v=v)
        return q, k, v, g

    layer.project, layer.backend = keep, backend
    try:
        y, _ = layer(x, positions=pos)
        y[:, queries].sum().backward()
    finally:
        del layer.project
        layer.backend = None
    return saved["k"].grad, saved["v"].grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_straight_through_gradient_reaches_the_key_projection():
    """Inside the two-block window the linear-time layer's gradients are exactly the quadratic
    straight-through ones (the op's naive form): ``d k = d k_hat`` for every key, every parameter
    (W_K included) gets the same gradient."""
    x = torch.randn(2, 8, 16, dtype=torch.float64)  # T = 2L: every key is in every later query's window
    pos = torch.arange(8).expand(2, 8)
    got = _key_value_grads(_layer().eval(), x, pos, None, slice(None))
    ref = _key_value_grads(_layer().eval(), x, pos, "naive", slice(None))
    assert got[0].abs().sum() > 0
    assert_exact("d k (window)", ref[0], got[0])
    assert_exact("d v (window)", ref[1], got[1])
    for name in ref[2]:
        assert_exact(f"d {name}", ref[2][name], got[2][name])
    Wk = got[2]["kvg_proj.weight"][: _layer().H * 6]
    assert Wk.abs().sum() > 0


def test_keys_beyond_the_window_send_no_gradient_to_k():
    """The seed's choice (Code 1, authors' ``get_codebook`` = ``sg(c_sum / c_count)``): a key older
    than the window reaches the query through the detached EMA codebook, so its ``k`` gets no
    gradient from that query, while its value does.  The quadratic form (exact straight-through
    for every key) differs exactly there."""
    x = torch.randn(1, 19, 16, dtype=torch.float64)
    pos = torch.arange(19).expand(1, 19)
    last = slice(16, 19)  # block 4: window = blocks 3 and 4, cache = blocks 0-2 (keys 0..11)
    dk, dv, _ = _key_value_grads(_layer().eval(), x, pos, None, last)
    dk_q, dv_q, _ = _key_value_grads(_layer().eval(), x, pos, "naive", last)
    assert torch.count_nonzero(dk[:, :12]) == 0
    assert dk[:, 12:].abs().sum() > 0 and dk_q[:, :12].abs().sum() > 0
    assert_exact("d k in the window", dk_q[:, 12:], dk[:, 12:])
    assert dv[:, :12].abs().sum() > 0  # values of cached keys do learn (seed Section 3.4.2)
    assert_exact("d v (cache means carry the exact value gradient)", dv_q, dv)


def test_causal_only():
    with pytest.raises(ValueError, match="Transformer-VQ is causal"):
        VQAttention(16, key_dim=4, value_dim=32, causal=False)
