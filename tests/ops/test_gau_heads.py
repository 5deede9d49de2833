"""gau_heads (silu, split, scale + offset heads, RoPE): naive <-> chunk <-> triton for the outputs
``u, v, heads`` and the gradients of ``h``, ``gamma``, ``beta`` and the optional projection bias; the
layers (FLASH, GAU) against their math written out by hand.

Chain of trust: the naive form (the rotation written out per head and RoPE group, fp32 / fp64) is
the reference; the chunk form (the layers' former eager math) must match it in fp64 and fp32; the
fused kernel (on the CPU through the Triton interpreter, 16-row x 16-column tiles: small shapes
cross row blocks, the backward's 32- and 48-row groups and ``u`` / ``v`` tiles, with partial ones;
other launches too) must match it in fp32 at the exact
rule and in fp16 by the half-precision rule (bf16 on CUDA, where its rounding is the hardware's).
Positions are random integers, negative and large ones included (fp32 angles of ~1e5 radians).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from lintime.ops import gau_heads
from lintime.testing import (
    HALF_FACTOR,
    HALF_FLOOR,
    assert_exact,
    assert_half_rule,
    rel_rms,
)

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
NAMES = ("u", "v", "heads", "dh", "dgamma", "dbeta", "dbias")


def _inputs(B, T, e, s, nh, gating, dtype, *, seed=0, device="cpu", pmin=-300, pmax=100_000):
    """``h, gamma, beta, positions`` and the output gradients ``du, dv, dheads`` (fp64 drawn, then
    cast).  ``h`` has scale 2 (silu's curved part), gamma / beta O(1)."""
    h, gamma, beta, pos, grads, _ = _inputs_bias(B, T, e, s, nh, gating, dtype, seed=seed, device=device, pmin=pmin,
                                                 pmax=pmax)
    return h, gamma, beta, pos, grads


def _inputs_bias(B, T, e, s, nh, gating, dtype, *, seed=0, device="cpu", pmin=-300, pmax=100_000):
    """:func:`_inputs` and a projection bias ``[W]`` (scale 1), drawn after them (the other inputs are
    :func:`_inputs`' own)."""
    g = torch.Generator().manual_seed(seed * 1009 + T * 31 + e * 7 + s)
    W = (2 * e if gating else e) + s
    f64 = {"generator": g, "dtype": torch.float64}
    h = 2 * torch.randn(B, T, W, **f64)
    gamma, beta = torch.randn(nh, s, **f64), torch.randn(nh, s, **f64)
    pos = torch.randint(pmin, pmax, (B, T), generator=g)
    du = torch.randn(B, T, e, **f64) if gating else None
    dv, dheads = torch.randn(B, T, e, **f64), torch.randn(B, T, nh, s, **f64)
    bias = torch.randn(W, **f64)
    cast = lambda x: None if x is None else x.to(device, dtype)
    return cast(h), cast(gamma), cast(beta), pos.to(device), (cast(du), cast(dv), cast(dheads)), cast(bias)


def _run(backend, h, gamma, beta, pos, grads, *, e, s, gating=True, rope_heads=1, bias=None, **kw):
    """Outputs and the gradients of h, gamma, beta (and the bias, when given) by name; an output whose
    gradient is ``None`` takes no part in the backward (its gradient is zero); a parameter no
    gradient reaches gets zeros."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, gamma, beta) + (() if bias is None else (bias,))]
    op = gau_heads
    if kw.get("launch") is not None:  # a launch other than the default: the fused kernel's own entry
        from lintime.ops.heads.triton import triton_gau_heads

        assert backend == "triton"
        op, backend = triton_gau_heads, None
    else:
        kw["backend"] = backend
    kw.pop("launch", None)
    u, v, heads = op(*leaves[:3], pos, e=e, s=s, gating=gating, rope_heads=rope_heads,
                     bias=leaves[3] if bias is not None else None, **kw)
    outs = [(o, g) for o, g in zip((u, v, heads), grads) if o is not None and g is not None]
    got = torch.autograd.grad([o for o, _ in outs], leaves, [g for _, g in outs], allow_unused=True)
    got = [torch.zeros_like(x) if d is None else d for x, d in zip(leaves, got)]
    return {k: x for k, x in zip(NAMES, (u, v, heads, *got)) if x is not None}


# (T, e, s, nh, gating, rope_heads): T = 1 / 7 / 37 rows (not multiples of 8); e = 20 or 5 (two
# 16-wide tiles with a partial one, one partial tile); s = 12 with one RoPE group (6 half-columns in an
# 8-wide tile) or two (groups of 6: 3 + 3), s = 8 / 4 with two groups (groups of 4 / 2)
CASES = [
    (37, 20, 12, 4, True, 1),  # FLASH
    (37, 20, 12, 6, True, 1),  # FLASH, first-to-all
    (7, 5, 12, 2, True, 2),  # GAU, two attention heads
    (37, 20, 8, 2, False, 2),  # GAU without gating
    (1, 20, 4, 2, True, 2),
    (7, 5, 12, 2, False, 1),
]


def _id(c):
    T, e, s, nh, gating, R = c
    return f"T{T}-e{e}-s{s}-nh{nh}-{'gate' if gating else 'nogate'}-R{R}"


def _check_exact_vs_naive(backend, case, dtype, seed, with_bias=False, **run_kw):
    """Outputs and the gradients of h, gamma, beta (and the bias) of ``backend`` against the naive
    form, exact rule."""
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads, bias = _inputs_bias(2, T, e, s, nh, gating, dtype, seed=seed)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R, "bias": bias if with_bias else None}
    assert ("dbias" in _run("naive", h, g, b, pos, grads, **kw)) == with_bias
    ref, out = _run("naive", h, g, b, pos, grads, **kw), _run(backend, h, g, b, pos, grads, **kw, **run_kw)
    assert sorted(ref) == sorted(out)
    for name in ref:
        assert out[name].dtype == ref[name].dtype
        assert out[name].is_contiguous(), name
        assert_exact(f"{backend} {name} {_id(case)} {dtype} bias={with_bias}", ref[name], out[name])


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_chunk_matches_naive(case, dtype, with_bias):
    _check_exact_vs_naive("chunk", case, dtype, seed=0, with_bias=with_bias)


def test_bias_is_added_before_the_activation():
    """``gau_heads(h, ..., bias=b)`` is ``gau_heads(h + b, ...)`` (naive and chunk, fp64), and the bias
    gradient is the column sum of the gradient of ``h``."""
    e, s = 6, 8
    h, g, b, pos, grads, bias = _inputs_bias(2, 5, e, s, 4, True, torch.float64, seed=9)
    for backend in ("naive", "chunk"):
        with_b = _run(backend, h, g, b, pos, grads, e=e, s=s, bias=bias)
        shifted = _run(backend, h + bias, g, b, pos, grads, e=e, s=s)
        for name in shifted:
            torch.testing.assert_close(with_b[name], shifted[name], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(with_b["dbias"], shifted["dh"].sum((0, 1)), rtol=1e-12, atol=1e-12)


def test_naive_is_the_formula():
    """One token by hand: silu, split, ``z * gamma + beta``, and RoPE as a rotation by the angle
    ``p * base ** (-i / (D/2))`` of each pair ``(i, i + D/2)`` of each group."""
    e, s, R = 3, 8, 2
    h, g, b, pos, _ = _inputs(1, 1, e, s, 2, True, torch.float64, pmin=5, pmax=6)
    u, v, heads = gau_heads(h, g, b, pos, e=e, s=s, rope_heads=R, rope_base=100.0, backend="naive")
    a = F.silu(h[0, 0])
    torch.testing.assert_close(u[0, 0], a[:e], rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(v[0, 0], a[e : 2 * e], rtol=1e-14, atol=1e-14)
    z, D = a[2 * e :], s // R
    for n in range(2):
        q = z * g[n] + b[n]
        for r in range(R):
            for i in range(D // 2):
                th = torch.tensor(5.0 * 100.0 ** (-i / (D // 2)), dtype=torch.float64)
                x1, x2 = q[r * D + i], q[r * D + D // 2 + i]
                rot = torch.stack([x1 * th.cos() - x2 * th.sin(), x2 * th.cos() + x1 * th.sin()])
                got = heads[0, 0, n, [r * D + i, r * D + D // 2 + i]]
                torch.testing.assert_close(got, rot, rtol=1e-14, atol=1e-14)


# ------------------------------------------------------------------------ interpreter (CPU)

cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests: the CUDA tests below cover the compiled kernels")


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_triton_matches_naive_fp32(case, with_bias):
    _check_exact_vs_naive("triton", case, torch.float32, seed=1, with_bias=with_bias)


@cpu_only
@pytest.mark.parametrize("launch", [dict(bt=8, be=16, bth=8, warps=1, bwd_rows=8, bwd_heads_rows=8, bwd_warps=1),
                                    dict(bt=16, be=8, bth=8, warps=1, bwd_rows=48, bwd_heads_rows=24, bwd_warps=2)],
                         ids=["rows8", "rows48-heads24"])
def test_triton_launches_match_naive(launch):
    """Other backward row groups (one block per group: the former kernel's layout; three 16-row tile
    blocks per group and three 8-row heads blocks per heads group, the two kinds of groups unequal) give
    the same results, bias and heads gradients included."""
    from lintime.ops.heads.triton.heads import HeadsLaunch

    _check_exact_vs_naive("triton", CASES[1], torch.float32, seed=10, with_bias=True, launch=HeadsLaunch(**launch))


@cpu_only
@pytest.mark.parametrize("case, with_bias", [(CASES[1], True), (CASES[3], False)], ids=["fta-bias", "nogate"])
def test_triton_fp16_half_rule(case, with_bias):
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads, bias = _inputs_bias(2, T, e, s, nh, gating, torch.float64, seed=2, pmax=5000)
    _check_half_rule(h, g, b, pos, grads, {"e": e, "s": s, "gating": gating, "rope_heads": R}, torch.float16,
                     f"triton fp16 {_id(case)}", bias=bias if with_bias else None)


def _check_half_rule(h, g, b, pos, grads, kw, dtype, label, bias=None):
    """Triton on ``dtype`` inputs against the fp64 naive form, with the ``dtype`` naive form as the
    half-precision rule's baseline; outputs and gradients keep ``dtype``."""
    ref = _run("naive", h, g, b, pos, grads, bias=bias, **kw)
    half = [x.to(dtype) for x in (h, g, b)]
    hbias = None if bias is None else bias.to(dtype)
    hgrads = [None if x is None else x.to(dtype) for x in grads]
    base = _run("naive", *half, pos, hgrads, bias=hbias, **kw)
    out = _run("triton", *half, pos, hgrads, bias=hbias, **kw)
    assert ("dbias" in out) == (bias is not None)
    for name in ref:
        assert out[name].dtype == dtype
        assert_half_rule(f"{label} {name}", ref[name], out[name], base[name])


@cpu_only
def test_triton_autocast_dtypes():
    """fp16 ``h`` with fp32 ``gamma`` / ``beta`` / bias (autocast): the parameters are rounded to fp16
    as ScaleOffset and autocast's ``addmm`` do, their gradients come back in fp32 -- against the naive
    form, which rounds them the same way, by the half-precision rule."""
    kw = {"e": 20, "s": 12, "rope_heads": 1}
    h, g, b, pos, grads, bias = _inputs_bias(1, 21, 20, 12, 4, True, torch.float64, seed=3, pmax=3000)
    ref = _run("naive", h, g.half().double(), b.half().double(), pos, grads, bias=bias.half().double(), **kw)
    hgrads = [x.half() for x in grads]
    base = _run("naive", h.half(), g.float(), b.float(), pos, hgrads, bias=bias.float(), **kw)
    out = _run("triton", h.half(), g.float(), b.float(), pos, hgrads, bias=bias.float(), **kw)
    assert out["dgamma"].dtype == out["dbeta"].dtype == out["dbias"].dtype == torch.float32
    for name in ref:
        assert out[name].dtype == base[name].dtype
        if out[name].dtype == torch.float16:
            assert_half_rule(f"autocast {name}", ref[name], out[name], base[name])
        else:  # fp32 gradients of fp16 computations: the same rule with fp16's floor
            bound = HALF_FACTOR * rel_rms(ref[name], base[name]) + HALF_FLOOR[torch.float16]
            assert rel_rms(ref[name], out[name]) <= bound, name


@cpu_only
@pytest.mark.parametrize("present", [(False, False, True), (True, False, False), (False, True, True)],
                         ids=["heads", "u", "v+heads"])
def test_triton_absent_output_gradients(present):
    """Only some outputs reach the loss: the others' gradients are ``None`` and count as zero (the
    kernel still writes every element of ``dh``; an unwritten one would be NaN-poisoned)."""
    T, e, s, nh = 13, 20, 12, 4
    h, g, b, pos, grads, bias = _inputs_bias(1, T, e, s, nh, True, torch.float32, seed=4)
    grads = [x if keep else None for x, keep in zip(grads, present)]
    kw = {"e": e, "s": s, "bias": bias}
    ref, out = _run("naive", h, g, b, pos, grads, **kw), _run("triton", h, g, b, pos, grads, **kw)
    for name in ("dh", "dgamma", "dbeta", "dbias"):
        assert torch.isfinite(out[name]).all(), name
        assert_exact(f"absent grads {present} {name}", ref[name], out[name])


@cpu_only
@pytest.mark.parametrize("grad_of", ["h", "bias", "h+bias"])
def test_triton_gradient_of_some_inputs(grad_of):
    """gamma and beta frozen (no heads partial sums are made), the bias frozen or the only input with
    a gradient: the gradients asked for are unchanged."""
    h, g, b, pos, (du, dv, dh_), bias = _inputs_bias(1, 9, 5, 12, 6, True, torch.float32, seed=5)
    x, bx = h.clone().requires_grad_("h" in grad_of), bias.clone().requires_grad_("bias" in grad_of)
    u, v, heads = gau_heads(x, g, b, pos, e=5, s=12, bias=bx, backend="triton")
    leaves = [t for t in (x, bx) if t.requires_grad]
    got = torch.autograd.grad([u, v, heads], leaves, [du, dv, dh_])
    ref = _run("naive", h, g, b, pos, (du, dv, dh_), e=5, s=12, bias=bias)
    names = [n for n, t in (("dh", x), ("dbias", bx)) if t.requires_grad]
    for name, d in zip(names, got, strict=True):
        assert_exact(f"{name} (frozen gamma, beta; grad of {grad_of})", ref[name], d)


@cpu_only
def test_torch_compile_traces_the_custom_ops():
    """``torch.compile`` (aot_eager: fake tensors, no code generation) traces forward and backward
    through ``lintime::gau_heads_fwd`` / ``gau_heads_bwd`` and gives the eager result."""
    h, g, b, pos, grads, bias = _inputs_bias(1, 11, 5, 8, 4, True, torch.float32, seed=6)

    def f(h, g, b, bias):
        return gau_heads(h, g, b, pos, e=5, s=8, bias=bias, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    for fn, name in ((compiled, "compiled"), (f, "eager")):
        leaves = [x.clone().requires_grad_() for x in (h, g, b, bias)]
        outs = fn(*leaves)
        got = torch.autograd.grad(outs, leaves, grads)
        ref = _run("naive", h, g, b, pos, grads, e=5, s=8, bias=bias)
        for key, x in zip(NAMES, (*outs, *got)):
            assert_exact(f"{name} {key}", ref[key], x)


@cpu_only
@pytest.mark.parametrize("gating, with_bias", [(True, False), (False, True)])
def test_opcheck(gating, with_bias):
    """``torch.library.opcheck``: schema, fake tensors, autograd registration and AOT tracing."""
    from lintime.ops.heads.triton.heads import default_launch, gau_heads_fwd

    e, s = 5, 8
    h, g, b, pos, _, bias = _inputs_bias(1, 10, e, s, 2, gating, torch.float32, seed=7)
    bias = bias.requires_grad_() if with_bias else None
    launch = default_launch(h.device).to_ints()
    args = tuple(x.requires_grad_() for x in (h, g, b)) + (pos, bias, e, s, gating, 500.0, 2, launch)
    torch.library.opcheck(gau_heads_fwd.op, args)


def test_dispatch_and_errors():
    """CPU tensors go to the chunk form (exactly); bad shapes and options fail naming the argument."""
    h, g, b, pos, _ = _inputs(2, 5, 6, 8, 4, True, torch.float32)
    auto, chunk = gau_heads(h, g, b, pos, e=6, s=8), gau_heads(h, g, b, pos, e=6, s=8, backend="chunk")
    if not CUDA:
        assert all(torch.equal(x, y) for x, y in zip(auto, chunk))
    with pytest.raises(ValueError, match="2e \\+ s"):
        gau_heads(h, g, b, pos, e=5, s=8)
    with pytest.raises(ValueError, match="rope_heads"):
        gau_heads(h, g, b, pos, e=6, s=8, rope_heads=3)
    with pytest.raises(ValueError, match="gamma and beta"):
        gau_heads(h, g[:, :4], b[:, :4], pos, e=6, s=8)
    with pytest.raises(ValueError, match="positions"):
        gau_heads(h, g, b, pos.float(), e=6, s=8)
    with pytest.raises(ValueError, match="not implemented"):
        gau_heads(h, g, b, pos, e=6, s=8, backend="recurrent")
    with pytest.raises(ValueError, match="e must be"):
        gau_heads(h, g, b, pos, e=0, s=8)
    with pytest.raises(ValueError, match="bias must be"):
        gau_heads(h, g, b, pos, e=6, s=8, bias=torch.zeros(19))
    with pytest.raises(TypeError, match="bias must be a floating"):
        gau_heads(h, g, b, pos, e=6, s=8, bias=torch.zeros(20, dtype=torch.long))


# ------------------------------------------------------------------------ the layers


def _layer_inputs(layer, dtype, T=19, seed=8):
    torch.manual_seed(seed)
    with torch.no_grad():  # real values (the seed's N(0, 0.02) init makes q.k tiny)
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(2, T, layer.dim, dtype=dtype)
    pos = torch.arange(T).expand(2, T) + torch.tensor([[0], [40]])
    return x, pos


def _grads(y, layer, x, dy):
    return torch.autograd.grad(y, [x, *layer.parameters()], dy)


@pytest.mark.parametrize("first_to_all", [False, True])
def test_flash_layer_equals_its_math_by_hand(first_to_all):
    """FLASH with heads through the op (backend chunk) gives bit for bit the layer's math written out:
    the projection without its bias, the bias added, silu, split, ScaleOffset, apply_rope on the ``[B, T, nh, s]`` heads, then the attention."""
    from lintime.layers.flash import FLASH
    from lintime.layers.positional import apply_rope
    from lintime.ops import mixed_chunk_attention

    layer = FLASH(16, expansion_dim=24, key_dim=8, chunk_size=6, first_to_all=first_to_all, backend="chunk")
    x, pos = _layer_inputs(layer, torch.float32)
    x.requires_grad_()
    y, _ = layer(x, positions=pos)
    e, s = layer.e, layer.s
    u, v, z = F.silu(F.linear(x, layer.proj.weight) + layer.proj.bias).split([e, e, s], dim=-1)
    heads = apply_rope(z[..., None, :] * layer.heads.gamma + layer.heads.beta, pos, layer.rope_base)
    scale, diag = layer._quad_scale_and_bias()
    a, _ = mixed_chunk_attention(*(heads[:, :, i : i + 1] for i in range(4)), v[:, :, None], chunk_size=6,
                                 rel_bias=diag, scale=scale, backend="chunk")
    if first_to_all:
        a = a + layer._fta_full(heads[:, :, 4:5], heads[:, :, 5:6], v[:, :, None], None)
    y_ref = layer.out(u * a[:, :, 0])
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    for got, want in zip(_grads(y, layer, x, dy), _grads(y_ref, layer, x, dy)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n_heads, gating", [(1, True), (2, False)])
def test_gau_layer_equals_its_math_by_hand(n_heads, gating):
    """GAU (one or two attention heads, with and without gating) with heads through the op
    (backend chunk) gives bit for bit the former math (the projection's bias added after its matmul):
    RoPE per attention head of ``s / H``."""
    from lintime.layers.gau import GAU
    from lintime.layers.positional import apply_rope

    layer = GAU(16, expansion_dim=24, key_dim=8, max_len=64, n_heads=n_heads, gating=gating, backend="chunk")
    x, pos = _layer_inputs(layer, torch.float32)
    x.requires_grad_()
    y, _ = layer(x, positions=pos)
    B, T, _ = x.shape
    e, s, H = layer.e, layer.s, n_heads
    a = F.silu(F.linear(x, layer.proj.weight) + layer.proj.bias)
    u, v, z = a.split([e, e, s], -1) if gating else (None, *a.split([e, s], -1))
    q, k = (z * layer.qk.gamma[i] + layer.qk.beta[i] for i in range(2))
    q, k = (apply_rope(t.reshape(B, T, H, s // H), pos, layer.rope_base) for t in (q, k))
    o = layer._full(q, k, v.reshape(B, T, H, e // H), pos, None).reshape(B, T, e)
    y_ref = layer.out(u * o if gating else o)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    for got, want in zip(_grads(y, layer, x, dy), _grads(y_ref, layer, x, dy)):
        assert torch.equal(got, want)


@cpu_only
def test_flash_layer_triton_heads_match_chunk(monkeypatch):
    """The FLASH layer with its heads on the fused kernel (interpreter; attention on the chunk form)
    against the chunk heads: output and every gradient at the fp32 exact rule."""
    import lintime.layers.flash as flash_module
    from lintime.layers.flash import FLASH

    layer = FLASH(16, expansion_dim=24, key_dim=8, chunk_size=6, backend="chunk")
    x, pos = _layer_inputs(layer, torch.float32, T=11)
    x.requires_grad_()
    y_ref, _ = layer(x, positions=pos)
    monkeypatch.setattr(flash_module, "heads_backend", lambda backend: "triton")
    y, _ = layer(x, positions=pos)
    assert_exact("FLASH y (triton heads)", y_ref, y)
    dy = torch.randn_like(y)
    for i, (got, want) in enumerate(zip(_grads(y, layer, x, dy), _grads(y_ref, layer, x, dy))):
        assert_exact(f"FLASH grad {i} (triton heads)", want, got)


# ------------------------------------------------------------------------ CUDA, real sizes

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@cuda
@needs_cuda
@pytest.mark.parametrize("nh, gating, rope_heads, with_bias",
                         [(4, True, 1, True), (4, True, 1, False), (6, True, 1, False), (2, True, 1, True),
                          (2, False, 2, False)])
def test_cuda_real_size_bf16_half_rule(nh, gating, rope_heads, with_bias):
    """FLASH / GAU shapes (e = 1536, s = 128) at T = 4096, bf16, with and without the projection bias,
    against the fp64 naive form; the bf16 naive form is the half-precision rule's baseline."""
    B, T, e, s = 1, 4096, 1536, 128
    h, g, b, pos, grads, bias = _inputs_bias(B, T, e, s, nh, gating, torch.float64, seed=11, device="cuda", pmin=0,
                                             pmax=T)
    _check_half_rule(h, g, b, pos, grads, {"e": e, "s": s, "gating": gating, "rope_heads": rope_heads},
                     torch.bfloat16, f"cuda bf16 nh={nh} bias={with_bias}", bias=bias if with_bias else None)


@cuda
@needs_cuda
@pytest.mark.parametrize("launch", [None, dict(bwd_rows=8, bwd_heads_rows=8), dict(bwd_rows=128, bwd_heads_rows=32,
                                                                                   bwd_warps=8)],
                         ids=["default", "rows8", "rows128-heads32-w8"])
def test_cuda_fp32_exact_odd_sizes_large_positions(launch):
    """fp32 kernels against the fp32 naive form on odd sizes (T = 1037, e = 300, s = 96 in two RoPE
    groups, a bias) with positions up to 1e6 (angles far outside [-pi, pi]: an approximate sin / cos
    fails), for the default backward row groups and two others."""
    from lintime.ops.heads.triton.heads import HeadsLaunch

    h, g, b, pos, grads, bias = _inputs_bias(3, 1037, 300, 96, 6, True, torch.float32, seed=12, device="cuda",
                                             pmin=-1000, pmax=1_000_000)
    kw = {"e": 300, "s": 96, "rope_heads": 2, "bias": bias}
    ref = _run("naive", h, g, b, pos, grads, **kw)
    out = _run("triton", h, g, b, pos, grads, launch=None if launch is None else HeadsLaunch(**launch), **kw)
    for name in ref:
        assert_exact(f"cuda fp32 {name} {launch}", ref[name], out[name])


@cuda
@needs_cuda
def test_cuda_backward_is_deterministic():
    """Two backward passes at flash-base's shape (8k tokens, bias given) give bitwise the same ``dh``,
    ``dgamma``, ``dbeta`` and ``dbias`` (fixed row groups, fixed-order sums, no atomics)."""
    h, g, b, pos, grads, bias = _inputs_bias(1, 8192, 1536, 128, 4, True, torch.bfloat16, seed=13, device="cuda",
                                             pmin=0, pmax=8192)
    first, second = (_run("triton", h, g, b, pos, grads, e=1536, s=128, bias=bias) for _ in range(2))
    for name in ("dh", "dgamma", "dbeta", "dbias"):
        assert torch.equal(first[name], second[name]), name


@cuda
@needs_cuda
def test_cuda_dispatch_picks_triton(impl_calls):
    calls = impl_calls(importlib.import_module("lintime.ops.heads"), "triton")
    h, g, b, pos, _ = _inputs(1, 64, 32, 16, 4, True, torch.bfloat16, device="cuda")
    gau_heads(h, g, b, pos, e=32, s=16)
    assert calls == [1]
