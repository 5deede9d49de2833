"""Family ``gau`` (FLASH-Quad): the GAU layer against seed Code 6 written out literally, every
option of the layer (scalings, causal normaliser, Table 1 ablations, RoPE-only), parallel ==
prefill + decoding with packing, presets against the seed's tables, config validation, training.

(Not ``test_gau.py``: that basename belongs to ``tests/ops/`` and pytest's default import mode
refuses two test modules with one basename.)"""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.gau import GAU
from lintime.models import CausalLM, MaskedLM, ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from lintime.models.families.gau import GAUConfig
from tolerances import assert_exact
from model_helpers import decode_in_pieces, packed

V = BYTE_VOCAB


def cfg(**mixer) -> ModelConfig:
    """A small 2-layer FLASH-Quad (d=32, e=64, s=16) with the given GAU options."""
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, family="gau", mixer=GAUConfig(**{"s": 16, **mixer}),
                       ffn=None, position="scaled_sin")


_MODELS = {}


def model(config, dtype=torch.float64, cls=CausalLM):
    key = (config.to_json(), dtype, cls)
    if key not in _MODELS:
        torch.manual_seed(1)
        _MODELS[key] = cls(config).to(dtype).eval()
    return _MODELS[key]




# ----------------------------------------------------------------------------- seed Code 6
def _code3_rope(x):
    """Seed Code 3 on ``[B, T, s]`` along axis 1."""
    T, D = x.shape[1], x.shape[-1]
    half = D // 2
    inv_freq = 10000 ** -(torch.arange(half, dtype=x.dtype) / half)
    ang = torch.arange(T, dtype=x.dtype)[:, None] * inv_freq
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def _code4_direct(w, n):
    """Seed Code 4, ``n < 512`` branch, literally: ``w [2n - 1]`` -> ``[n, n]``."""
    t = F.pad(w, (0, n)).repeat(n)[:-n].reshape(n, 3 * n - 2)
    r = (2 * n - 1) // 2
    return t[:, r:-r]


def _code6(layer: GAU, x, causal, n):
    """Seed Code 6 (without the norm and the residual, which the block owns)."""
    e, s = layer.e, layer.s
    uv = F.silu(x @ layer.proj.weight.T + layer.proj.bias)
    u, v, base = uv.split([e, e, s], -1)
    base = base[..., None, :] * layer.qk.gamma + layer.qk.beta  # '...r,hr->...hr'
    base = torch.stack([_code3_rope(base[..., 0, :]), _code3_rope(base[..., 1, :])], -2)
    q, k = base.unbind(-2)
    qk = torch.einsum("bnd,bmd->bnm", q, k)
    # the seed's vector is indexed by j - i, ours by i - j: the same parameter read backwards
    bias = _code4_direct(layer.rel_bias.weight[0].flip(0), n)[: x.shape[1], : x.shape[1]]
    kernel = torch.relu(qk / n + bias) ** 2
    if causal:
        kernel = kernel * torch.ones_like(kernel[0]).tril()
    out = u * torch.einsum("bnm,bme->bne", kernel, v)
    return out @ layer.out.weight.T + layer.out.bias


@pytest.mark.parametrize("causal", [True, False])
def test_gau_layer_is_code6(causal):
    torch.manual_seed(0)
    n = 24  # Code 6 divides by the call length; our n is the fixed max_len, equal here
    layer = GAU(16, expansion_dim=32, key_dim=8, max_len=n, causal=causal).double()
    with torch.no_grad():
        layer.qk.gamma.normal_()  # the seed init (N(0, 0.02)) makes q.k tiny; test real values
        layer.qk.beta.normal_()
        layer.proj.bias.normal_()
    x = torch.randn(2, n, 16, dtype=torch.float64)
    y, state = layer(x, positions=torch.arange(n).expand(2, n))
    assert state is None
    assert_exact(f"GAU vs Code 6 causal={causal}", _code6(layer, x, causal, n), y)
    # a prefix call gives the prefix: the scale is the fixed max_len, not the call length
    y8, _ = layer(x[:, :8], positions=torch.arange(8).expand(2, 8))
    if causal:
        assert_exact("prefix", y[:, :8], y8)


def _attention_by_hand(layer: GAU, x, **opts):
    """The layer's attention for every option, densely (one sequence per row, causal)."""
    B, T, _ = x.shape
    H, e, s = layer.n_heads, layer.e, layer.s
    h = F.silu(layer.proj(x))
    u, v, z = h.split([e, e, s], -1) if layer.gating else (None, *h.split([e, s], -1))
    q, k = layer.qk(z).unbind(-2)
    pos = torch.arange(T).expand(B, T)
    from lintime.layers.positional import apply_rope

    q = apply_rope(q.view(B, T, H, s // H), pos).transpose(1, 2)  # [B, H, T, s/H]
    k = apply_rope(k.view(B, T, H, s // H), pos).transpose(1, 2)
    vh = v.view(B, T, H, e // H).transpose(1, 2)
    qk = q @ k.transpose(-1, -2)
    b = layer.rel_bias.matrix(T) if layer.rel_bias is not None else 0.0
    t = torch.arange(1, T + 1, dtype=x.dtype)[:, None]  # keys seen by query i: "divide by t"
    N = t if opts["causal_norm"] else layer.max_len
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if opts["kernel"] == "softmax":
        a = torch.softmax((qk / math.sqrt(s // H) + b).masked_fill(~mask, -math.inf), -1)
    elif opts["scaling"] == "n":
        a = torch.relu(qk / N + b) ** 2 * mask
    else:
        a = torch.relu(qk / math.sqrt(s // H) + b) ** 2 * mask / N
    o = (a @ vh).transpose(1, 2).reshape(B, T, e)
    return layer.out(u * o if layer.gating else o)


OPTIONS = [
    dict(),
    dict(scaling="ns"),
    dict(causal_norm=True),
    dict(scaling="ns", causal_norm=True),
    dict(kernel="softmax"),
    dict(n_heads=2),
    dict(gating=False),
    dict(rel_bias=False),
    dict(max_len=48),  # a direct bias table (max_len < 512)
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "seed")
def test_every_option_matches_its_formula(opts):
    torch.manual_seed(0)
    c = GAUConfig(s=16, **opts)
    layer = GAU(32, expansion_dim=64, key_dim=16, max_len=c.max_len, kernel=c.kernel, scaling=c.resolved_scaling,
                causal_norm=c.causal_norm, n_heads=c.n_heads, gating=c.gating, rel_bias=c.rel_bias).double()
    with torch.no_grad():
        layer.qk.gamma.normal_()
    x = torch.randn(2, 21, 32, dtype=torch.float64)
    y, _ = layer(x, positions=torch.arange(21).expand(2, 21))
    full = dict(kernel=c.kernel, scaling=c.resolved_scaling, causal_norm=c.causal_norm)
    assert_exact(f"GAU {opts}", _attention_by_hand(layer, x, **full), y)


# ----------------------------------------------------------------------------- parallel == recurrent
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "seed")
def test_full_sequence_equals_prefill_plus_decoding(opts):
    m = model(cfg(**opts))
    ids = torch.randint(0, V, (2, 30))
    with torch.no_grad():
        full = m(ids)
        for splits in ([1], [5, 17, 26]):
            pieces, state = decode_in_pieces(m, ids, splits)
            assert_exact(f"gau {opts} prefill {splits}", full, pieces)
    assert state.offset.tolist() == [30, 30]


def test_fp32_decoding():
    m = model(cfg(), torch.float32)
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert_exact("gau fp32", m(ids), decode_in_pieces(m, ids, [7])[0])


@pytest.mark.parametrize("opts", [dict(), dict(kernel="softmax"), dict(causal_norm=True, scaling="ns")],
                         ids=["seed", "softmax", "causal_norm"])
@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(opts, cls):
    m = model(cfg(**opts), cls=cls)
    seqs, ids, cu = packed([7, 1, 0, 19, 12])
    with torch.no_grad():
        ref = torch.cat([m(s) for s in seqs if s.shape[1]], 1)
        assert_exact(f"gau {opts} {cls.__name__} packed", ref, m(ids, cu_seqlens=cu))


def test_packed_prefill_then_decoding_and_select():
    m = model(cfg())
    lengths = [5, 12, 1, 9]
    seqs, ids, cu = packed(lengths)
    more = torch.randint(0, V, (4, 3))
    with torch.no_grad():
        logits, state = m(ids, cu_seqlens=cu, return_state=True)
        assert_exact("packed prefill", m(ids, cu_seqlens=cu), logits)
        steps = []
        st = state
        for t in range(3):
            lg, st = m(more[:, t : t + 1], st, return_state=True)
            steps.append(lg)
        ref = torch.stack([m(torch.cat([s, more[i : i + 1]], 1))[0, -3:] for i, s in enumerate(seqs)])
        assert_exact("decode after packed prefill", ref, torch.cat(steps, 1))
        # a packed piece continues each sequence's cache
        lg, st2 = m(torch.cat([more[0:1], more[2:3, :1]], 1), state.select(torch.tensor([0, 2])),
                    return_state=True, cu_seqlens=torch.tensor([0, 3, 4]))
        ref = torch.cat([m(torch.cat([seqs[0], more[0:1]], 1))[:, -3:],
                         m(torch.cat([seqs[2], more[2:3, :1]], 1))[:, -1:]], 1)
        assert_exact("packed continuation after select", ref, lg)
        assert st2.offset.tolist() == [8, 2]


def test_state_is_a_kv_cache_that_grows():
    """FLASH-Quad is quadratic: its decoding state is a KV cache, O(T) (seed Section 3.1)."""
    m = model(cfg())
    with torch.no_grad():
        _, s10 = m(torch.randint(0, V, (1, 10)), return_state=True)
        _, s40 = m(torch.randint(0, V, (1, 40)), return_state=True)
    assert s10.layers[0].lengths.tolist() == [10] and s40.layers[0].lengths.tolist() == [40]
    assert s40.layers[0].k.shape[1] >= 40


def test_direct_bias_length_limit_is_a_clear_error():
    m = model(cfg(max_len=16))
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
SEED_TABLE_PARAMS_M = {
    "flash-quad-base": 112,  # Table 9 (LM, Wiki-40B)
    "flash-quad-base-mlm": 112,  # Table 8 (MLM, C4)
    "flash-quad-large": 496,  # Table 10 (LM, PG-19)
}


@pytest.mark.parametrize("name", sorted(SEED_TABLE_PARAMS_M))
def test_parameter_counts_match_seed_tables(name):
    with torch.device("meta"):
        m = CausalLM(get_preset(name))
    got, want = m.num_parameters() / 1e6, SEED_TABLE_PARAMS_M[name]
    assert abs(got - want) <= 0.05 * want, f"{name}: {got:.2f}M vs seed table {want}M"


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


def test_byte_vocabulary_is_the_byte_tokenizer():
    from lintime.data.tokenizer import ByteTokenizer

    assert BYTE_VOCAB == ByteTokenizer().vocab_size == get_preset("flash-quad-tiny").vocab_size


@pytest.mark.parametrize("name", ["flash-quad-tiny", "flash-quad-small", "flash-quad-base", "flash-quad-large",
                                  "flash-quad-base-mlm"])
def test_json_round_trip(name):
    c = get_preset(name)
    d = json.loads(c.to_json())
    assert d["family"] == "gau" and isinstance(d["mixer"], dict)
    assert ModelConfig.from_json(c.to_json()) == c
    varied = dataclasses.replace(c, mixer=GAUConfig(kernel="softmax", n_heads=2, gating=False))
    assert ModelConfig.from_json(varied.to_json()) == varied


BAD = [
    (dict(kernel="softmax", scaling="n"), "kernel='softmax' scales scores by 1/sqrt\\(s\\)"),
    (dict(kernel="softmax", causal_norm=True), "leave scaling=None|causal_norm applies to the relu2 kernel"),
    (dict(kernel="gelu"), "kernel must be one of"),
    (dict(scaling="n2"), "scaling must be one of"),
    (dict(s=0), "s must be an int >= 1"),
    (dict(max_len=0), "max_len must be an int >= 1"),
    (dict(expansion=-1), "expansion must be a positive number"),
    (dict(n_heads=3), "n_heads=3 must split s=128"),
    (dict(n_heads=128), "heads of even width"),
    (dict(gating=1), "gating must be a bool"),
    (dict(rope_base=1), "rope_base must be a number > 1"),
]


@pytest.mark.parametrize("kwargs,msg", BAD)
def test_bad_configs_fail_clearly(kwargs, msg):
    with pytest.raises(ValueError, match=f"GAUConfig: .*({msg})"):
        GAUConfig(**kwargs)


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
        f"backbone.blocks.{i}.mixer.{w}.weight" for i in range(4) for w in ("proj", "out")}
    g = m.backbone.blocks[0].mixer.qk.gamma
    assert abs(g.std().item() - 0.02) < 0.01 and torch.count_nonzero(m.backbone.blocks[0].mixer.qk.beta) == 0


# ----------------------------------------------------------------------------- training
def test_tiny_preset_overfits():
    torch.manual_seed(0)
    m = CausalLM(get_preset("flash-quad-tiny"))
    opt = torch.optim.AdamW(m.param_groups(0.01), lr=5e-3)
    ids = torch.randint(0, 256, (2, 33))
    losses = []
    for _ in range(30):
        logits = m(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ~ln(260) at init
    assert losses[-1] < 0.1 * losses[0], losses[::10]
