"""Family ``linear`` (seed ``linear-self-attention-is-faster.txt``): the layer against the seed's
formula written out here, parallel == prefill + decoding (packed too), a state that does not grow
with T, GPT-2 shapes, the tiny preset learns, configs round-trip and fail clearly."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from model_helpers import (
    MaskedLM,
    assert_within_5pct,
    check_json_round_trip,
    check_packed_equals_separate,
    check_packed_prefill_then_decoding,
    check_prefill_plus_decoding,
    check_select,
    meta_params_m,
    model,
    overfit,
    state_numel,
)

from lintime.layers.linear_attention import LinearAttention, LinearAttentionState
from lintime.models import CausalLM, ModelConfig, all_presets, get_preset
from lintime.models.families.linear import LinearConfig
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_sequence_equals_prefill_plus_decoding(dtype):
    check_prefill_plus_decoding("linear-tiny", dtype)


def test_unnormalised_decoding_and_state_type():
    m = CausalLM(get_preset("linear-tiny", mixer=LinearConfig(n_heads=4, normalize=False))).double().eval()
    ids = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        full = m(ids)
        a, st = m(ids[:, :7], return_state=True)
        b, st = m(ids[:, 7:8], st, return_state=True)
        c, st = m(ids[:, 8:], st, return_state=True)
    assert_exact("unnormalised decoding", full, torch.cat([a, b, c], 1))
    s = st.layers[0]
    assert isinstance(s, LinearAttentionState) and s.k_sum is None and s.kv.shape == (2, 4, 16, 16)


@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(cls):
    check_packed_equals_separate("linear-tiny", cls)


def test_packed_prefill_then_decoding():
    check_packed_prefill_then_decoding("linear-tiny")


def test_select_for_beam_search():
    check_select("linear-tiny")


def test_state_size_is_constant_in_T():
    m = model("linear-tiny")
    sizes = []
    with torch.no_grad():
        for T in (1, 10, 300):
            _, state = m(torch.randint(0, 256, (2, T)), return_state=True)
            sizes.append(state_numel(state))
    H, K = 4, 16
    assert sizes == [2 * 2 * H * (K * K + K)] * 3  # 2 layers x 2 sequences x (kv + k_sum)
    s = state.layers[0]
    assert s.kv.dtype == torch.float64 and s.kv.shape == (2, H, K, K) and s.k_sum.shape == (2, H, K)


def test_fp32_model_keeps_fp32_state_and_bf16_runs():
    m = CausalLM(get_preset("linear-tiny")).eval()
    with torch.no_grad():
        _, st = m(torch.randint(0, 256, (1, 5)), return_state=True)
        assert st.layers[0].kv.dtype == torch.float32
        y = CausalLM(get_preset("linear-tiny")).to(torch.bfloat16)(torch.randint(0, 256, (1, 9)))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_gpt2_shapes():
    """``linear-gpt2-124m`` is GPT-2 small with only the mixer changed: the same 124,439,808
    parameters as GPT-2 small (tied 50,257 x 768 embedding, 1024 learned positions); the seed's four
    scales run "from 120 million to 1.5 billion"."""
    assert meta_params_m("linear-gpt2-124m") * 1e6 == 124_439_808
    assert_within_5pct("linear-gpt2-124m", 120)
    assert_within_5pct("linear-gpt2-1.5b", 1500)
    cfg = get_preset("linear-gpt2-124m")
    assert (cfg.d_model, cfg.n_layers, cfg.mixer.n_heads, cfg.vocab_size) == (768, 12, 12, 50257)
    assert (cfg.position, cfg.max_positions, cfg.ffn.activation, cfg.norm) == ("learned", 1024, "gelu_tanh", "layernorm")
    assert get_preset("linear-gpt2-1.5b").d_model // get_preset("linear-gpt2-1.5b").mixer.n_heads == 64  # seed: d=64


def test_tiny_overfits():
    overfit("linear-tiny")


@pytest.mark.parametrize("name", [n for n in all_presets() if n.startswith("linear-")])
def test_json_round_trip(name):
    check_json_round_trip(name, "linear")


BAD = [
    (dict(n_heads=0), "LinearConfig: n_heads must be a positive int"),
    (dict(feature_map="softmax"), "LinearConfig: feature_map must be one of"),
    (dict(feature_map="identity"), "feature_map='identity' needs normalize=False"),
    (dict(feature_map="relu", feature_eps=0.0), "feature_map='relu' with normalize=True needs feature_eps > 0"),
    (dict(normalize="yes"), "normalize must be a bool"),
    (dict(chunk_size=0), "chunk_size must be a positive int"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m for _, m in BAD])
def test_bad_configs_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinearConfig(**kwargs)


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="d_model=64 is not divisible by n_heads=5"):
        get_preset("linear-tiny", mixer=LinearConfig(n_heads=5))
    with pytest.raises(ValueError, match=r"mixer \(linear\): unknown field\(s\) \['heads'\]"):
        ModelConfig.from_dict({**get_preset("linear-tiny").to_dict(), "mixer": {"heads": 4}})
    assert dataclasses.replace(get_preset("linear-tiny"), mixer=LinearConfig(n_heads=4, feature_map="relu")).mixer.feature_map == "relu"
    m = model("linear-tiny")
    _, st = m(torch.randint(0, 256, (1, 1023)), return_state=True)
    with pytest.raises(ValueError, match="beyond the learned position table"):
        m(torch.randint(0, 256, (1, 2)), st)  # GPT-2's learned positions end at 1024
