"""Layers against the seed's pseudocode (Codes 2-5, Eq. 1-2), written out literally here."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers import (
    GLU,
    BatchState,
    MLP,
    KVCache,
    LayerNorm,
    Mixer,
    MultiHeadAttention,
    RMSNorm,
    ScaledSinEmbedding,
    ScaleNorm,
    ToeplitzRelativeBias,
    apply_rope,
    build_norm,
    select_state,
    state_to,
    token_positions,
)
from tolerances import assert_exact

D64 = torch.float64


# ----------------------------------------------------------------------------- norms (Code 5)
def test_layernorm_matches_torch():
    x = torch.randn(3, 5, 16, dtype=D64)
    n = LayerNorm(16).double()
    with torch.no_grad():
        n.weight.normal_()
        n.bias.normal_()
    assert_exact("layernorm", F.layer_norm(x, (16,), n.weight, n.bias, 1e-5), n(x))


def test_scalenorm_and_rmsnorm_formulas():
    x = torch.randn(4, 7, 12, dtype=D64)
    s = ScaleNorm(12).double()
    with torch.no_grad():
        s.scale.fill_(1.7)
    ref = 1.7 * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5)  # seed Code 5, scale_norm
    assert_exact("scalenorm", ref, s(x))
    assert s.scale.shape == () and sum(p.numel() for p in s.parameters()) == 1
    r = RMSNorm(12).double()
    with torch.no_grad():
        r.weight.normal_()
    assert_exact("rmsnorm", r.weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5), r(x))


def test_norms_keep_half_dtype_and_bad_name():
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    for kind in ("layernorm", "scalenorm", "rmsnorm"):
        assert build_norm(kind, 8)(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown norm 'batchnorm'"):
        build_norm("batchnorm", 8)


# ----------------------------------------------------------------------------- positions
def test_token_positions_restart_and_offset():
    assert token_positions(2, 3).tolist() == [[0, 1, 2], [0, 1, 2]]
    assert token_positions(2, 3, offset=torch.tensor([4, 0])).tolist() == [[4, 5, 6], [0, 1, 2]]
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    assert token_positions(1, 5, cu_seqlens=cu).tolist() == [[0, 1, 0, 1, 2]]
    off = torch.tensor([3, 9, 1])
    assert token_positions(1, 5, offset=off, cu_seqlens=cu).tolist() == [[3, 4, 1, 2, 3]]
    with pytest.raises(ValueError, match="batch size must be 1"):
        token_positions(2, 5, cu_seqlens=cu)


def _code2_scaledsin(T, d, scalar):
    # seed Code 2, literally (``scalar`` is the learned scalar, initialised to 1/sqrt(d))
    pos = torch.arange(T, dtype=D64)
    half_d = d // 2
    inv_freq = 10000 ** -(torch.arange(half_d, dtype=D64) / half_d)
    sinusoid = torch.einsum("s,d->sd", pos, inv_freq)
    return torch.cat([sinusoid.sin(), sinusoid.cos()], dim=-1) * scalar


def test_scaledsin_is_code2():
    e = ScaledSinEmbedding(10).double()
    assert e.scale.item() == pytest.approx(1 / math.sqrt(10))  # to the fp32 it was created in
    out = e(token_positions(2, 6), dtype=D64)
    assert_exact("scaledsin", _code2_scaledsin(6, 10, e.scale.item()).expand(2, 6, 10), out)
    with pytest.raises(ValueError, match="even"):
        ScaledSinEmbedding(7)


def _code3_rope(x):
    # seed Code 3 with axis=1 on [B, T, H, D]: positions 0..T-1 along T
    T, D = x.shape[1], x.shape[-1]
    position = torch.arange(T, dtype=D64)[:, None]  # expand over H
    half = D // 2
    inv_freq = 10000 ** -(torch.arange(half, dtype=D64) / half)
    sinusoid = position[..., None] * inv_freq  # [T, 1, D/2]
    sin, cos = sinusoid.sin(), sinusoid.cos()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def test_rope_is_code3_relative_and_continues_with_offset():
    x = torch.randn(2, 9, 3, 8, dtype=D64)
    pos = token_positions(2, 9)
    out = apply_rope(x, pos)
    assert_exact("rope vs Code 3", _code3_rope(x), out)
    # decoding: positions 5.. applied to the tail equal the full call's tail
    assert_exact("rope offset", out[:, 5:], apply_rope(x[:, 5:], token_positions(2, 4, offset=torch.tensor([5, 5]))))
    # rope(q, i) . rope(k, j) depends on i - j only
    q, k = torch.randn(8, dtype=D64), torch.randn(8, dtype=D64)

    def dot(i, j):
        qi = apply_rope(q.view(1, 1, 8), torch.tensor([i]))
        kj = apply_rope(k.view(1, 1, 8), torch.tensor([j]))
        return (qi * kj).sum()

    assert dot(7, 3).item() == pytest.approx(dot(104, 100).item(), rel=1e-12)
    assert dot(7, 3).item() != pytest.approx(dot(7, 4).item(), rel=1e-6)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1))


def _code4_direct(w_seed, n):
    # seed Code 4, n < 512 branch, literally (tf.pad / tile / reshape / slice)
    t = F.pad(w_seed, (0, n))
    t = t.repeat(n)
    t = t[..., :-n]
    t = t.reshape(n, 3 * n - 2)
    r = (2 * n - 1) // 2
    return t[..., r:-r]


def test_toeplitz_direct_is_code4():
    n = 6
    b = ToeplitzRelativeBias(n).double()
    assert b.mode == "direct" and b.weight.shape == (1, 2 * n - 1)
    # the seed indexes its vector by j - i, the op contract's layout by i - j: same parameter, reversed
    ref = _code4_direct(b.weight[0].flip(0), n)
    assert_exact("toeplitz direct", ref, b.matrix(n)[0])
    # a shorter call reads the same offsets (decoding == training)
    assert_exact("toeplitz prefix", b.matrix(n)[:, :4, :4], b.matrix(4))
    with pytest.raises(ValueError, match="offsets up to 5"):
        b.diagonals(7)


def test_toeplitz_rope_built_is_code4():
    n = 600
    b = ToeplitzRelativeBias(n, heads=2).double()
    assert b.mode == "rope" and b.a.shape == (2, 128)
    T = 40  # rope-built: any length; check Code 4's construction at T positions
    for h in range(2):
        pos = torch.arange(T)
        a = apply_rope(b.a[h].expand(T, 1, 128), pos)[:, 0]
        bb = apply_rope(b.b[h].expand(T, 1, 128), pos)[:, 0]
        assert_exact("toeplitz rope", torch.einsum("mk,nk->mn", a, bb), b.matrix(T)[h])
    # the parameters are skipped by weight decay
    assert b.no_weight_decay() == {"a", "b"}


# ----------------------------------------------------------------------------- FFN (Eq. 1-2)
def test_mlp_and_glu_formulas():
    x = torch.randn(2, 5, 8, dtype=D64)
    mlp = MLP(8, 32).double()
    assert_exact("mlp", mlp.down(F.gelu(mlp.up(x))), mlp(x))
    glu = GLU(8, 6, activation_name="gelu").double()
    Wu, Wv = glu.up.weight[:6], glu.up.weight[6:]
    bu, bv = glu.up.bias[:6], glu.up.bias[6:]
    ref = glu.down(F.gelu(x @ Wu.T + bu) * (x @ Wv.T + bv))  # seed Eq. 1-2, GEGLU
    assert_exact("glu", ref, glu(x))
    swi = GLU(8, 6, activation_name="silu", value_activation="silu").double()
    u, v = swi.up(x).split(6, -1)
    assert_exact("glu silu/silu", swi.down(F.silu(u) * F.silu(v)), swi(x))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        MLP(8, 16, activation_name="swish")


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("rope", [False, True])
def test_mha_state_path_equals_full_path(rope):
    mha = MultiHeadAttention(16, 4, rope=rope).double()
    assert isinstance(mha, Mixer)
    x = torch.randn(3, 11, 16, dtype=D64)
    pos = token_positions(3, 11)
    full, none_state = mha(x, positions=pos)
    assert none_state is None
    st = mha.init_state(3, "cpu", D64)
    y1, st = mha(x[:, :4], st, positions=pos[:, :4])
    y2, st2 = mha(x[:, 4:], st, positions=pos[:, 4:])
    assert_exact("mha cache", full, torch.cat([y1, y2], 1))
    assert st2.lengths.tolist() == [11, 11, 11] and st2.max_length == 11
    assert st.lengths.tolist() == [4, 4, 4]  # states are values: the old one is untouched
    y2b, _ = mha(x[:, 4:], st, positions=pos[:, 4:])
    assert_exact("mha reuse old state", y2, y2b)


def test_mha_errors():
    mha = MultiHeadAttention(16, 4, causal=False)
    with pytest.raises(ValueError, match="needs causal"):
        mha(torch.randn(1, 3, 16), mha.init_state(1, "cpu", torch.float32), positions=token_positions(1, 3))
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(10, 4)
    mha = MultiHeadAttention(16, 4)
    with pytest.raises(ValueError, match="holds 2 sequences but the input has 3"):
        mha(torch.randn(3, 1, 16), mha.init_state(2, "cpu", torch.float32), positions=token_positions(3, 1))


def test_kvcache_select_and_to():
    k = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 2, 1, 4).contiguous()
    c = KVCache(k, -k, torch.tensor([2, 1, 2]), 2)
    s = c.select(torch.tensor([2, 0, 0, 1]))
    assert s.batch_size == 4 and s.max_length == 2
    assert s.k[:, 0, 0, 0].tolist() == [2.0, 0.0, 0.0, 1.0]
    assert s.v[:, 0, 0, 0].tolist() == [-2.0, 0.0, 0.0, -1.0]
    assert s.lengths.tolist() == [2, 2, 2, 1]
    assert c.to("cpu").k.device.type == "cpu"


# ----------------------------------------------------------------------------- state helpers
@dataclasses.dataclass
class _OpLikeState:  # like the ops' MixedChunkState: batch-first tensors, no methods
    kv: torch.Tensor
    fill: torch.Tensor


@dataclasses.dataclass
class _LayerState(BatchState):
    op: _OpLikeState
    extra: list
    chunk: int = 7


def test_state_helpers_select_any_batch_first_state():
    idx = torch.tensor([1, 1, 0])
    t = torch.arange(6.0).view(2, 3)
    assert torch.equal(select_state(t, idx), t[idx])  # a bare [N, ...] tensor (linear attention / GLA)
    op = _OpLikeState(torch.arange(2.0).view(2, 1, 1), torch.tensor([3, 4]))
    assert select_state(op, idx).fill.tolist() == [4, 4, 3]  # a plain dataclass
    st = _LayerState(op, [torch.tensor([10, 20])])
    s = st.select(idx)
    assert s.op.fill.tolist() == [4, 4, 3] and s.extra[0].tolist() == [20, 20, 10] and s.chunk == 7
    assert s.batch_size == 3 and st.batch_size == 2
    assert select_state(None, idx) is None and state_to(st, "cpu").op.kv.device.type == "cpu"


def test_lintime_layers_exports_every_mixer_and_state():
    """Every Mixer and BatchState class defined under lintime/layers is exported by lintime.layers,
    and every registered family builds one of them (a new mixer cannot be left out)."""
    import importlib
    import inspect
    import pkgutil

    import lintime.layers as layers
    from lintime.models import CausalLM, available_families, get_preset
    from lintime.models.presets import all_presets

    defined = set()
    for info in pkgutil.iter_modules(layers.__path__):
        mod = importlib.import_module(f"lintime.layers.{info.name}")
        for name, obj in inspect.getmembers(mod, inspect.isclass):
            if obj.__module__ == mod.__name__ and issubclass(obj, (Mixer, BatchState)) and not name.startswith("_"):
                defined.add(obj)
    exported = {getattr(layers, n) for n in layers.__all__}
    missing = sorted(c.__qualname__ for c in defined - exported)
    assert not missing, f"lintime.layers does not export {missing}"
    presets = all_presets()
    from lintime.models.registry import get_family

    # the shipped families (tests register toy families without presets in the same process)
    shipped = [f for f in available_families() if get_family(f).build_mixer.__module__.startswith("lintime.")]
    assert len(shipped) >= 9  # softmax, gau, flash, mc_tfm, linear, gla, vq, performer, combiner
    for family in shipped:
        tiny = min((n for n, c in presets.items() if c.family == family), key=lambda n: presets[n].d_model)
        model = CausalLM(get_preset(tiny, vocab_size=16, n_layers=1))
        assert type(model.backbone.blocks[0].mixer) in exported, family
