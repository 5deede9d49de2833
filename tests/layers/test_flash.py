"""The FLASH layer (``lintime.layers.flash``) against seed Code 8 written out literally (every ``linear_norm``, both
scalings, causal and not), first-to-all against its formula, and a decoding state refused by a bidirectional layer."""

import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.flash import FLASH
from lintime.layers.positional import apply_rope
from tolerances import assert_exact


# ----------------------------------------------------------------------------- seed Code 8
def _code8(layer: FLASH, x, causal, linear_norm="tokens", scaling="n"):
    """Seed Code 8 on ``x [B, g * n, d]`` (one document per row), with ``linear_norm``:
    'tokens' = Code 8 as printed (normalised segment mask), 'chunk' = without the mask's
    normalisation, 'none' = Code 1 (no ``/ n`` either); ``scaling='ns'`` = the commentary's
    ``relu(qk / sqrt(s) + b)^2 / n``."""
    B, T, d = x.shape
    n, e, s = layer.chunk_size, layer.e, layer.s
    g = T // n
    uv = F.silu(x @ layer.proj.weight.T + layer.proj.bias)
    u, v, base = uv.split([e, e, s], -1)
    base = base[..., None, :] * layer.heads.gamma + layer.heads.beta  # [B, T, 4, s]
    base = apply_rope(base, torch.arange(T).expand(B, T))  # rope(base, axis=[1, 2]): absolute position
    u, v, base = u.view(B, g, n, e), v.view(B, g, n, e), base.view(B, g, n, 4, s)
    quad_q, quad_k, lin_q, lin_k = base.unbind(-2)
    lin_kv = torch.einsum("bgnk,bgne->bgke", lin_k, v)
    if linear_norm != "none":
        lin_kv = lin_kv / n
    if causal:
        mask = torch.ones(g, g, dtype=x.dtype).tril(-1)  # segment mask: earlier chunks
    else:
        mask = torch.ones(g, g, dtype=x.dtype)
    if linear_norm == "tokens":  # tf.math.divide_no_nan(mask, reduce_sum(mask))
        rows = mask.sum(-1, keepdim=True)
        mask = torch.where(rows > 0, mask / rows.clamp(min=1), torch.zeros_like(mask))
    cum_lin_kv = torch.einsum("bhke,gh->bgke", lin_kv, mask)
    linear = torch.einsum("bgnk,bgke->bgne", lin_q, cum_lin_kv)
    quad_qk = torch.einsum("bgnk,bgmk->bgnm", quad_q, quad_k)
    bias = layer.rel_bias.matrix(n)[0]
    if scaling == "n":
        kernel = torch.relu(quad_qk / n + bias) ** 2
    else:
        kernel = torch.relu(quad_qk / math.sqrt(s) + bias) ** 2 / n
    if causal:
        kernel = kernel * torch.ones(n, n, dtype=x.dtype).tril()
    quadratic = torch.einsum("bgnm,bgme->bgne", kernel, v)
    out = (u * (quadratic + linear)).reshape(B, T, e)
    return out @ layer.out.weight.T + layer.out.bias


def _layer(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    layer = FLASH(16, expansion_dim=32, key_dim=8, chunk_size=6, **kw).to(dtype)
    with torch.no_grad():  # the seed init (N(0, 0.02)) makes q.k tiny; test real values
        layer.heads.gamma.normal_()
        layer.heads.beta.normal_()
        layer.proj.bias.normal_()
    return layer


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("linear_norm", ["tokens", "chunk", "none"])
@pytest.mark.parametrize("scaling", ["n", "ns"])
def test_flash_layer_is_code8(causal, linear_norm, scaling):
    layer = _layer(causal=causal, linear_norm=linear_norm, scaling=scaling)
    x = torch.randn(2, 24, 16, dtype=torch.float64)  # 4 chunks of 6
    y, state = layer(x, positions=torch.arange(24).expand(2, 24))
    assert state is None
    assert_exact(f"FLASH vs Code 8 {causal} {linear_norm} {scaling}", _code8(layer, x, causal, linear_norm, scaling), y)


@pytest.mark.parametrize("causal", [True, False])
def test_first_to_all_formula(causal):
    """The first token of each chunk adds a single-head softmax attention over every (earlier)
    token of its sequence; every other token is FLASH's."""
    fta = _layer(causal=causal, first_to_all=True)
    plain = _layer(causal=causal)
    with torch.no_grad():
        shared = {"heads.gamma": fta.heads.gamma[:4], "heads.beta": fta.heads.beta[:4]}
        plain.load_state_dict({**fta.state_dict(), **shared})
    T = 21  # chunk starts 0, 6, 12, 18; the last chunk is partial
    x = torch.randn(2, T, 16, dtype=torch.float64)
    pos = torch.arange(T).expand(2, T)
    y, _ = fta(x, positions=pos)
    y0, _ = plain(x, positions=pos)
    first = torch.arange(T) % 6 == 0
    assert torch.equal(y[:, ~first], y0[:, ~first])
    # the added term, by hand
    u, v, z = F.silu(fta.proj(x)).split([32, 32, 8], -1)
    qf, kf = apply_rope(fta.heads(z)[:, :, 4:], pos).unbind(-2)  # [B, T, s]
    a = (qf @ kf.transpose(1, 2)) / math.sqrt(8)
    if causal:
        a = a.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    extra = u * (torch.softmax(a, -1) @ v)
    assert_exact("first-to-all term", (y0 + extra @ fta.out.weight.T)[:, first], y[:, first])



def test_a_decoding_state_needs_a_causal_layer():
    layer = FLASH(16, expansion_dim=32, key_dim=8, chunk_size=4, causal=False)
    with pytest.raises(ValueError, match="decoding state needs causal"):
        layer(torch.randn(1, 3, 16), layer.init_state(1, "cpu", torch.float32), positions=torch.arange(3)[None])
