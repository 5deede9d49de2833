"""gau_heads (silu, split, scale + offset heads, RoPE): naive <-> chunk <-> triton for the outputs
``u, v, heads`` and the gradients of ``h``, ``gamma``, ``beta`` and the optional ``bias`` (added before the
activation); the layers (FLASH, GAU) against their math written out by hand.  The split-heads form:
test_gau_heads_split.py; shared cases and helpers: gau_heads_cases.py.

Chain of trust: the naive form (the rotation written out per head and RoPE group, fp32 / fp64) is
the reference; the chunk form (the layers' former eager math) must match it in fp64 and fp32; the
fused kernel (on the CPU through the Triton interpreter, 16-row x 16-column tiles: small shapes
cross row blocks and ``u`` / ``v`` tiles, with partial ones) must match it in fp32 at the exact
rule and in fp16 by the half-precision rule (bf16 on CUDA, where its rounding is the hardware's).
Positions are random integers, negative and large ones included (fp32 angles of ~1e5 radians).
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from gau_heads_cases import (
    CASES,
    CUDA,
    NAMES,
    case_id,
    cpu_only,
    cuda,
    heads_bias,
    heads_inputs,
    needs_cuda,
    run_heads,
)
from lintime.modules import gau_heads
from tolerances import (
    HALF_FACTOR,
    HALF_FLOOR,
    assert_exact,
    assert_half_rule,
    rel_rms,
)

triton = pytest.importorskip("triton")


def _check_exact_vs_naive(backend, case, dtype, seed, with_bias=False):
    """Outputs and the gradients of h, gamma, beta (and bias) of ``backend`` against the naive form, exact
    rule."""
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads = heads_inputs(2, T, e, s, nh, gating, dtype, seed=seed)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R, "bias": heads_bias(h, seed) if with_bias else None}
    ref, out = run_heads("naive", h, g, b, pos, grads, **kw), run_heads(backend, h, g, b, pos, grads, **kw)
    assert sorted(ref) == sorted(out)
    for name in ref:
        assert out[name].dtype == ref[name].dtype
        assert out[name].is_contiguous(), name
        assert_exact(f"{backend} {name} {case_id(case)} {dtype}", ref[name], out[name])


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_chunk_matches_naive(case, dtype, with_bias):
    _check_exact_vs_naive("chunk", case, dtype, seed=0, with_bias=with_bias)


def test_bias_is_added_before_the_activation():
    """``bias`` = adding it to ``h`` first (fp64, every backend that runs here): the same outputs, and the bias's
    gradient is the column sums of ``h``'s gradient (the pre-activation's), summed independently here."""
    case = CASES[0]
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads = heads_inputs(2, T, e, s, nh, gating, torch.float64, seed=4)
    bias = heads_bias(h, 4)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R}
    for backend in ("naive", "chunk"):
        ref = run_heads(backend, h + bias, g, b, pos, grads, **kw)
        out = run_heads(backend, h, g, b, pos, grads, bias=bias, **kw)
        for name in ref:
            torch.testing.assert_close(out[name], ref[name], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out["dbias"], ref["dh"].sum((0, 1)), rtol=1e-12, atol=1e-12)


def test_naive_is_the_formula():
    """One token by hand: silu, split, ``z * gamma + beta``, and RoPE as a rotation by the angle
    ``p * base ** (-i / (D/2))`` of each pair ``(i, i + D/2)`` of each group."""
    e, s, R = 3, 8, 2
    h, g, b, pos, _ = heads_inputs(1, 1, e, s, 2, True, torch.float64, pmin=5, pmax=6)
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


@cpu_only
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_triton_matches_naive_fp32(case, with_bias):
    _check_exact_vs_naive("triton", case, torch.float32, seed=1, with_bias=with_bias)


@cpu_only
def test_triton_frozen_bias():
    """A bias that needs no gradient is still added (forward and the recomputed activation of the backward); no
    partial column sums are made and the other gradients are unchanged."""
    T, e, s, nh, gating, R = CASES[3]
    h, g, b, pos, grads = heads_inputs(2, T, e, s, nh, gating, torch.float32, seed=13)
    bias = heads_bias(h, 13)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R}
    ref = run_heads("naive", h, g, b, pos, grads, bias=bias, **kw)
    leaves = [x.clone().requires_grad_() for x in (h, g, b)]
    u, v, heads = gau_heads(*leaves, pos, bias=bias, backend="triton", **kw)
    got = torch.autograd.grad([v, heads], leaves, [grads[1], grads[2]])
    for name, x in zip(("v", "heads", "dh", "dgamma", "dbeta"), (v, heads, *got)):
        assert_exact(f"frozen bias {name}", ref[name], x)


@cpu_only
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=case_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_triton_fp16_half_rule(case, with_bias):
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads = heads_inputs(2, T, e, s, nh, gating, torch.float64, seed=2, pmax=5000)
    _check_half_rule(h, g, b, pos, grads, {"e": e, "s": s, "gating": gating, "rope_heads": R}, torch.float16,
                     f"triton fp16 {case_id(case)}", bias=heads_bias(h, 2) if with_bias else None)


def _check_half_rule(h, g, b, pos, grads, kw, dtype, label, bias=None):
    """Triton on ``dtype`` inputs against the fp64 naive form, with the ``dtype`` naive form as the
    half-precision rule's baseline; outputs and gradients keep ``dtype``.  ``bias`` (fp64) goes in as ``dtype``."""
    ref = run_heads("naive", h, g, b, pos, grads, bias=bias, **kw)
    half = [x.to(dtype) for x in (h, g, b)]
    hb = None if bias is None else bias.to(dtype)
    hgrads = [None if x is None else x.to(dtype) for x in grads]
    base = run_heads("naive", *half, pos, hgrads, bias=hb, **kw)
    out = run_heads("triton", *half, pos, hgrads, bias=hb, **kw)
    for name in ref:
        assert out[name].dtype == dtype
        assert_half_rule(f"{label} {name}", ref[name], out[name], base[name])


@cpu_only
def test_triton_autocast_dtypes():
    """fp16 ``h`` with fp32 ``gamma`` / ``beta`` (autocast): the parameters are rounded to fp16 as
    ScaleOffset does, their gradients come back in fp32 -- against the naive form, which rounds
    them the same way, by the half-precision rule."""
    kw = {"e": 20, "s": 12, "rope_heads": 1}
    h, g, b, pos, grads = heads_inputs(1, 21, 20, 12, 4, True, torch.float64, seed=3, pmax=3000)
    bias = heads_bias(h, 3)
    ref = run_heads("naive", h, g.half().double(), b.half().double(), pos, grads, bias=bias.half().double(), **kw)
    hgrads = [x.half() for x in grads]
    base = run_heads("naive", h.half(), g.float(), b.float(), pos, hgrads, bias=bias.float(), **kw)
    out = run_heads("triton", h.half(), g.float(), b.float(), pos, hgrads, bias=bias.float(), **kw)
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
    h, g, b, pos, grads = heads_inputs(1, T, e, s, nh, True, torch.float32, seed=4)
    grads = [x if keep else None for x, keep in zip(grads, present)]
    kw = {"e": e, "s": s}
    ref, out = run_heads("naive", h, g, b, pos, grads, **kw), run_heads("triton", h, g, b, pos, grads, **kw)
    for name in ("dh", "dgamma", "dbeta"):
        assert torch.isfinite(out[name]).all(), name
        assert_exact(f"absent grads {present} {name}", ref[name], out[name])


@cpu_only
def test_triton_gradient_of_h_alone():
    """gamma and beta frozen: no partial sums are made, ``dh`` is unchanged."""
    h, g, b, pos, (du, dv, dh_) = heads_inputs(1, 9, 5, 12, 6, True, torch.float32, seed=5)
    x = h.clone().requires_grad_()
    u, v, heads = gau_heads(x, g, b, pos, e=5, s=12, backend="triton")
    (dx,) = torch.autograd.grad([u, v, heads], [x], [du, dv, dh_])
    ref = run_heads("naive", h, g, b, pos, (du, dv, dh_), e=5, s=12)
    assert_exact("dh (frozen gamma, beta)", ref["dh"], dx)


@cpu_only
def test_torch_compile_traces_the_custom_ops():
    """``torch.compile`` (aot_eager: fake tensors, no code generation) traces forward and backward
    through ``lintime::gau_heads_fwd`` / ``gau_heads_bwd`` and gives the eager result."""
    h, g, b, pos, grads = heads_inputs(1, 11, 5, 8, 4, True, torch.float32, seed=6)

    def f(h, g, b):
        return gau_heads(h, g, b, pos, e=5, s=8, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    for fn, name in ((compiled, "compiled"), (f, "eager")):
        leaves = [x.clone().requires_grad_() for x in (h, g, b)]
        outs = fn(*leaves)
        got = torch.autograd.grad(outs, leaves, grads)
        ref = run_heads("naive", h, g, b, pos, grads, e=5, s=8)
        for key, x in zip(NAMES, (*outs, *got)):
            assert_exact(f"{name} {key}", ref[key], x)


@cpu_only
@pytest.mark.parametrize("gating", [True, False])
def test_opcheck(gating):
    """``torch.library.opcheck``: schema, fake tensors, autograd registration and AOT tracing."""
    from lintime.modules.heads.triton.heads import gau_heads_fwd

    e, s = 5, 8
    h, g, b, pos, _ = heads_inputs(1, 10, e, s, 2, gating, torch.float32, seed=7)
    for bias in (None, heads_bias(h).requires_grad_()):
        args = tuple(x.requires_grad_() for x in (h, g, b)) + (pos, bias, e, s, gating, 500.0, 2)
        torch.library.opcheck(gau_heads_fwd.op, args)


def test_dispatch_and_errors():
    """CPU tensors go to the chunk form (exactly); bad shapes and options fail naming the argument."""
    h, g, b, pos, _ = heads_inputs(2, 5, 6, 8, 4, True, torch.float32)
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
    with pytest.raises(TypeError, match="split_heads"):
        gau_heads(h, g, b, pos, e=6, s=8, split_heads=1)
    h7, g7, b7, pos7, _ = heads_inputs(1, 3, 6, 8, 7, True, torch.float32)
    with pytest.raises(ValueError, match="at most 6"):
        gau_heads(h7, g7, b7, pos7, e=6, s=8, split_heads=True)
    with pytest.raises(ValueError, match="bias must be \\[W\\]"):
        gau_heads(h, g, b, pos, e=6, s=8, bias=torch.zeros(h.shape[-1] - 1))
    with pytest.raises(TypeError, match="bias must be a floating"):
        gau_heads(h, g, b, pos, e=6, s=8, bias=torch.zeros(h.shape[-1], dtype=torch.int64))
    with pytest.raises(TypeError, match="bias must be a torch.Tensor"):
        gau_heads(h, g, b, pos, e=6, s=8, bias=[0.0] * h.shape[-1])


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
    """FLASH with heads through the op (backend chunk) gives bit for bit the layer's math written out (silu,
    split, ScaleOffset, apply_rope on the ``[B, T, nh, s]`` heads, the attention, the gate), every gradient at
    the fp32 exact rule."""
    from lintime.layers.flash import FLASH
    from lintime.layers.positional import apply_rope
    from lintime.ops import mixed_chunk_attention

    layer = FLASH(16, expansion_dim=24, key_dim=8, chunk_size=6, first_to_all=first_to_all, backend="chunk")
    x, pos = _layer_inputs(layer, torch.float32)
    x.requires_grad_()
    y, _ = layer(x, positions=pos)
    e, s = layer.e, layer.s
    # the fused path: the product without its bias, which the heads op and the gate add before their silu
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
    # dense(x)'s backward is two products (split_linear: dx = du W_u + dv W_vz), so not bit for bit
    for name, got, want in zip(("x", *dict(layer.named_parameters())), _grads(y, layer, x, dy),
                               _grads(y_ref, layer, x, dy)):
        assert_exact(f"d{name}", want, got)


@pytest.mark.parametrize("n_heads, gating", [(1, True), (2, False)])
def test_gau_layer_equals_its_math_by_hand(n_heads, gating):
    """GAU (one or two attention heads, with and without gating) with heads through the op
    (backend chunk) gives bit for bit the former math (RoPE per attention head of ``s / H``), every gradient at
    the fp32 exact rule."""
    from lintime.layers.gau import GAU
    from lintime.layers.positional import apply_rope

    layer = GAU(16, expansion_dim=24, key_dim=8, max_len=64, n_heads=n_heads, gating=gating, backend="chunk")
    x, pos = _layer_inputs(layer, torch.float32)
    x.requires_grad_()
    y, _ = layer(x, positions=pos)
    B, T, _ = x.shape
    e, s, H = layer.e, layer.s, n_heads
    a = F.silu(F.linear(x, layer.proj.weight) + layer.proj.bias)  # the bias added by the ops (the fused path)
    u, v, z = a.split([e, e, s], -1) if gating else (None, *a.split([e, s], -1))
    q, k = (z * layer.qk.gamma[i] + layer.qk.beta[i] for i in range(2))
    q, k = (apply_rope(t.reshape(B, T, H, s // H), pos, layer.rope_base) for t in (q, k))
    o = layer._full(q, k, v.reshape(B, T, H, e // H), pos, None).reshape(B, T, e)
    y_ref = layer.out(u * o if gating else o)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    # dense(x)'s backward is two products (split_linear: dx = du W_u + dv W_vz), so not bit for bit
    for name, got, want in zip(("x", *dict(layer.named_parameters())), _grads(y, layer, x, dy),
                               _grads(y_ref, layer, x, dy)):
        assert_exact(f"d{name}", want, got)


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


@cuda
@needs_cuda
@pytest.mark.parametrize("nh, gating, rope_heads", [(4, True, 1), (6, True, 1), (2, True, 1), (2, False, 2)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_cuda_real_size_bf16_half_rule(nh, gating, rope_heads, with_bias):
    """FLASH / GAU shapes (e = 2048, s = 128) at T = 4096, bf16, against the fp64 naive form; the
    bf16 naive form is the half-precision rule's baseline."""
    B, T, e, s = 1, 4096, 2048, 128
    h, g, b, pos, grads = heads_inputs(B, T, e, s, nh, gating, torch.float64, seed=11, device="cuda", pmin=0, pmax=T)
    _check_half_rule(h, g, b, pos, grads, {"e": e, "s": s, "gating": gating, "rope_heads": rope_heads},
                     torch.bfloat16, f"cuda bf16 nh={nh}", bias=heads_bias(h, 11) if with_bias else None)


@cuda
@needs_cuda
def test_cuda_fp32_exact_odd_sizes_large_positions():
    """fp32 kernels against the fp32 naive form on odd sizes (T = 1037, e = 300, s = 96 in two RoPE
    groups) with positions up to 1e6 (angles far outside [-pi, pi]: an approximate sin / cos fails)."""
    h, g, b, pos, grads = heads_inputs(3, 1037, 300, 96, 6, True, torch.float32, seed=12, device="cuda",
                                  pmin=-1000, pmax=1_000_000)
    kw = {"e": 300, "s": 96, "rope_heads": 2, "bias": heads_bias(h, 12)}
    ref, out = run_heads("naive", h, g, b, pos, grads, **kw), run_heads("triton", h, g, b, pos, grads, **kw)
    for name in ref:
        assert_exact(f"cuda fp32 {name}", ref[name], out[name])


@cuda
@needs_cuda
def test_cuda_dispatch_picks_triton(impl_calls):
    calls = impl_calls(importlib.import_module("lintime.modules.heads"), "triton")
    h, g, b, pos, _ = heads_inputs(1, 64, 32, 16, 4, True, torch.bfloat16, device="cuda")
    gau_heads(h, g, b, pos, e=32, s=16)
    assert calls == [1]
