"""The GAU layer (``lintime.layers.gau``, FLASH-Quad's mixer) against seed Code 6 written out literally, and every
option of the layer (scalings, causal normaliser, Table 1 ablations, RoPE-only) against its formula written densely
here.

(Not ``test_gau.py``: that basename belongs to ``tests/ops/``.)"""

import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.gau import GAU
from lintime.layers.positional import apply_rope
from lintime.models.families.gau import GAUConfig
from tolerances import assert_exact


def _code3_rope(x):
    """Seed Code 3 on ``[B, T, s]`` along axis 1."""
    T, D = x.shape[1], x.shape[-1]
    half = D // 2
    inv_freq = 10000 ** -(torch.arange(half, dtype=x.dtype) / half)
    ang = torch.arange(T, dtype=x.dtype)[:, None] * inv_freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def _code4_direct(w, n):
    """Seed Code 4, ``n < 512`` branch, literally: ``w [2n - 1]`` -> ``[n, n]``."""
    t = F.pad(w, (0, n)).repeat(n)[:-n].reshape(n, 3 * n - 2)
    r = (2 * n - 1) // 2
    return t[:, r:-r]


def _code6(layer: GAU, x, causal, n):
    """Seed Code 6 (without the norm and the residual, which the block owns)."""
    e, s = layer.e, layer.s
    uv = F.silu(x @ layer.proj.weight.T + layer.proj.bias)
    u, v, base = uv.split([e, e, s], -1)
    base = base[..., None, :] * layer.qk.gamma + layer.qk.beta  # '...r,hr->...hr'
    base = torch.stack([_code3_rope(base[..., 0, :]), _code3_rope(base[..., 1, :])], -2)
    q, k = base.unbind(-2)
    qk = torch.einsum("bnd,bmd->bnm", q, k)
    # the seed's vector is indexed by j - i, ours by i - j: the same parameter read backwards
    bias = _code4_direct(layer.rel_bias.weight[0].flip(0), n)[: x.shape[1], : x.shape[1]]
    kernel = torch.relu(qk / n + bias) ** 2
    if causal:
        kernel = kernel * torch.ones_like(kernel[0]).tril()
    out = u * torch.einsum("bnm,bme->bne", kernel, v)
    return out @ layer.out.weight.T + layer.out.bias


@pytest.mark.parametrize("causal", [True, False])
def test_gau_layer_is_code6(causal):
    torch.manual_seed(0)
    n = 24  # Code 6 divides by the call length; our n is the fixed max_len, equal here
    layer = GAU(16, expansion_dim=32, key_dim=8, max_len=n, causal=causal).double()
    with torch.no_grad():
        layer.qk.gamma.normal_()  # the seed init (N(0, 0.02)) makes q.k tiny; test real values
        layer.qk.beta.normal_()
        layer.proj.bias.normal_()
    x = torch.randn(2, n, 16, dtype=torch.float64)
    y, state = layer(x, positions=torch.arange(n).expand(2, n))
    assert state is None
    assert_exact(f"GAU vs Code 6 causal={causal}", _code6(layer, x, causal, n), y)
    # a prefix call gives the prefix: the scale is the fixed max_len, not the call length
    y8, _ = layer(x[:, :8], positions=torch.arange(8).expand(2, 8))
    if causal:
        assert_exact("prefix", y[:, :8], y8)


def _attention_by_hand(layer: GAU, x, **opts):
    """The layer's attention for every option, densely (one sequence per row, causal)."""
    B, T, _ = x.shape
    H, e, s = layer.n_heads, layer.e, layer.s
    h = F.silu(layer.proj(x))
    u, v, z = h.split([e, e, s], -1) if layer.gating else (None, *h.split([e, s], -1))
    q, k = layer.qk(z).unbind(-2)
    pos = torch.arange(T).expand(B, T)
    q = apply_rope(q.view(B, T, H, s // H), pos).transpose(1, 2)  # [B, H, T, s/H]
    k = apply_rope(k.view(B, T, H, s // H), pos).transpose(1, 2)
    vh = v.view(B, T, H, e // H).transpose(1, 2)
    qk = q @ k.transpose(-1, -2)
    b = layer.rel_bias.matrix(T) if layer.rel_bias is not None else 0.0
    t = torch.arange(1, T + 1, dtype=x.dtype)[:, None]  # keys seen by query i: "divide by t"
    N = t if opts["causal_norm"] else layer.max_len
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if opts["kernel"] == "softmax":
        a = torch.softmax((qk / math.sqrt(s // H) + b).masked_fill(~mask, -math.inf), -1)
    elif opts["scaling"] == "n":
        a = torch.relu(qk / N + b) ** 2 * mask
    else:
        a = torch.relu(qk / math.sqrt(s // H) + b) ** 2 * mask / N
    o = (a @ vh).transpose(1, 2).reshape(B, T, e)
    return layer.out(u * o if layer.gating else o)


OPTIONS = [
    dict(),
    dict(scaling="ns"),
    dict(causal_norm=True),
    dict(scaling="ns", causal_norm=True),
    dict(kernel="softmax"),
    dict(n_heads=2),
    dict(gating=False),
    dict(rel_bias=False),
    dict(max_len=48),  # a direct bias table (max_len < 512)
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "seed")
def test_every_option_matches_its_formula(opts):
    torch.manual_seed(0)
    c = GAUConfig(s=16, **opts)
    layer = GAU(32, expansion_dim=64, key_dim=16, max_len=c.max_len, kernel=c.kernel, scaling=c.resolved_scaling,
                causal_norm=c.causal_norm, n_heads=c.n_heads, gating=c.gating, rel_bias=c.rel_bias).double()
    with torch.no_grad():
        layer.qk.gamma.normal_()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    y, _ = layer(x, positions=torch.arange(21).expand(2, 21))
    full = dict(kernel=c.kernel, scaling=c.resolved_scaling, causal_norm=c.causal_norm)
    assert_exact(f"GAU {opts}", _attention_by_hand(layer, x, **full), y)

