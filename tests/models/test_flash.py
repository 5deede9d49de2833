"""Family ``flash`` (FLASH): the layer against seed Code 8 written out literally (every
``linear_norm``, both scalings, causal and not), first-to-all against its formula, parallel ==
prefill + decoding across chunk boundaries with packing, a decoding state whose size does not
grow with T, presets against the seed's tables, config validation, training."""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from lintime.layers.flash import FLASH, FLASHState
from lintime.layers.positional import apply_rope
from lintime.models import CausalLM, MaskedLM, ModelConfig, get_preset
from lintime.models.families.flash import FlashConfig
from lintime.models.config import BYTE_VOCAB
from tolerances import assert_exact
from model_helpers import check_packed_decode_and_select, decode_in_pieces, packed, state_numel

V = BYTE_VOCAB


def cfg(**mixer) -> ModelConfig:
    """A small 2-layer FLASH (d=32, e=64, s=16, C=8) with the given options."""
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, family="flash",
                       mixer=FlashConfig(**{"s": 16, "chunk_size": 8, **mixer}), ffn=None, position="scaled_sin")


_MODELS = {}


def model(config, dtype=torch.float64, cls=CausalLM):
    key = (config.to_json(), dtype, cls)
    if key not in _MODELS:
        torch.manual_seed(1)
        _MODELS[key] = cls(config).to(dtype).eval()
    return _MODELS[key]





# ----------------------------------------------------------------------------- seed Code 8
def _code8(layer: FLASH, x, causal, linear_norm="tokens", scaling="n"):
    """Seed Code 8 on ``x [B, g * n, d]`` (one document per row), with ``linear_norm``:
    'tokens' = Code 8 as printed (normalised segment mask), 'chunk' = without the mask's
    normalisation, 'none' = Code 1 (no ``/ n`` either); ``scaling='ns'`` = the commentary's
    ``relu(qk / sqrt(s) + b)^2 / n``."""
    B, T, d = x.shape
    n, e, s = layer.chunk_size, layer.e, layer.s
    g = T // n
    uv = F.silu(x @ layer.proj.weight.T + layer.proj.bias)
    u, v, base = uv.split([e, e, s], -1)
    base = base[..., None, :] * layer.heads.gamma + layer.heads.beta  # [B, T, 4, s]
    base = apply_rope(base, torch.arange(T).expand(B, T))  # rope(base, axis=[1, 2]): absolute position
    u, v, base = u.view(B, g, n, e), v.view(B, g, n, e), base.view(B, g, n, 4, s)
    quad_q, quad_k, lin_q, lin_k = base.unbind(-2)
    lin_kv = torch.einsum("bgnk,bgne->bgke", lin_k, v)
    if linear_norm != "none":
        lin_kv = lin_kv / n
    if causal:
        mask = torch.ones(g, g, dtype=x.dtype).tril(-1)  # segment mask: earlier chunks
    else:
        mask = torch.ones(g, g, dtype=x.dtype)
    if linear_norm == "tokens":  # tf.math.divide_no_nan(mask, reduce_sum(mask))
        rows = mask.sum(-1, keepdim=True)
        mask = torch.where(rows > 0, mask / rows.clamp(min=1), torch.zeros_like(mask))
    cum_lin_kv = torch.einsum("bhke,gh->bgke", lin_kv, mask)
    linear = torch.einsum("bgnk,bgke->bgne", lin_q, cum_lin_kv)
    quad_qk = torch.einsum("bgnk,bgmk->bgnm", quad_q, quad_k)
    bias = layer.rel_bias.matrix(n)[0]
    if scaling == "n":
        kernel = torch.relu(quad_qk / n + bias) ** 2
    else:
        kernel = torch.relu(quad_qk / math.sqrt(s) + bias) ** 2 / n
    if causal:
        kernel = kernel * torch.ones(n, n, dtype=x.dtype).tril()
    quadratic = torch.einsum("bgnm,bgme->bgne", kernel, v)
    out = (u * (quadratic + linear)).reshape(B, T, e)
    return out @ layer.out.weight.T + layer.out.bias


def _layer(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    layer = FLASH(16, expansion_dim=32, key_dim=8, chunk_size=6, **kw).to(dtype)
    with torch.no_grad():  # the seed init (N(0, 0.02)) makes q.k tiny; test real values
        layer.heads.gamma.normal_()
        layer.heads.beta.normal_()
        layer.proj.bias.normal_()
    return layer


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("linear_norm", ["tokens", "chunk", "none"])
@pytest.mark.parametrize("scaling", ["n", "ns"])
def test_flash_layer_is_code8(causal, linear_norm, scaling):
    layer = _layer(causal=causal, linear_norm=linear_norm, scaling=scaling)
    x = torch.randn(2, 24, 16, dtype=torch.float64)  # 4 chunks of 6
    y, state = layer(x, positions=torch.arange(24).expand(2, 24))
    assert state is None
    assert_exact(f"FLASH vs Code 8 {causal} {linear_norm} {scaling}", _code8(layer, x, causal, linear_norm, scaling), y)


@pytest.mark.parametrize("causal", [True, False])
def test_first_to_all_formula(causal):
    """The first token of each chunk adds a single-head softmax attention over every (earlier)
    token of its sequence; every other token is FLASH's."""
    fta = _layer(causal=causal, first_to_all=True)
    plain = _layer(causal=causal)
    with torch.no_grad():
        shared = {"heads.gamma": fta.heads.gamma[:4], "heads.beta": fta.heads.beta[:4]}
        plain.load_state_dict({**fta.state_dict(), **shared})
    T = 21  # chunk starts 0, 6, 12, 18; the last chunk is partial
    x = torch.randn(2, T, 16, dtype=torch.float64)
    pos = torch.arange(T).expand(2, T)
    y, _ = fta(x, positions=pos)
    y0, _ = plain(x, positions=pos)
    first = torch.arange(T) % 6 == 0
    assert torch.equal(y[:, ~first], y0[:, ~first])
    # the added term, by hand
    u, v, z = F.silu(fta.proj(x)).split([32, 32, 8], -1)
    qf, kf = apply_rope(fta.heads(z)[:, :, 4:], pos).unbind(-2)  # [B, T, s]
    a = (qf @ kf.transpose(1, 2)) / math.sqrt(8)
    if causal:
        a = a.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    extra = u * (torch.softmax(a, -1) @ v)
    assert_exact("first-to-all term", (y0 + extra @ fta.out.weight.T)[:, first], y[:, first])


# ----------------------------------------------------------------------------- parallel == recurrent
OPTIONS = [
    dict(),
    dict(linear_norm="chunk"),
    dict(linear_norm="none"),
    dict(scaling="ns"),
    dict(first_to_all=True),
    dict(rel_bias=False),
    dict(chunk_size=5),
    dict(chunk_size=512),  # the RoPE-built chunk bias (C >= 512), one partial chunk
]


def _id(o):
    return ",".join(f"{k}={v}" for k, v in o.items()) or "seed"


@pytest.mark.parametrize("opts", OPTIONS, ids=_id)
def test_full_sequence_equals_prefill_plus_decoding(opts):
    """Across chunk boundaries (C=8, T=30), prefill pieces that end inside and on chunks."""
    m = model(cfg(**opts))
    ids = torch.randint(0, V, (2, 30))
    with torch.no_grad():
        full = m(ids)
        for splits in ([8], [5, 16, 19]):
            pieces, state = decode_in_pieces(m, ids, splits)
            assert_exact(f"flash {opts} prefill {splits}", full, pieces)
    assert state.offset.tolist() == [30, 30]
    assert isinstance(state.layers[0], FLASHState)


def test_fp32_decoding():
    m = model(cfg(first_to_all=True), torch.float32)
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert_exact("flash fp32", m(ids), decode_in_pieces(m, ids, [7])[0])


@given(T=st.integers(1, 40), cut=st.integers(0, 40), B=st.integers(1, 3))
def test_any_split_point(T, cut, B):
    m = model(cfg())
    ids = torch.randint(0, V, (B, T))
    cut = min(cut, T)
    with torch.no_grad():
        full = m(ids)
        pieces = [ids[:, :cut], ids[:, cut:]] if 0 < cut < T else [ids]
        outs, state = [], None
        for p in pieces:
            logits, state = m(p, state, return_state=True)
            outs.append(logits)
    assert_exact(f"split T={T} cut={cut}", full, torch.cat(outs, 1))


@pytest.mark.parametrize("opts", [dict(), dict(first_to_all=True)], ids=_id)
@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(opts, cls):
    m = model(cfg(**opts), cls=cls)
    seqs, ids, cu = packed([7, 1, 0, 19, 12])
    with torch.no_grad():
        ref = torch.cat([m(s) for s in seqs if s.shape[1]], 1)
        assert_exact(f"flash {opts} {cls.__name__} packed", ref, m(ids, cu_seqlens=cu))


@pytest.mark.parametrize("opts", [dict(), dict(first_to_all=True)], ids=_id)
def test_packed_prefill_then_decoding_and_select(opts):
    m = model(cfg(**opts))
    check_packed_decode_and_select(m, "flash", steps=11, vocab=V)


def test_decoding_state_size_is_constant_in_T():
    """FLASH decodes with O(1) memory per token in T (seed Section 3.2.1): the state after
    10, 100 or 333 tokens holds the same numbers; only first-to-all keeps every key."""
    m = model(cfg())
    sizes = []
    with torch.no_grad():
        for T in (10, 100, 333):
            _, state = m(torch.randint(0, V, (1, T)), return_state=True)
            sizes.append(state_numel(state))
            mc = state.layers[0].mc
            assert mc.count.tolist() == [T // 8 * 8] and mc.fill.tolist() == [T % 8]
            _, state = m(torch.randint(0, V, (1, 1)), state, return_state=True)
            sizes.append(state_numel(state))
    assert len(set(sizes)) == 1, sizes
    L, C, s, e = 2, 8, 16, 64
    assert sizes[0] == L * (s * e + 1 + C * (2 * s + e) + 1)  # kv, count, k_quad + k_lin + v, fill
    fta = model(cfg(first_to_all=True))
    with torch.no_grad():
        _, s1 = fta(torch.randint(0, V, (1, 10)), return_state=True)
        _, s2 = fta(torch.randint(0, V, (1, 100)), return_state=True)
    assert state_numel(s2) > state_numel(s1)  # documented: first-to-all decoding is O(T)


def test_state_errors():
    m = model(cfg())
    with pytest.raises(ValueError, match="holds 2 sequences"):
        m(torch.randint(0, V, (3, 1)), m.init_state(2))
    with pytest.raises(ValueError, match="first_to_all needs a state"):
        model(cfg(first_to_all=True))(torch.randint(0, V, (1, 2)), m.init_state(1))
    layer = FLASH(16, expansion_dim=32, key_dim=8, chunk_size=4, causal=False)
    with pytest.raises(ValueError, match="decoding state needs causal"):
        layer(torch.randn(1, 3, 16), layer.init_state(1, "cpu", torch.float32), positions=torch.arange(3)[None])


# ----------------------------------------------------------------------------- presets, config
SEED_TABLE_PARAMS_M = {
    "flash-base": 112,  # Table 9 (LM, Wiki-40B)
    "flash-base-mlm": 112,  # Table 8 (MLM, C4)
    "flash-large": 496,  # Table 10 (LM, PG-19)
}


@pytest.mark.parametrize("name", sorted(SEED_TABLE_PARAMS_M))
def test_parameter_counts_match_seed_tables(name):
    with torch.device("meta"):
        m = CausalLM(get_preset(name))
    got, want = m.num_parameters() / 1e6, SEED_TABLE_PARAMS_M[name]
    assert abs(got - want) <= 0.05 * want, f"{name}: {got:.2f}M vs seed table {want}M"


def test_seed_table_rows():
    base, large = get_preset("flash-base"), get_preset("flash-large")
    m = base.mixer
    assert (base.d_model, base.n_layers, m.s, m.expansion, m.chunk_size) == (768, 24, 128, 2, 256)
    assert (large.d_model, large.n_layers, large.mixer.chunk_size) == (1024, 72, 512)  # Table 10
    assert base.ffn is None and base.position == "scaled_sin" and base.norm == "layernorm"
    assert get_preset("flash-base-mlm").norm == "scalenorm"  # Table 8
    assert base.mixer.linear_norm == "tokens" and not base.mixer.first_to_all


def test_flash_tiny_is_a_byte_level_cpu_model():
    c = get_preset("flash-tiny")
    assert c.vocab_size == 260 and c.family == "flash" and c.ffn is None
    assert 128 <= c.d_model <= 256 and 4 <= c.n_layers <= 8 and c.mixer.s == 64 and 64 <= c.mixer.chunk_size <= 128
    assert CausalLM(c).num_parameters() < 1e6


@pytest.mark.parametrize("name", ["flash-tiny", "flash-small", "flash-base", "flash-large", "flash-base-mlm"])
def test_json_round_trip(name):
    c = get_preset(name)
    d = json.loads(c.to_json())
    assert d["family"] == "flash" and isinstance(d["mixer"], dict)
    assert ModelConfig.from_json(c.to_json()) == c
    varied = dataclasses.replace(c, mixer=FlashConfig(linear_norm="none", scaling="ns", first_to_all=True))
    assert ModelConfig.from_json(varied.to_json()) == varied


BAD = [
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(chunk_size=64.0), "chunk_size must be an int >= 1"),
    (dict(linear_norm="mean"), "linear_norm must be one of"),
    (dict(scaling="1/n"), "scaling must be one of"),
    (dict(s=7), "RoPE needs an even s"),
    (dict(expansion=0), "expansion must be a positive number"),
    (dict(first_to_all="yes"), "first_to_all must be a bool"),
]


@pytest.mark.parametrize("kwargs,msg", BAD)
def test_bad_configs_fail_clearly(kwargs, msg):
    with pytest.raises(ValueError, match=f"FlashConfig: {msg}"):
        FlashConfig(**kwargs)


# ----------------------------------------------------------------------------- training
def test_tiny_preset_overfits_causal_and_masked():
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 33))
    mask = torch.rand(2, 33) < 0.25
    for cls in (CausalLM, MaskedLM):
        m = cls(get_preset("flash-tiny"))
        opt = torch.optim.AdamW(m.param_groups(0.01), lr=5e-3)
        losses = []
        for _ in range(30):
            if cls is CausalLM:
                logits = m(ids[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
            else:
                logits = m(ids.masked_fill(mask, 259))  # 259 = the byte tokenizer's <mask>
                loss = F.cross_entropy(logits[mask], ids[mask])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] > 5.0  # ~ln(260) at init
        assert losses[-1] < 0.1 * losses[0], (cls.__name__, losses[::10])
