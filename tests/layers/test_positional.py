"""Positions (``lintime.layers.positional``) against the seed's pseudocode written out literally: token positions
(packed restarts, decoding offsets), ScaledSin (Code 2), RoPE (Code 3), the Toeplitz relative bias (Code 4)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers import ScaledSinEmbedding, ToeplitzRelativeBias, apply_rope, token_positions
from tolerances import assert_exact

D64 = torch.float64

def test_token_positions_restart_and_offset():
    assert token_positions(2, 3).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert token_positions(2, 3, offset=torch.tensor([4, 0])).tolist() == [[4, 5, 6], [0, 1, 2]]
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert token_positions(1, 5, cu_seqlens=cu).tolist() == [[0, 1, 0, 1, 2]]
    off = torch.tensor([3, 9, 1])
    assert token_positions(1, 5, offset=off, cu_seqlens=cu).tolist() == [[3, 4, 1, 2, 3]]
    with pytest.raises(ValueError, match="batch size must be 1"):
        token_positions(2, 5, cu_seqlens=cu)


def _code2_scaledsin(T, d, scalar):
    # seed Code 2, literally (``scalar`` is the learned scalar, initialised to 1/sqrt(d))
    pos = torch.arange(T, dtype=D64)
    half_d = d // 2
    inv_freq = 10000 ** -(torch.arange(half_d, dtype=D64) / half_d)
    sinusoid = torch.einsum("s,d->sd", pos, inv_freq)
    return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1) * scalar


def test_scaledsin_is_code2():
    e = ScaledSinEmbedding(10).double()
    assert e.scale.item() == pytest.approx(1 / math.sqrt(10))  # to the fp32 it was created in
    out = e(token_positions(2, 6), dtype=D64)
    assert_exact("scaledsin", _code2_scaledsin(6, 10, e.scale.item()).expand(2, 6, 10), out)
    with pytest.raises(ValueError, match="even"):
        ScaledSinEmbedding(7)


def _code3_rope(x):
    # seed Code 3 with axis=1 on [B, T, H, D]: positions 0..T-1 along T
    T, D = x.shape[1], x.shape[-1]
    position = torch.arange(T, dtype=D64)[:, None]  # expand over H
    half = D // 2
    inv_freq = 10000 ** -(torch.arange(half, dtype=D64) / half)
    sinusoid = position[..., None] * inv_freq  # [T, 1, D/2]
    sin, cos = sinusoid.sin(), sinusoid.cos()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_rope_is_code3_relative_and_continues_with_offset():
    x = torch.randn(2, 9, 3, 8, dtype=D64)
    pos = token_positions(2, 9)
    out = apply_rope(x, pos)
    assert_exact("rope vs Code 3", _code3_rope(x), out)
    # decoding: positions 5.. applied to the tail equal the full call's tail
    assert_exact("rope offset", out[:, 5:], apply_rope(x[:, 5:], token_positions(2, 4, offset=torch.tensor([5, 5]))))
    # rope(q, i) . rope(k, j) depends on i - j only
    q, k = torch.randn(8, dtype=D64), torch.randn(8, dtype=D64)

    def dot(i, j):
        qi = apply_rope(q.view(1, 1, 8), torch.tensor([i]))
        kj = apply_rope(k.view(1, 1, 8), torch.tensor([j]))
        return (qi * kj).sum()

    assert dot(7, 3).item() == pytest.approx(dot(104, 100).item(), rel=1e-12)
    assert dot(7, 3).item() != pytest.approx(dot(7, 4).item(), rel=1e-6)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1))


def _code4_direct(w_seed, n):
    # seed Code 4, n < 512 branch, literally (tf.pad / tile / reshape / slice)
    t = F.pad(w_seed, (0, n))
    t = t.repeat(n)
    t = t[..., :-n]
    t = t.reshape(n, 3 * n - 2)
    r = (2 * n - 1) // 2
    return t[..., r:-r]


def test_toeplitz_direct_is_code4():
    n = 6
    b = ToeplitzRelativeBias(n).double()
    assert b.mode == "direct" and b.weight.shape == (1, 2 * n - 1)
    # the seed indexes its vector by j - i, the op contract's layout by i - j: same parameter, reversed
    ref = _code4_direct(b.weight[0].flip(0), n)
    assert_exact("toeplitz direct", ref, b.matrix(n)[0])
    # a shorter call reads the same offsets (decoding == training)
    assert_exact("toeplitz prefix", b.matrix(n)[:, :4, :4], b.matrix(4))
    with pytest.raises(ValueError, match="offsets up to 5"):
        b.diagonals(7)


def test_toeplitz_rope_built_is_code4():
    n = 600
    b = ToeplitzRelativeBias(n, heads=2).double()
    assert b.mode == "rope" and b.a.shape == (2, 128)
    T = 40  # rope-built: any length; check Code 4's construction at T positions
    for h in range(2):
        pos = torch.arange(T)
        a = apply_rope(b.a[h].expand(T, 1, 128), pos)[:, 0]
        bb = apply_rope(b.b[h].expand(T, 1, 128), pos)[:, 0]
        assert_exact("toeplitz rope", torch.einsum("mk,nk->mn", a, bb), b.matrix(T)[h])
    # the parameters are skipped by weight decay
    assert b.no_weight_decay() == {"a", "b"}

