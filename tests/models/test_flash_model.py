"""Family ``flash`` (FLASH) as a model: parallel == prefill + decoding across chunk boundaries and packing for every
option (first-to-all included), the documented decoding state, presets against the seed's tables, config round
trips.  The layer against seed Code 8: ``tests/layers/test_flash.py``; what every family passes:
``test_every_family.py``."""

import dataclasses

import pytest
import torch
from model_helpers import (
    CausalLM,
    MaskedLM,
    build,
    check_packed_equals_separate,
    check_packed_prefill_then_decoding,
    check_prefill_plus_decoding,
    state_numel,
)

from lintime.layers.flash import FLASHState
from lintime.models import ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from lintime.models.families.flash import FlashConfig

V = BYTE_VOCAB


def cfg(**mixer) -> ModelConfig:
    """A small 2-layer FLASH (d=32, e=64, s=16, C=8) with the given options."""
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, family="flash",
                       mixer=FlashConfig(**{"s": 16, "chunk_size": 8, **mixer}), ffn=None, position="scaled_sin")


# ----------------------------------------------------------------------------- parallel == recurrent
# the options besides the seed's (that one: test_every_family.py on flash-tiny with C = 8)
OPTIONS = [
    dict(linear_norm="chunk"),
    dict(linear_norm="none"),
    dict(scaling="ns"),
    dict(first_to_all=True),
    dict(rel_bias=False),
    dict(chunk_size=5),
    dict(chunk_size=512),  # the RoPE-built chunk bias (C >= 512), one partial chunk
]


def _id(o):
    return ",".join(f"{k}={v}" for k, v in o.items())


@pytest.mark.parametrize("opts", OPTIONS, ids=_id)
def test_full_sequence_equals_prefill_plus_decoding(opts):
    """Across chunk boundaries (C=8, T=30), prefill pieces that end inside and on chunks."""
    state = check_prefill_plus_decoding(build(cfg(**opts)), f"flash {opts}", T=30, B=2, splits=([8], [5, 16, 19]))
    assert isinstance(state.layers[0], FLASHState)


def test_first_to_all_fp32_decoding():
    check_prefill_plus_decoding(build(cfg(first_to_all=True), torch.float32), "flash first-to-all fp32", T=20, B=2,
                                splits=([7],))


@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_first_to_all_packed_equals_separate(cls):
    check_packed_equals_separate(build(cfg(first_to_all=True), cls=cls), f"flash first-to-all {cls.__name__}")


def test_first_to_all_packed_prefill_then_decoding():
    check_packed_prefill_then_decoding(build(cfg(first_to_all=True)), "flash first-to-all", steps=11)


def test_decoding_state_is_the_documented_one():
    """FLASH decodes with O(1) memory per token in T (seed Section 3.2.1): per layer the summed
    linear-attention state, the tokens it holds, and the current chunk's keys and values; only
    first-to-all keeps every key."""
    m = build(cfg())
    with torch.no_grad():
        for T in (10, 29):
            _, state = m(torch.randint(0, V, (1, T)), return_state=True)
            mc = state.layers[0].mc
            assert mc.count.tolist() == [T // 8 * 8] and mc.fill.tolist() == [T % 8]
    L, C, s, e = 2, 8, 16, 64
    assert state_numel(state) == L * (s * e + 1 + C * (2 * s + e) + 1)  # kv, count, k_quad + k_lin + v, fill
    fta = build(cfg(first_to_all=True))
    with torch.no_grad():
        _, s1 = fta(torch.randint(0, V, (1, 10)), return_state=True)
        _, s2 = fta(torch.randint(0, V, (1, 100)), return_state=True)
        assert state_numel(s2) > state_numel(s1)  # documented: first-to-all decoding is O(T)
        with pytest.raises(ValueError, match="first_to_all needs a state"):
            fta(torch.randint(0, V, (1, 2)), m.init_state(1))


# ----------------------------------------------------------------------------- presets, config
def test_seed_table_rows():
    base, large = get_preset("flash-base"), get_preset("flash-large")
    m = base.mixer
    assert (base.d_model, base.n_layers, m.s, m.expansion, m.chunk_size) == (768, 24, 128, 2, 256)
    assert (large.d_model, large.n_layers, large.mixer.chunk_size) == (1024, 72, 512)  # Table 10
    assert base.ffn is None and base.position == "scaled_sin" and base.norm == "layernorm"
    assert get_preset("flash-base-mlm").norm == "scalenorm"  # Table 8
    assert base.mixer.linear_norm == "tokens" and not base.mixer.first_to_all


def test_json_round_trip_of_varied_options():
    """Every preset round-trips (``test_config.py``); so does a sub-config far from the defaults."""
    c = get_preset("flash-small")
    varied = dataclasses.replace(c, mixer=FlashConfig(linear_norm="none", scaling="ns", first_to_all=True))
    assert ModelConfig.from_json(varied.to_json()) == varied
