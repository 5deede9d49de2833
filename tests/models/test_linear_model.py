"""Family ``linear`` (seed ``linear-self-attention-is-faster.txt``) as a model: unnormalised decoding, the state's
documented shapes and dtype, GPT-2 shapes, model-level validation.  The layer against the seed's formula:
``tests/layers/test_linear_attention.py``; what every family passes: ``test_every_family.py``.

(The file is not called ``test_linear.py``: that basename is taken by ``tests/ops/``.)"""

import dataclasses

import pytest
import torch
from model_helpers import CausalLM, check_prefill_plus_decoding, meta_params_m, model, state_numel

from lintime.layers.linear_attention import LinearAttentionState
from lintime.models import ModelConfig, get_preset
from lintime.models.families.linear import LinearConfig


def test_unnormalised_decoding_and_state_type():
    m = model("linear-tiny", mixer=LinearConfig(n_heads=4, normalize=False))
    state = check_prefill_plus_decoding(m, "linear unnormalised", T=21, B=2, splits=([7, 8, 21],))
    s = state.layers[0]
    assert isinstance(s, LinearAttentionState) and s.k_sum is None and s.kv.shape == (2, 4, 16, 16)


def test_state_is_the_documented_one():
    """Per layer and sequence: ``kv [H, K, K]`` and the normaliser's ``k_sum [H, K]``, in the model's dtype."""
    m = model("linear-tiny")
    c = m.config
    H, K = c.mixer.n_heads, c.d_model // c.mixer.n_heads
    with torch.no_grad():
        _, state = m(torch.randint(0, 256, (2, 10)), return_state=True)
    assert state_numel(state) == c.n_layers * 2 * H * (K * K + K)  # layers x 2 sequences x (kv + k_sum)
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
    scales run "from 120 million to 1.5 billion" (``test_presets.py``)."""
    assert meta_params_m("linear-gpt2-124m") * 1e6 == 124_439_808
    cfg = get_preset("linear-gpt2-124m")
    assert (cfg.d_model, cfg.n_layers, cfg.mixer.n_heads, cfg.vocab_size) == (768, 12, 12, 50257)
    assert (cfg.position, cfg.max_positions, cfg.ffn.activation, cfg.norm) == ("learned", 1024, "gelu_tanh", "layernorm")
    assert get_preset("linear-gpt2-1.5b").d_model // get_preset("linear-gpt2-1.5b").mixer.n_heads == 64  # seed: d=64


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
