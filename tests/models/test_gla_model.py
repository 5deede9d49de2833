"""Family ``gla`` (seed ``gated-linear-attention-zh.txt`` §4.4): the layer against the seed's
recurrence written out here, the gate parameterisation, parallel == prefill + decoding (packed
too), a state that does not grow with T, SwiGLU blocks, seed sizes, training, configs."""

import pytest
import torch
import torch.nn.functional as F
from model_helpers import (
    assert_within_5pct,
    check_json_round_trip,
    check_packed_equals_separate,
    check_packed_prefill_then_decoding,
    check_prefill_plus_decoding,
    check_select,
    model,
    overfit,
    state_numel,
)

from lintime.layers.gla import GatedLinearAttention
from lintime.layers.norms import LayerNorm, RMSNorm
from lintime.models import CausalLM, MaskedLM, all_presets, get_preset
from lintime.models.families.gla import GLAConfig
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_sequence_equals_prefill_plus_decoding(dtype):
    check_prefill_plus_decoding("gla-tiny", dtype)


def test_packed_equals_separate():
    check_packed_equals_separate("gla-tiny")


def test_packed_prefill_then_decoding():
    check_packed_prefill_then_decoding("gla-tiny")


def test_select_for_beam_search():
    check_select("gla-tiny")


def test_state_size_is_constant_in_T():
    m = model("gla-tiny")
    with torch.no_grad():
        sizes = [state_numel(m(torch.randint(0, 256, (2, T)), return_state=True)[1]) for T in (1, 10, 300)]
    assert sizes == [2 * 2 * 4 * 8 * 16] * 3  # 2 layers x 2 sequences x [H=4, K=8, V=16]
    _, st = m(torch.randint(0, 256, (2, 3)), return_state=True)
    assert isinstance(st.layers[0], torch.Tensor) and st.layers[0].shape == (2, 4, 8, 16)


def test_causal_only():
    with pytest.raises(ValueError, match="GatedLinearAttention is causal only"):
        MaskedLM(get_preset("gla-tiny"))


def test_blocks_are_swiglu_rmsnorm_no_positions():
    cfg = get_preset("gla-340m")
    f = cfg.ffn
    assert (f.kind, f.activation, f.value_activation, f.bias, f.hidden) == ("glu", "silu", "identity", False, 2816)
    assert (cfg.norm, cfg.position, cfg.vocab_size) == ("rmsnorm", "none", 32000)  # Mistral tokenizer
    assert (cfg.d_model, cfg.n_layers, cfg.mixer.n_heads) == (1024, 24, 4)
    m = model("gla-tiny")
    blk = m.backbone.blocks[0]
    x = torch.randn(1, 3, 64, dtype=D64)
    up_u, up_v = blk.ffn.up(x).split(blk.ffn.hidden, -1)
    assert_exact("SwiGLU", blk.ffn.down(F.silu(up_u) * up_v), blk.ffn(x))


def test_parameter_counts_vs_seed():
    """The seed names its models "340M" and "1.3B" (§A4); the counts are typed in from it."""
    assert_within_5pct("gla-340m", 340)
    assert_within_5pct("gla-1.3b", 1300)


def test_tiny_overfits():
    overfit("gla-tiny")


@pytest.mark.parametrize("name", [n for n in all_presets() if n.startswith("gla-")])
def test_json_round_trip(name):
    check_json_round_trip(name, "gla")


BAD = [
    (dict(n_heads=0), "GLAConfig: n_heads must be a positive int"),
    (dict(expand_k=0), "GLAConfig: expand_k must be a number > 0"),
    (dict(gate_temperature=-1.0), "GLAConfig: gate_temperature must be a number > 0"),
    (dict(gate_rank=1.5), "GLAConfig: gate_rank must be a positive int"),
    (dict(head_norm="batchnorm"), "GLAConfig: head_norm must be one of"),
    (dict(output_gate=1), "GLAConfig: output_gate must be a bool"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m for _, m in BAD])
def test_bad_configs_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GLAConfig(**kwargs)


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="expand_k \\* d_model = 32 must be an integer divisible by n_heads=3"):
        get_preset("gla-tiny", mixer=GLAConfig(n_heads=3))
    with pytest.raises(ValueError, match="expand_v \\* d_model = 6.4 must be an integer"):
        get_preset("gla-tiny", mixer=GLAConfig(expand_v=0.1))
    m = CausalLM(get_preset("gla-tiny"))
    with pytest.raises(TypeError, match="the state is the op's"):
        m.backbone.blocks[0].mixer(torch.randn(1, 2, 64), (1, 2), positions=torch.zeros(1, 2, dtype=torch.long))
