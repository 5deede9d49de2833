"""The Combiner layer (``lintime.layers.combiner``, FLASH seed baseline: row-major axial, Appendix A) against a
token-by-token reference written out here (every row summary, causal and not), its own decoding, and its errors."""

import pytest
import torch

from lintime.layers.combiner import CombinerAttention
from lintime.layers.positional import apply_rope
from tolerances import assert_exact

D64 = torch.float64


def reference(layer, x, causal=True):
    """Seed Appendix A, ``Softmax(Q [K_row; K_sum]) [V_row; V_sum]``, one query at a time: token
    ``i`` in row ``r``, column ``c`` attends to the keys of its row (``j <= i`` if causal) and to
    one summary per row ``u`` (``u < r`` if causal; every row holding a column ``c`` if not), the
    summary of row ``u`` at column ``c`` being row ``u``'s full-row attention output there."""
    B, T, _ = x.shape
    H, D, C = layer.n_heads, layer.head_dim, layer.chunk_size
    pos = torch.arange(T)
    q, k, v = layer.qkv(x).view(B, T, 3, H, D).unbind(2)
    q, k = apply_rope(q, pos.expand(B, T)), apply_rope(k, pos.expand(B, T))
    row = lambda i: range((i // C) * C, min((i // C + 1) * C, T))
    v_sum, k_wsum = torch.zeros_like(v), torch.zeros_like(k)
    for i in range(T):
        js = list(row(i))
        p = torch.softmax(torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, js]) * D**-0.5, -1)
        v_sum[:, i] = torch.einsum("bhj,bjhd->bhd", p, v[:, js])
        k_wsum[:, i] = torch.einsum("bhj,bjhd->bhd", p, k[:, js])
    if layer.row_summary == "proj":
        h = layer.summary_out(layer.summary_norm(x + layer.summary_in(v_sum.reshape(B, T, H * D))))
        k_sum = apply_rope(h.view(B, T, H, D), pos.expand(B, T))
    else:
        k_sum = k_wsum if layer.row_summary == "wsum" else k
    out = torch.zeros_like(v)
    for i in range(T):
        r, c = divmod(i, C)
        local = [j for j in row(i) if j <= i or not causal]
        cells = [u * C + c for u in range((T + C - 1) // C) if (u < r or not causal) and u * C + c < T]
        keys = torch.cat([k[:, local], k_sum[:, cells]], 1)
        vals = torch.cat([v[:, local], v_sum[:, cells]], 1)
        p = torch.softmax(torch.einsum("bhd,bjhd->bhj", q[:, i], keys) * D**-0.5, -1)
        out[:, i] = torch.einsum("bhj,bjhd->bhd", p, vals)
    return layer.out(out.reshape(B, T, H * D))


@pytest.mark.parametrize("summary", ["proj", "wsum", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_layer_is_the_reference(summary, causal):
    layer = CombinerAttention(24, 3, chunk_size=4, row_summary=summary, causal=causal).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 13, 24, dtype=D64)  # 3 full rows + a partial one
    y, _ = layer(x, positions=torch.arange(13).expand(2, 13))
    assert_exact(f"combiner {summary} causal={causal}", reference(layer, x, causal), y)


@pytest.mark.parametrize("summary", ["proj", "wsum", "none"])
def test_layer_decoding_every_summary_kind(summary):
    layer = CombinerAttention(24, 3, chunk_size=4, row_summary=summary).double()
    x = torch.randn(2, 15, 24, dtype=D64)
    pos = torch.arange(15).expand(2, 15)
    full, _ = layer(x, positions=pos)
    state, outs = layer.init_state(2, "cpu", D64), []
    for a, b in [(0, 3), (3, 9), *[(t, t + 1) for t in range(9, 15)]]:
        y, state = layer(x[:, a:b], state, positions=pos[:, a:b])
        outs.append(y)
    assert_exact(f"combiner {summary} decoding", full, torch.cat(outs, 1))


def test_a_decoding_state_needs_a_causal_layer():
    layer = CombinerAttention(16, 2, chunk_size=4, causal=False)
    with pytest.raises(ValueError, match="a decoding state needs causal attention"):
        layer(torch.randn(1, 2, 16), layer.init_state(1, "cpu", torch.float32), positions=torch.zeros(1, 2, dtype=torch.long))
