"""ModelConfig: validation with clear messages, JSON round trip by names, the family registry
(including a family added from outside the package, mixer-only blocks and a non-KV state)."""

import dataclasses
import json

import pytest
import torch

from lintime.layers import BatchState, Mixer
from lintime.models import (
    CausalLM,
    FFNConfig,
    ModelConfig,
    all_presets,
    available_families,
    get_family,
    get_preset,
    register_family,
)
from lintime.models import registry
from lintime.models.families.softmax import SoftmaxConfig
from tolerances import assert_exact


@pytest.mark.parametrize("name", list(all_presets()))
def test_json_round_trip(name):
    cfg = get_preset(name)
    text = cfg.to_json()
    d = json.loads(text)
    assert d["family"] == cfg.family and isinstance(d["mixer"], dict)  # names, not classes
    assert ModelConfig.from_json(text) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_defaults_and_replace():
    cfg = ModelConfig(vocab_size=100, d_model=32, n_layers=2, mixer=SoftmaxConfig(n_heads=4))
    assert cfg.family == "softmax" and cfg.ffn == FFNConfig() and cfg.init_std == 0.02
    assert ModelConfig(vocab_size=100, d_model=48, n_layers=1).mixer == SoftmaxConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 64
    with pytest.raises(ValueError, match="not divisible by n_heads=4"):
        dataclasses.replace(cfg, d_model=30)  # replace validates again
    assert get_preset("transformer-pp-tiny", vocab_size=512).vocab_size == 512
    mixer_only = dataclasses.replace(cfg, ffn=None)
    assert ModelConfig.from_json(mixer_only.to_json()) == mixer_only


BAD = [
    (dict(vocab_size=0), "vocab_size must be a positive int, got 0"),
    (dict(d_model=32.0), "d_model must be a positive int"),
    (dict(n_layers=True), "n_layers must be a positive int"),
    (dict(family="flashy"), "unknown model family 'flashy'; registered families: .*softmax"),
    (dict(family="Not A Module"), "unknown model family"),
    (dict(mixer=FFNConfig()), "family 'softmax' takes a SoftmaxConfig as `mixer`, got FFNConfig"),
    (dict(mixer=SoftmaxConfig(n_heads=5)), "d_model=32 is not divisible by n_heads=5"),
    (dict(ffn="glu"), "ffn must be an FFNConfig or None"),
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(norm_eps=0), "norm_eps must be > 0"),
    (dict(position="rotary"), "position must be one of"),
    (dict(position="learned"), "position='learned' needs max_positions >= 1"),
    (dict(max_positions=128), "max_positions=128 only applies to position='learned'"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(init_std=-0.02), "init_std must be > 0"),
    (dict(tie_embeddings="yes"), "tie_embeddings must be a bool"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m for _, m in BAD])
def test_bad_model_configs_fail_clearly(kwargs, match):
    base = dict(vocab_size=100, d_model=32, n_layers=2, mixer=SoftmaxConfig(n_heads=4))
    with pytest.raises(ValueError, match="ModelConfig|SoftmaxConfig|unknown model family") as e:
        ModelConfig(**{**base, **kwargs})
    assert e.match(match)


@pytest.mark.parametrize("kwargs,match", [
    (dict(kind="moe"), "kind must be one of"),
    (dict(expansion=0), "expansion must be a positive number"),
    (dict(hidden=0), "hidden must be a positive int or None"),
    (dict(activation="swish"), "activation must be one of"),
    (dict(dropout=-0.1), r"dropout must be in \[0, 1\)"),
])
def test_bad_ffn_configs(kwargs, match):
    with pytest.raises(ValueError, match="FFNConfig: " + match):
        FFNConfig(**kwargs)


def test_bad_sub_configs_and_dicts():
    with pytest.raises(ValueError, match="SoftmaxConfig: n_heads must be a positive int"):
        SoftmaxConfig(n_heads=0)
    with pytest.raises(ValueError, match="RoPE needs an even head size"):
        ModelConfig(vocab_size=10, d_model=12, n_layers=1, mixer=SoftmaxConfig(n_heads=4, rope=True))
    d = get_preset("transformer-tiny").to_dict()
    with pytest.raises(ValueError, match=r"ModelConfig: unknown field\(s\) \['n_head'\]"):
        ModelConfig.from_dict({**d, "n_head": 4})
    with pytest.raises(ValueError, match=r"mixer \(softmax\): unknown field\(s\) \['heads'\]"):
        ModelConfig.from_dict({**d, "mixer": {"heads": 4}})
    with pytest.raises(ValueError, match="unknown preset 'transformer-xl'"):
        get_preset("transformer-xl")


def test_ffn_hidden_sizes():
    # GLU keeps the MLP's parameters: 2/3 of the MLP width (seed Tables 8-10, see docs/models.md)
    assert FFNConfig(kind="mlp", expansion=4).hidden_size(768) == 3072
    assert FFNConfig(kind="glu", expansion=4).hidden_size(768) == 2048
    assert FFNConfig(kind="glu", hidden=100).hidden_size(768) == 100


# ----------------------------------------------------------------------------- a family from outside
@dataclasses.dataclass
class ShiftState(BatchState):
    """``prev [N, d]``: the previous token's input (zeros before the first token)."""

    prev: torch.Tensor


class ShiftMixer(Mixer):
    """Toy causal mixer, ``y_t = W x_{t-1}``: a one-vector recurrent state instead of a KV cache,
    and an auxiliary loss, to exercise the protocol the way the linear families will."""

    def __init__(self, d, causal):
        super().__init__()
        self.causal = causal
        self.proj = torch.nn.Linear(d, d, bias=False)

    def forward(self, x, state=None, *, positions, cu_seqlens=None, aux_losses=None):
        assert cu_seqlens is None, "toy mixer: no packing"
        first = torch.zeros_like(x[:, :1]) if state is None else state.prev[:, None].to(x.dtype)
        shifted = torch.cat([first, x[:, :-1]], 1)
        if aux_losses is not None:
            aux_losses["toy"] = aux_losses.get("toy", 0) + x.pow(2).mean()
        return self.proj(shifted), None if state is None else ShiftState(x[:, -1])

    def init_state(self, batch_size, device, dtype):
        return ShiftState(torch.zeros(batch_size, self.proj.in_features, device=device, dtype=dtype))


@dataclasses.dataclass(frozen=True)
class ShiftConfig:
    pass


def _build_shift(config, layer_idx, causal):
    return ShiftMixer(config.d_model, causal)


def test_register_a_family_from_outside(monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))  # undone after the test
    register_family("toy_shift", ShiftConfig, _build_shift, description="test")
    register_family("toy_shift", ShiftConfig, _build_shift)  # idempotent
    with pytest.raises(ValueError, match="already registered"):
        register_family("toy_shift", SoftmaxConfig, _build_shift)
    with pytest.raises(ValueError, match="must be lower-case"):
        register_family("Toy-Shift", ShiftConfig, _build_shift)
    assert "toy_shift" in available_families() and get_family("toy_shift").config_cls is ShiftConfig

    cfg = ModelConfig(vocab_size=50, d_model=16, n_layers=3, family="toy_shift", ffn=None, position="scaled_sin")
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    m = CausalLM(cfg).double()
    assert all(b.ffn is None for b in m.backbone.blocks)  # mixer-only blocks
    ids = torch.randint(0, 50, (2, 9))
    aux = {}
    full = m(ids, aux_losses=aux)
    assert aux["toy"].requires_grad  # three layers added their loss
    outs, state = [], None
    for t in range(9):
        lg, state = m(ids[:, t : t + 1], state, return_state=True)
        outs.append(lg)
    assert_exact("toy family decode", full, torch.cat(outs, 1))
    sel = state.select(torch.tensor([1, 1]))
    assert torch.equal(sel.layers[0].prev[0], state.layers[0].prev[1])


def test_a_builder_must_return_a_mixer(monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    register_family("toy_linear", ShiftConfig, lambda c, i, causal: torch.nn.Linear(4, 4))
    cfg = ModelConfig(vocab_size=5, d_model=4, n_layers=1, family="toy_linear")
    with pytest.raises(TypeError, match="built a Linear, which is not a lintime.layers.Mixer"):
        CausalLM(cfg)
