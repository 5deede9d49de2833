"""Family ``gau`` (FLASH-Quad) as a model: parallel == prefill + decoding and packing for every option of the
layer, its KV-cache state, the direct bias's length limit, presets against the seed's tables, config round trips
and validation, weight decay.  The layer against seed Code 6 and every option's formula: ``tests/layers/test_gau_layer.py``;
what every family passes: ``test_every_family.py``."""

import dataclasses

import pytest
import torch
from model_helpers import CausalLM, MaskedLM, build, check_packed_equals_separate, check_prefill_plus_decoding, packed

from lintime.models import ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from lintime.models.families.gau import GAUConfig

V = BYTE_VOCAB


def cfg(**mixer) -> ModelConfig:
    """A small 2-layer FLASH-Quad (d=32, e=64, s=16) with the given GAU options."""
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, family="gau", mixer=GAUConfig(**{"s": 16, **mixer}),
                       ffn=None, position="scaled_sin")


# ----------------------------------------------------------------------------- parallel == recurrent
# the layer's options besides the seed's (tests/layers/test_gau_layer.py checks each against its formula; the
# seed's options are flash-quad-tiny's in test_every_family.py); max_len=48: a direct bias table (max_len < 512)
OPTIONS = [dict(scaling="ns"), dict(causal_norm=True), dict(scaling="ns", causal_norm=True), dict(kernel="softmax"),
           dict(n_heads=2), dict(gating=False), dict(rel_bias=False), dict(max_len=48)]


def _id(o):
    return ",".join(f"{k}={v}" for k, v in o.items())


@pytest.mark.parametrize("opts", OPTIONS, ids=_id)
def test_full_sequence_equals_prefill_plus_decoding(opts):
    check_prefill_plus_decoding(build(cfg(**opts)), f"gau {opts}", T=30, B=2, splits=([1], [5, 17, 26]))


@pytest.mark.parametrize("opts", [dict(kernel="softmax"), dict(causal_norm=True, scaling="ns")], ids=_id)
@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(opts, cls):
    check_packed_equals_separate(build(cfg(**opts), cls=cls), f"gau {opts} {cls.__name__}")


def test_state_is_a_kv_cache():
    """FLASH-Quad is quadratic: its decoding state is a KV cache, O(T) (seed Section 3.1)."""
    m = build(cfg())
    with torch.no_grad():
        _, s10 = m(torch.randint(0, V, (1, 10)), return_state=True)
        _, s40 = m(torch.randint(0, V, (1, 40)), return_state=True)
    assert s10.layers[0].lengths.tolist() == [10] and s40.layers[0].lengths.tolist() == [40]
    assert s40.layers[0].k.shape[1] >= 40


def test_direct_bias_length_limit_is_a_clear_error():
    m = build(cfg(max_len=16))
    with torch.no_grad():
        m(torch.randint(0, V, (1, 16)))
        with pytest.raises(ValueError, match="reaches 17 tokens but the direct relative bias holds max_len=16"):
            m(torch.randint(0, V, (1, 17)))
        _, state = m(torch.randint(0, V, (1, 15)), return_state=True)
        m(torch.randint(0, V, (1, 1)), state)
        with pytest.raises(ValueError, match="reaches 17 tokens"):
            m(torch.randint(0, V, (1, 2)), state)
        # packed rows longer than max_len are fine while every sequence fits
        _, ids, cu = packed([16, 16])
        m(ids, cu_seqlens=cu)


# ----------------------------------------------------------------------------- presets, config
def test_seed_table_rows_and_table1_ablation_sizes():
    base, large = get_preset("flash-quad-base"), get_preset("flash-quad-large")
    assert (base.d_model, base.n_layers, base.mixer.s, base.mixer.expansion, base.ffn) == (768, 24, 128, 2, None)
    assert (large.d_model, large.n_layers) == (1024, 72)
    assert base.position == "scaled_sin" and base.norm == "layernorm"
    assert get_preset("flash-quad-base-mlm").norm == "scalenorm"  # Table 8
    # Table 1: "relu^2 -> softmax" and "single-head -> multi-head" keep the model's size (105M = 105M)
    with torch.device("meta"):
        n0 = CausalLM(get_preset("flash-quad-base")).num_parameters()
        for opts in (dict(kernel="softmax"), dict(n_heads=4)):
            n = CausalLM(get_preset("flash-quad-base", mixer=GAUConfig(**opts))).num_parameters()
            assert abs(n - n0) / n0 < 1e-3, opts


def test_json_round_trip_of_varied_options():
    """Every preset round-trips (``test_config.py``); so does a sub-config far from the defaults."""
    c = get_preset("flash-quad-small")
    varied = dataclasses.replace(c, mixer=GAUConfig(kernel="softmax", n_heads=2, gating=False))
    assert ModelConfig.from_json(varied.to_json()) == varied


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="n_heads=4 does not divide e = expansion \\* d_model = 90"):
        ModelConfig(vocab_size=V, d_model=30, n_layers=1, family="gau",
                    mixer=GAUConfig(s=8, n_heads=4, expansion=3), ffn=None)
    with pytest.raises(ValueError, match="takes a GAUConfig"):
        ModelConfig(vocab_size=V, d_model=32, n_layers=1, family="gau", mixer=get_preset("flash-tiny").mixer)


def test_no_weight_decay_on_scale_offset_and_bias_tables():
    m = CausalLM(get_preset("flash-quad-tiny"))
    decay, no_decay = m.param_groups(0.01)
    names = {id(p): n for n, p in m.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    assert "backbone.blocks.0.mixer.qk.gamma" in nd and "backbone.blocks.0.mixer.qk.beta" in nd
    assert "backbone.blocks.0.mixer.rel_bias.a" in nd  # max_len 512: the RoPE-built bias
    assert {names[id(p)] for p in decay["params"]} == {"backbone.embed.weight"} | {
        f"backbone.blocks.{i}.mixer.{w}.weight" for i in range(m.config.n_layers) for w in ("proj", "out")}
    g = m.backbone.blocks[0].mixer.qk.gamma
    assert abs(g.std().item() - 0.02) < 0.01 and torch.count_nonzero(m.backbone.blocks[0].mixer.qk.beta) == 0

