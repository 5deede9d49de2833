"""Family ``performer`` (FLASH seed baseline: Performer, ReLU kernel, RoPE): the layer against the
kernel formula written out here, fixed random features (a buffer, not parameters),
parallel == prefill + decoding (packed too), a state that does not grow with T, Tables 8-9
counts, training, configs."""

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
    meta_params_m,
    model,
    overfit,
    state_numel,
)

from lintime.layers.performer import PerformerAttention
from lintime.layers.positional import apply_rope
from lintime.models import CausalLM, MaskedLM, all_presets, get_preset
from lintime.models.families.performer import PerformerConfig
from tolerances import assert_exact

D64 = torch.float64


def kernel_formula(layer, x, pos, causal=True):
    """``phi(x) = relu(x W^T / sqrt(M)) + eps`` on RoPE'd q, k; ``o_i = sum_j (phi(q_i).phi(k_j)) v_j
    / sum_j phi(q_i).phi(k_j)`` over ``j <= i`` (dense, one head at a time)."""
    B, T, _ = x.shape
    H, D = layer.n_heads, layer.head_dim
    q, k, v = layer.qkv(x).view(B, T, 3, H, D).unbind(2)
    q, k = apply_rope(q, pos), apply_rope(k, pos)

    def phi(t):
        if layer.projection is not None:
            t = t @ layer.projection.T / layer.num_features**0.5
        return F.relu(t) + layer.feature_eps

    outs = []
    for h in range(H):
        A = phi(q[:, :, h]) @ phi(k[:, :, h]).transpose(1, 2)
        if causal:
            A = A.tril()
        outs.append(A @ v[:, :, h] / A.sum(-1, keepdim=True))
    return layer.out(torch.stack(outs, 2).reshape(B, T, H * D))


@pytest.mark.parametrize("features", ["random", "learned", "none"])
@pytest.mark.parametrize("causal", [True, False])
def test_layer_is_the_kernel_formula(features, causal):
    layer = PerformerAttention(32, 4, features=features, num_features=12, causal=causal, chunk_size=4).double()
    x = torch.randn(2, 11, 32, dtype=D64)
    pos = torch.arange(11).expand(2, 11)
    y, _ = layer(x, positions=pos)
    assert_exact(f"performer {features} causal={causal}", kernel_formula(layer, x, pos, causal), y)


def test_random_features_are_a_fixed_buffer():
    a = PerformerAttention(32, 4, num_features=20, feature_seed=3)
    b = PerformerAttention(32, 4, num_features=20, feature_seed=3)
    c = PerformerAttention(32, 4, num_features=20, feature_seed=4)
    assert torch.equal(a.projection, b.projection) and not torch.equal(a.projection, c.projection)
    assert "projection" in a.state_dict() and "projection" not in dict(a.named_parameters())
    assert a.projection.shape == (20, 8)
    # orthogonal blocks: the first D rows are orthogonal directions
    w = a.projection[:8] / a.projection[:8].norm(dim=1, keepdim=True)
    assert torch.allclose(w @ w.T, torch.eye(8), atol=1e-5)
    learned = PerformerAttention(32, 4, features="learned", num_features=20)
    assert learned.projection.requires_grad and learned.no_weight_decay() == {"projection"}
    # layers of a model draw different features (seed + layer index)
    m = CausalLM(get_preset("performer-tiny"))
    p0, p1 = (blk.mixer.projection for blk in m.backbone.blocks)
    assert not torch.equal(p0, p1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_sequence_equals_prefill_plus_decoding(dtype):
    check_prefill_plus_decoding("performer-tiny", dtype)


@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(cls):
    check_packed_equals_separate("performer-tiny", cls)


def test_packed_prefill_then_decoding():
    check_packed_prefill_then_decoding("performer-tiny")


def test_select_for_beam_search():
    check_select("performer-tiny")


def test_state_size_is_constant_in_T():
    m = model("performer-tiny")
    with torch.no_grad():
        sizes = [state_numel(m(torch.randint(0, 256, (2, T)), return_state=True)[1]) for T in (1, 10, 300)]
    M, H, D = 32, 4, 16
    assert sizes == [2 * 2 * H * (M * D + M)] * 3  # 2 layers x 2 sequences x (kv [M, D] + k_sum [M])


def test_parameter_counts_vs_seed_tables():
    """Tables 8-9: Performer 110M (d=768, 12+12 layers).  Table 10 has no Performer row:
    ``performer-large`` takes Transformer+'s large shape, whose parameters it has exactly (the
    random features are a buffer), so it is checked against Transformer+'s 486M."""
    assert_within_5pct("performer-base", 110)
    assert_within_5pct("performer-base-mlm", 110)
    assert_within_5pct("performer-large", 486)
    assert meta_params_m("performer-base") == meta_params_m("transformer-p-base")
    cfg, mlm = get_preset("performer-base"), get_preset("performer-base-mlm")
    assert (cfg.d_model, cfg.n_layers, cfg.mixer.n_heads, cfg.ffn.kind, cfg.ffn.activation) == (768, 12, 12, "mlp", "gelu")
    assert (cfg.position, cfg.mixer.rope, cfg.norm, mlm.norm) == ("scaled_sin", True, "layernorm", "scalenorm")


def test_tiny_overfits():
    overfit("performer-tiny")


@pytest.mark.parametrize("name", [n for n in all_presets() if n.startswith("performer-")])
def test_json_round_trip(name):
    check_json_round_trip(name, "performer")


BAD = [
    (dict(n_heads=-1), "PerformerConfig: n_heads must be a positive int"),
    (dict(features="favor+"), "PerformerConfig: features must be one of"),
    (dict(num_features=0), "PerformerConfig: num_features must be a positive int"),
    (dict(feature_eps=0.0), "PerformerConfig: feature_eps must be > 0"),
    (dict(feature_seed=-1), "PerformerConfig: feature_seed must be an int >= 0"),
    (dict(rope_base=1), "PerformerConfig: rope_base must be a number > 1"),
]


@pytest.mark.parametrize("kwargs,match", BAD, ids=[m for _, m in BAD])
def test_bad_configs_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PerformerConfig(**kwargs)


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="d_model=64 is not divisible by n_heads=3"):
        get_preset("performer-tiny", mixer=PerformerConfig(n_heads=3))
    with pytest.raises(ValueError, match="RoPE needs an even head size, got 9"):
        get_preset("performer-tiny", mixer=PerformerConfig(n_heads=4, head_dim=9))
