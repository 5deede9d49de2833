"""Family ``mc_tfm`` (MC-TFM++): the mixer against its formula written as dense matrices (local
softmax inside chunks + linear attention over earlier chunks, per head), parallel == prefill +
decoding across chunk boundaries with packing, a constant decoding state, presets, config
validation, training."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.mc_attention import MixedChunkMHA
from lintime.layers.positional import apply_rope
from lintime.models import CausalLM, FFNConfig, MaskedLM, ModelConfig, get_preset
from lintime.models.families.mc_tfm import MCConfig
from lintime.ops import MixedChunkState
from tolerances import assert_exact
from model_helpers import check_packed_decode_and_select, decode_in_pieces, packed

V = 260


def cfg(**mixer) -> ModelConfig:
    """A small 2-block MC-TFM++ (d=32, 4 heads, C=8, GEGLU) with the given options."""
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, family="mc_tfm",
                       mixer=MCConfig(**{"n_heads": 4, "chunk_size": 8, **mixer}),
                       ffn=FFNConfig(kind="glu", expansion=4, activation="gelu"), position="scaled_sin")


_MODELS = {}


def model(config, dtype=torch.float64, cls=CausalLM):
    key = (config.to_json(), dtype, cls)
    if key not in _MODELS:
        torch.manual_seed(1)
        _MODELS[key] = cls(config).to(dtype).eval()
    return _MODELS[key]




# ----------------------------------------------------------------------------- the formula
def _by_hand(layer: MixedChunkMHA, x, causal, linear_norm):
    B, T, _ = x.shape
    H, K, C = layer.n_heads, layer.head_dim, layer.chunk_size
    q, k, v = layer.qkv(x).view(B, T, 3, H, K).unbind(2)
    ql = q * layer.lin_scale[0] + layer.lin_offset[0]
    kl = k * layer.lin_scale[1] + layer.lin_offset[1]
    pos = torch.arange(T).expand(B, T)
    q, k, ql, kl = (apply_rope(t, pos).transpose(1, 2) for t in (q, k, ql, kl))  # [B, H, T, K]
    v = v.transpose(1, 2)
    i = torch.arange(T)
    same_chunk = (i[:, None] // C) == (i[None, :] // C)
    local_mask = same_chunk & (i[None, :] <= i[:, None]) if causal else same_chunk
    a = (q @ k.transpose(-1, -2) / math.sqrt(K)).masked_fill(~local_mask, -math.inf)
    local = torch.softmax(a, -1) @ v
    # linear: ql_i . sum_{j < s(c(i))} kl_j^T v_j / N_i (seed Eq. 8), all j when not causal (Eq. 7)
    if causal:
        lin_mask = i[None, :] < (i[:, None] // C) * C
        n_tokens = ((i // C) * C).to(x.dtype)[:, None]
    else:
        lin_mask = torch.ones(T, T, dtype=torch.bool)
        n_tokens = torch.full((T, 1), float(T), dtype=x.dtype)
    w = (ql @ kl.transpose(-1, -2)) * lin_mask
    if linear_norm == "tokens":
        w = torch.where(n_tokens > 0, w / n_tokens.clamp(min=1), torch.zeros_like(w))
    elif linear_norm == "chunk":
        w = w / C
    o = (local + w @ v).transpose(1, 2).reshape(B, T, H * K)
    return layer.out(o)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("linear_norm", ["tokens", "chunk", "none"])
def test_layer_matches_its_formula(causal, linear_norm):
    torch.manual_seed(0)
    layer = MixedChunkMHA(16, 2, chunk_size=5, causal=causal, linear_norm=linear_norm).double()
    with torch.no_grad():
        layer.lin_scale.normal_()
        layer.lin_offset.normal_()
    x = torch.randn(2, 23, 16, dtype=torch.float64)  # 4 full chunks and a partial one
    y, state = layer(x, positions=torch.arange(23).expand(2, 23))
    assert state is None
    assert_exact(f"MC-TFM++ {causal} {linear_norm}", _by_hand(layer, x, causal, linear_norm), y)


# ----------------------------------------------------------------------------- parallel == recurrent
OPTIONS = [dict(), dict(linear_norm="chunk"), dict(linear_norm="none"), dict(n_heads=2, chunk_size=5),
           dict(rope=False)]


def _id(o):
    return ",".join(f"{k}={v}" for k, v in o.items()) or "default"


@pytest.mark.parametrize("opts", OPTIONS, ids=_id)
def test_full_sequence_equals_prefill_plus_decoding(opts):
    m = model(cfg(**opts))
    ids = torch.randint(0, V, (2, 30))
    with torch.no_grad():
        full = m(ids)
        for splits in ([8], [5, 16, 19]):
            pieces, state = decode_in_pieces(m, ids, splits)
            assert_exact(f"mc {opts} prefill {splits}", full, pieces)
    assert isinstance(state.layers[0], MixedChunkState)


def test_fp32_decoding():
    m = model(cfg(), torch.float32)
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert_exact("mc fp32", m(ids), decode_in_pieces(m, ids, [7])[0])


@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(cls):
    m = model(cfg(), cls=cls)
    seqs, ids, cu = packed([7, 1, 0, 19, 12])
    with torch.no_grad():
        ref = torch.cat([m(s) for s in seqs if s.shape[1]], 1)
        assert_exact(f"mc {cls.__name__} packed", ref, m(ids, cu_seqlens=cu))


def test_packed_prefill_then_decoding_and_select():
    m = model(cfg())
    check_packed_decode_and_select(m, "mc", steps=11, vocab=V)


def test_decoding_state_size_is_constant_in_T():
    m = model(cfg())
    sizes = set()
    with torch.no_grad():
        for T in (10, 100, 333):
            _, state = m(torch.randint(0, V, (1, T)), return_state=True)
            layer = state.layers[0]
            assert layer.count.tolist() == [T // 8 * 8] and layer.fill.tolist() == [T % 8]
            sizes.add(sum(getattr(layer, f.name).numel() for f in dataclasses.fields(layer)))
    assert len(sizes) == 1, sizes


# ----------------------------------------------------------------------------- presets, config
def test_base_preset_is_transformer_pp_with_mixed_chunks():
    """The seed gives MC-TFM++ no parameter count; it is compared with Transformer++ at the 110M
    scale (Figure 7, Table 5), whose Table 9 / Table 8 count is 110M."""
    for name in ("mc-tfm-pp-base", "mc-tfm-pp-base-mlm"):
        c = get_preset(name)
        assert (c.d_model, c.n_layers, c.mixer.n_heads, c.mixer.chunk_size) == (768, 12, 12, 256)
        assert (c.ffn.kind, c.ffn.activation, c.position, c.mixer.rope) == ("glu", "gelu", "scaled_sin", True)
        with torch.device("meta"):
            got = CausalLM(c).num_parameters() / 1e6
            tpp = CausalLM(get_preset(name.replace("mc-tfm-pp", "transformer-pp"))).num_parameters() / 1e6
        assert abs(got - 110) <= 0.05 * 110, f"{name}: {got:.2f}M"
        assert 0 < got - tpp < 0.05  # + the linear heads' scale / offset: 4 d per layer
    assert get_preset("mc-tfm-pp-base-mlm").norm == "scalenorm"


@pytest.mark.parametrize("name", ["mc-tfm-pp-tiny", "mc-tfm-pp-small", "mc-tfm-pp-base", "mc-tfm-pp-base-mlm"])
def test_json_round_trip(name):
    c = get_preset(name)
    d = json.loads(c.to_json())
    assert d["family"] == "mc_tfm" and isinstance(d["mixer"], dict)
    assert ModelConfig.from_json(c.to_json()) == c


BAD = [
    (dict(n_heads=0), "n_heads must be an int >= 1"),
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(linear_norm="sum"), "linear_norm must be one of"),
    (dict(rope="no"), "rope must be a bool"),
    (dict(head_dim=0), "head_dim must be an int >= 1"),
]


@pytest.mark.parametrize("kwargs,msg", BAD)
def test_bad_configs_fail_clearly(kwargs, msg):
    with pytest.raises(ValueError, match=f"MCConfig: {msg}"):
        MCConfig(**kwargs)


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        dataclasses.replace(cfg(), d_model=30)
    with pytest.raises(ValueError, match="RoPE needs an even head size, got 5"):
        dataclasses.replace(cfg(), d_model=20)


# ----------------------------------------------------------------------------- training
def test_tiny_preset_overfits():
    torch.manual_seed(0)
    m = CausalLM(get_preset("mc-tfm-pp-tiny"))
    opt = torch.optim.AdamW(m.param_groups(0.01), lr=5e-3)
    ids = torch.randint(0, 256, (2, 33))
    losses = []
    for _ in range(40):
        logits = m(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0
    assert losses[-1] < 0.1 * losses[0], losses[::10]
