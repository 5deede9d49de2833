"""Family ``combiner`` (FLASH seed baseline: Combiner, row-major axial, Appendix A): the layer
against a token-by-token reference written out here, parallel == prefill + decoding (packed too),
the state's documented memory, Tables 8-10 counts, training, configs."""

import pytest
import torch
from model_helpers import (
    assert_within_5pct,
    check_json_round_trip,
    check_packed_equals_separate,
    check_packed_prefill_then_decoding,
    check_prefill_plus_decoding,
    check_select,
    meta_params_m,
    model,
    overfit,
)

from lintime.layers.combiner import CombinerAttention
from lintime.layers.positional import apply_rope
from lintime.models import CausalLM, MaskedLM, all_presets, get_preset
from lintime.models.families.combiner import CombinerConfig
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_sequence_equals_prefill_plus_decoding(dtype):
    check_prefill_plus_decoding("combiner-tiny", dtype)  # C = 8: splits inside and on row boundaries


@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(cls):
    check_packed_equals_separate("combiner-tiny", cls)


def test_packed_prefill_then_decoding():
    check_packed_prefill_then_decoding("combiner-tiny")


def test_select_for_beam_search():
    check_select("combiner-tiny")


def test_state_memory_is_the_documented_one():
    """Per layer and sequence: ``2 x rows x C x H x D`` summaries of complete rows (a KV cache's
    size) + the current row (``< C`` tokens): ``rows = T // C``, ``buf_len = T % C``."""
    m = model("combiner-tiny")  # C = 8, H = 4, D = 16
    with torch.no_grad():
        for T in (5, 8, 29):
            _, st = m(torch.randint(0, 256, (2, T)), return_state=True)
            s = st.layers[0]
            assert s.rows.tolist() == [T // 8] * 2 and s.buf_len.tolist() == [T % 8] * 2
            assert s.sum_k.shape[0] == 2 and s.sum_k.shape[1] >= T // 8 and s.sum_k.shape[2:] == (8, 4, 16)
            assert s.sum_k[:, T // 8 :].abs().sum() == 0 and s.buf_q[:, T % 8 :].abs().sum() == 0
            assert s.buf_x.shape == (2, 8, 64)


def test_parameter_counts_vs_seed_tables():
    """Tables 8-9: Combiner 124M (d=768, 12+12 layers, C=256); Table 10: 562M (d=1024, 36+36, C=512).
    The gap to Transformer+ is the 'proj' row summary: 2d^2 + 4d per layer."""
    assert_within_5pct("combiner-base", 124)
    assert_within_5pct("combiner-base-mlm", 124)
    assert_within_5pct("combiner-large", 562)
    gap = meta_params_m("combiner-base") - meta_params_m("transformer-p-base")
    assert round(gap * 1e6) == 12 * (2 * 768 * 768 + 4 * 768)
    assert (get_preset("combiner-base").mixer.chunk_size, get_preset("combiner-large").mixer.chunk_size) == (256, 512)
    assert get_preset("combiner-base-mlm").norm == "scalenorm"


def test_tiny_overfits():
    overfit("combiner-tiny")


@pytest.mark.parametrize("name", [n for n in all_presets() if n.startswith("combiner-")])
def test_json_round_trip(name):
    check_json_round_trip(name, "combiner")


BAD = [
    (dict(n_heads=0), "CombinerConfig: n_heads must be a positive int"),
    (dict(chunk_size=0), "CombinerConfig: chunk_size must be a positive int"),
    (dict(row_summary="mean"), "CombinerConfig: row_summary must be one of"),
    (dict(rope="yes"), "CombinerConfig: rope and bias must be bools"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m for _, m in BAD])
def test_bad_configs_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CombinerConfig(**kwargs)


def test_bad_model_level_configs_and_states():
    with pytest.raises(ValueError, match="d_model=64 is not divisible by n_heads=6"):
        get_preset("combiner-tiny", mixer=CombinerConfig(n_heads=6))
    m = model("combiner-tiny")
    with pytest.raises(ValueError, match="holds 2 sequences but the input has 3"):
        m(torch.randint(0, 256, (3, 1)), m.init_state(2))
    layer = CombinerAttention(16, 2, chunk_size=4, causal=False)
    with pytest.raises(ValueError, match="a decoding state needs causal attention"):
        layer(torch.randn(1, 2, 16), layer.init_state(1, "cpu", torch.float32), positions=torch.zeros(1, 2, dtype=torch.long))
