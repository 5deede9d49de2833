"""Family ``mc_tfm`` (MC-TFM++) as a model: parallel == prefill + decoding across chunk boundaries for every option,
the decoding state's chunk bookkeeping, presets, model-level validation.  The layer against its formula:
``tests/layers/test_mc_attention.py``; what every family passes: ``test_every_family.py``."""

import dataclasses

import pytest
import torch
from model_helpers import CausalLM, build, check_prefill_plus_decoding

from lintime.models import FFNConfig, ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from lintime.models.families.mc_tfm import MCConfig
from lintime.ops import MixedChunkState

V = BYTE_VOCAB


def cfg(**mixer) -> ModelConfig:
    """A small 2-block MC-TFM++ (d=32, 4 heads, C=8, GEGLU) with the given options."""
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, family="mc_tfm",
                       mixer=MCConfig(**{"n_heads": 4, "chunk_size": 8, **mixer}),
                       ffn=FFNConfig(kind="glu", expansion=4, activation="gelu"), position="scaled_sin")


# ----------------------------------------------------------------------------- parallel == recurrent
# the options besides the defaults (those: test_every_family.py on mc-tfm-pp-tiny with C = 8)
OPTIONS = [dict(linear_norm="chunk"), dict(linear_norm="none"), dict(n_heads=2, chunk_size=5), dict(rope=False)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_full_sequence_equals_prefill_plus_decoding(opts):
    state = check_prefill_plus_decoding(build(cfg(**opts)), f"mc {opts}", T=30, B=2, splits=([8], [5, 16, 19]))
    assert isinstance(state.layers[0], MixedChunkState)


def test_decoding_state_counts_chunks():
    """The state holds the tokens summed into the linear state (whole chunks) and the current chunk's fill."""
    m = build(cfg())
    with torch.no_grad():
        for T in (10, 29):
            _, state = m(torch.randint(0, V, (1, T)), return_state=True)
            layer = state.layers[0]
            assert layer.count.tolist() == [T // 8 * 8] and layer.fill.tolist() == [T % 8]


# ----------------------------------------------------------------------------- presets, config
def test_base_preset_is_transformer_pp_with_mixed_chunks():
    """The seed gives MC-TFM++ no parameter count; it is compared with Transformer++ at the 110M
    scale (Figure 7, Table 5), whose Table 9 / Table 8 count is 110M (``test_presets.py``)."""
    for name in ("mc-tfm-pp-base", "mc-tfm-pp-base-mlm"):
        c = get_preset(name)
        assert (c.d_model, c.n_layers, c.mixer.n_heads, c.mixer.chunk_size) == (768, 12, 12, 256)
        assert (c.ffn.kind, c.ffn.activation, c.position, c.mixer.rope) == ("glu", "gelu", "scaled_sin", True)
        with torch.device("meta"):
            got = CausalLM(c).num_parameters()
            tpp = CausalLM(get_preset(name.replace("mc-tfm-pp", "transformer-pp"))).num_parameters()
        assert got - tpp == 4 * c.d_model * c.n_layers  # + the linear heads' scale / offset: 4 d per layer
    assert get_preset("mc-tfm-pp-base-mlm").norm == "scalenorm"


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="d_model=30 is not divisible by n_heads=4"):
        dataclasses.replace(cfg(), d_model=30)
    with pytest.raises(ValueError, match="RoPE needs an even head size, got 5"):
        dataclasses.replace(cfg(), d_model=20)
