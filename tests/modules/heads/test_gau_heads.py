"""gau_heads (silu, split, scale + offset heads, RoPE): naive <-> chunk <-> triton for the outputs
``u, v, heads`` and the gradients of ``h``, ``gamma``, ``beta`` and the optional ``bias`` (added before the
activation); the layers (FLASH, GAU) against their math written out by hand.

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

from lintime.modules import gau_heads
from tolerances import (
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


def _bias(h, seed=0):
    """A bias for ``h``'s columns, ``h``'s dtype and device (fp64 drawn, O(1): it moves silu's operating point)."""
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(h.shape[-1], generator=g, dtype=torch.float64).to(h.device, h.dtype)


def _inputs(B, T, e, s, nh, gating, dtype, *, seed=0, device="cpu", pmin=-300, pmax=100_000):
    """``h, gamma, beta, positions`` and the output gradients ``du, dv, dheads`` (fp64 drawn, then
    cast).  ``h`` has scale 2 (silu's curved part), gamma / beta O(1)."""
    g = torch.Generator().manual_seed(seed * 1009 + T * 31 + e * 7 + s)
    W = (2 * e if gating else e) + s
    f64 = {"generator": g, "dtype": torch.float64}
    h = 2 * torch.randn(B, T, W, **f64)
    gamma, beta = torch.randn(nh, s, **f64), torch.randn(nh, s, **f64)
    pos = torch.randint(pmin, pmax, (B, T), generator=g)
    du = torch.randn(B, T, e, **f64) if gating else None
    dv, dheads = torch.randn(B, T, e, **f64), torch.randn(B, T, nh, s, **f64)
    cast = lambda x: None if x is None else x.to(device, dtype)
    return cast(h), cast(gamma), cast(beta), pos.to(device), (cast(du), cast(dv), cast(dheads))


def _run(backend, h, gamma, beta, pos, grads, *, e, s, gating=True, rope_heads=1, split_heads=False, bias=None,
         **kw):
    """Outputs and the gradients of h, gamma, beta (and bias, when given) by name; an output whose gradient is
    ``None`` takes no part in the backward (its gradient is zero); a parameter no gradient reaches gets
    zeros.  With ``split_heads`` the heads' gradient ``grads[2]`` is a list of one per head."""
    leaves = [x.detach().clone().requires_grad_() for x in (h, gamma, beta, *(() if bias is None else (bias,)))]
    u, v, heads = gau_heads(*leaves[:3], pos, e=e, s=s, gating=gating, rope_heads=rope_heads,
                            split_heads=split_heads, bias=None if bias is None else leaves[3], backend=backend, **kw)
    qs, dqs = (heads, grads[2]) if split_heads else ((heads,), (grads[2],))
    outs = [(o, g) for o, g in zip((u, v, *qs), (*grads[:2], *dqs)) if o is not None and g is not None]
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


def _check_exact_vs_naive(backend, case, dtype, seed, with_bias=False):
    """Outputs and the gradients of h, gamma, beta (and bias) of ``backend`` against the naive form, exact
    rule."""
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads = _inputs(2, T, e, s, nh, gating, dtype, seed=seed)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R, "bias": _bias(h, seed) if with_bias else None}
    ref, out = _run("naive", h, g, b, pos, grads, **kw), _run(backend, h, g, b, pos, grads, **kw)
    assert sorted(ref) == sorted(out)
    for name in ref:
        assert out[name].dtype == ref[name].dtype
        assert out[name].is_contiguous(), name
        assert_exact(f"{backend} {name} {_id(case)} {dtype}", ref[name], out[name])


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_chunk_matches_naive(case, dtype, with_bias):
    _check_exact_vs_naive("chunk", case, dtype, seed=0, with_bias=with_bias)


def test_bias_is_added_before_the_activation():
    """``bias`` = adding it to ``h`` first (fp64, every backend that runs here): the same outputs, and the bias's
    gradient is the column sums of ``h``'s gradient (the pre-activation's), summed independently here."""
    case = CASES[0]
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads = _inputs(2, T, e, s, nh, gating, torch.float64, seed=4)
    bias = _bias(h, 4)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R}
    for backend in ("naive", "chunk"):
        ref = _run(backend, h + bias, g, b, pos, grads, **kw)
        out = _run(backend, h, g, b, pos, grads, bias=bias, **kw)
        for name in ref:
            torch.testing.assert_close(out[name], ref[name], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out["dbias"], ref["dh"].sum((0, 1)), rtol=1e-12, atol=1e-12)


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
def test_triton_frozen_bias():
    """A bias that needs no gradient is still added (forward and the recomputed activation of the backward); no
    partial column sums are made and the other gradients are unchanged."""
    T, e, s, nh, gating, R = CASES[3]
    h, g, b, pos, grads = _inputs(2, T, e, s, nh, gating, torch.float32, seed=13)
    bias = _bias(h, 13)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R}
    ref = _run("naive", h, g, b, pos, grads, bias=bias, **kw)
    leaves = [x.clone().requires_grad_() for x in (h, g, b)]
    u, v, heads = gau_heads(*leaves, pos, bias=bias, backend="triton", **kw)
    got = torch.autograd.grad([v, heads], leaves, [grads[1], grads[2]])
    for name, x in zip(("v", "heads", "dh", "dgamma", "dbeta"), (v, heads, *got)):
        assert_exact(f"frozen bias {name}", ref[name], x)


@cpu_only
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_triton_fp16_half_rule(case, with_bias):
    T, e, s, nh, gating, R = case
    h, g, b, pos, grads = _inputs(2, T, e, s, nh, gating, torch.float64, seed=2, pmax=5000)
    _check_half_rule(h, g, b, pos, grads, {"e": e, "s": s, "gating": gating, "rope_heads": R}, torch.float16,
                     f"triton fp16 {_id(case)}", bias=_bias(h, 2) if with_bias else None)


def _check_half_rule(h, g, b, pos, grads, kw, dtype, label, bias=None):
    """Triton on ``dtype`` inputs against the fp64 naive form, with the ``dtype`` naive form as the
    half-precision rule's baseline; outputs and gradients keep ``dtype``.  ``bias`` (fp64) goes in as ``dtype``."""
    ref = _run("naive", h, g, b, pos, grads, bias=bias, **kw)
    half = [x.to(dtype) for x in (h, g, b)]
    hb = None if bias is None else bias.to(dtype)
    hgrads = [None if x is None else x.to(dtype) for x in grads]
    base = _run("naive", *half, pos, hgrads, bias=hb, **kw)
    out = _run("triton", *half, pos, hgrads, bias=hb, **kw)
    for name in ref:
        assert out[name].dtype == dtype
        assert_half_rule(f"{label} {name}", ref[name], out[name], base[name])


@cpu_only
def test_triton_autocast_dtypes():
    """fp16 ``h`` with fp32 ``gamma`` / ``beta`` (autocast): the parameters are rounded to fp16 as
    ScaleOffset does, their gradients come back in fp32 -- against the naive form, which rounds
    them the same way, by the half-precision rule."""
    kw = {"e": 20, "s": 12, "rope_heads": 1}
    h, g, b, pos, grads = _inputs(1, 21, 20, 12, 4, True, torch.float64, seed=3, pmax=3000)
    bias = _bias(h, 3)
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
    h, g, b, pos, grads = _inputs(1, T, e, s, nh, True, torch.float32, seed=4)
    grads = [x if keep else None for x, keep in zip(grads, present)]
    kw = {"e": e, "s": s}
    ref, out = _run("naive", h, g, b, pos, grads, **kw), _run("triton", h, g, b, pos, grads, **kw)
    for name in ("dh", "dgamma", "dbeta"):
        assert torch.isfinite(out[name]).all(), name
        assert_exact(f"absent grads {present} {name}", ref[name], out[name])


@cpu_only
def test_triton_gradient_of_h_alone():
    """gamma and beta frozen: no partial sums are made, ``dh`` is unchanged."""
    h, g, b, pos, (du, dv, dh_) = _inputs(1, 9, 5, 12, 6, True, torch.float32, seed=5)
    x = h.clone().requires_grad_()
    u, v, heads = gau_heads(x, g, b, pos, e=5, s=12, backend="triton")
    (dx,) = torch.autograd.grad([u, v, heads], [x], [du, dv, dh_])
    ref = _run("naive", h, g, b, pos, (du, dv, dh_), e=5, s=12)
    assert_exact("dh (frozen gamma, beta)", ref["dh"], dx)


@cpu_only
def test_torch_compile_traces_the_custom_ops():
    """``torch.compile`` (aot_eager: fake tensors, no code generation) traces forward and backward
    through ``lintime::gau_heads_fwd`` / ``gau_heads_bwd`` and gives the eager result."""
    h, g, b, pos, grads = _inputs(1, 11, 5, 8, 4, True, torch.float32, seed=6)

    def f(h, g, b):
        return gau_heads(h, g, b, pos, e=5, s=8, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    for fn, name in ((compiled, "compiled"), (f, "eager")):
        leaves = [x.clone().requires_grad_() for x in (h, g, b)]
        outs = fn(*leaves)
        got = torch.autograd.grad(outs, leaves, grads)
        ref = _run("naive", h, g, b, pos, grads, e=5, s=8)
        for key, x in zip(NAMES, (*outs, *got)):
            assert_exact(f"{name} {key}", ref[key], x)


@cpu_only
@pytest.mark.parametrize("gating", [True, False])
def test_opcheck(gating):
    """``torch.library.opcheck``: schema, fake tensors, autograd registration and AOT tracing."""
    from lintime.modules.heads.triton.heads import gau_heads_fwd

    e, s = 5, 8
    h, g, b, pos, _ = _inputs(1, 10, e, s, 2, gating, torch.float32, seed=7)
    for bias in (None, _bias(h).requires_grad_()):
        args = tuple(x.requires_grad_() for x in (h, g, b)) + (pos, bias, e, s, gating, 500.0, 2)
        torch.library.opcheck(gau_heads_fwd.op, args)


# (T, e, s, nh, gating, rope_heads, the heads with a gradient): 2 x 37 rows cross three backward heads
# programs (two 16-row blocks each) and two partial-sum column tiles; gating=False is FLASH's v + z call
SPLIT_CASES = [
    (37, 20, 12, 4, False, 1, (0, 1, 2, 3)),
    (37, 5, 12, 6, True, 1, (0, 2, 5)),  # first-to-all, three head gradients (and u's) absent
    (7, 5, 8, 2, False, 2, (1,)),
]


def _split_id(c):
    return f"{_id(c[:6])}-d{''.join(map(str, c[6]))}"


def _split_inputs(case, dtype, seed=9, device="cpu", with_bias=False):
    """Inputs, the heads' gradients one per head (``None`` unless in ``present``) and their stacked form
    (zeros for the absent ones); ``u``'s gradient is absent in the gated case."""
    T, e, s, nh, gating, R, present = case
    h, g, b, pos, (du, dv, dheads) = _inputs(2, T, e, s, nh, gating, dtype, seed=seed, device=device)
    dqs = [dheads[:, :, n : n + 1].contiguous() if n in present else None for n in range(nh)]
    stacked = torch.cat([torch.zeros_like(dheads[:, :, :1]) if d is None else d for d in dqs], 2)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R, "bias": _bias(h, seed) if with_bias else None}
    return h, g, b, pos, None, dv, dqs, stacked, kw


def _check_split_equals_stacked(case, dtype, device="cpu", with_bias=False):
    """``split_heads=True``: contiguous ``[B, T, 1, s]`` heads equal to the stacked heads' slices, and with the
    heads' gradients as separate tensors (some ``None``) the stacked path's ``dh, dgamma, dbeta`` (and ``dbias``)
    given their concatenation (zeros for the absent ones) -- bit for bit: the same kernels, only the heads'
    addresses differ."""
    h, g, b, pos, du, dv, dqs, stacked, kw = _split_inputs(case, dtype, device=device, with_bias=with_bias)
    ref = _run("triton", h, g, b, pos, (du, dv, stacked), **kw)
    out = _run("triton", h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    heads, nh = out.pop("heads"), g.shape[0]
    assert isinstance(heads, tuple) and len(heads) == nh
    for n, q in enumerate(heads):
        assert q.shape == (*h.shape[:2], 1, kw["s"]) and q.is_contiguous() and q.dtype == dtype
        assert torch.equal(q, ref["heads"][:, :, n : n + 1]), f"head {n}"
    assert sorted(out) == sorted(k for k in ref if k != "heads")
    for name in out:
        assert torch.equal(out[name], ref[name]), name


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=_split_id)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_triton_split_heads_equal_stacked(case, dtype, with_bias):
    _check_split_equals_stacked(case, dtype, with_bias=with_bias)


@cpu_only
def test_triton_split_heads_bias_matches_naive():
    """FLASH's call (split heads, no gating, a bias, some head gradients absent) against the naive form: every
    output and gradient at the fp32 exact rule -- the bias's gradient from the kernels' partial column sums (two
    row groups of 32 rows, ``u`` / ``v`` and ``z`` columns) folded."""
    h, g, b, pos, du, dv, dqs, _, kw = _split_inputs(SPLIT_CASES[0], torch.float32, seed=14, with_bias=True)
    dqs[2] = None
    ref = _run("naive", h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    out = _run("triton", h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    for name in ref:
        if name == "heads":
            for n, (x, y) in enumerate(zip(ref[name], out[name])):
                assert_exact(f"head {n}", x, y)
        else:
            assert_exact(f"split bias {name}", ref[name], out[name])


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_split_heads_other_backends(backend):
    """The naive and chunk forms give the same tuple (their stacked heads split, contiguous) and, with the heads'
    gradients split (some ``None``), the stacked path's gradients."""
    h, g, b, pos, du, dv, dqs, stacked, kw = _split_inputs(SPLIT_CASES[1], torch.float64)
    ref = _run(backend, h, g, b, pos, (du, dv, stacked), **kw)
    out = _run(backend, h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    heads = out.pop("heads")
    assert len(heads) == g.shape[0] and all(q.is_contiguous() for q in heads)
    assert torch.equal(torch.cat(heads, 2), ref["heads"])
    for name in out:
        assert_exact(f"{backend} split {name}", ref[name], out[name])


@cpu_only
def test_torch_compile_split_heads_fullgraph():
    """``torch.compile(fullgraph=True)`` (aot_eager) traces ``lintime::gau_heads_split_fwd`` / ``_split_bwd``
    without a graph break and gives the eager results bit for bit, some heads without a gradient."""
    h, g, b, pos, du, dv, dqs, _, kw = _split_inputs(SPLIT_CASES[0], torch.float32, seed=10)
    dqs[1] = None

    def f(h, g, b):
        _, v, heads = gau_heads(h, g, b, pos, split_heads=True, backend="triton", **kw)
        return v, *heads

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    res = []
    for fn in (compiled, f):
        leaves = [x.clone().requires_grad_() for x in (h, g, b)]
        outs = fn(*leaves)
        used, dout = zip(*[(o, d) for o, d in zip(outs, (dv, *dqs)) if d is not None])
        res.append([*outs, *torch.autograd.grad(used, leaves, dout)])
    for i, (got, want) in enumerate(zip(*res)):
        assert torch.equal(got, want), i


@cpu_only
def test_opcheck_split_heads():
    """``torch.library.opcheck`` of the split forward (with its autograd rule) and of the split backward with
    absent head gradients."""
    from lintime.modules.heads.triton.heads import gau_heads_split_bwd, gau_heads_split_fwd

    e, s, nh = 5, 8, 3
    h, g, b, pos, (_, dv, dheads) = _inputs(1, 10, e, s, nh, False, torch.float32, seed=7)
    bias = _bias(h)
    for bb in (None, bias.clone().requires_grad_()):
        args = tuple(x.requires_grad_() for x in (h, g, b)) + (pos, bb, e, s, False, 500.0, 2)
        torch.library.opcheck(gau_heads_split_fwd.op, args)
    dqs = [dheads[:, :, 0:1].contiguous(), None, dheads[:, :, 2:3].contiguous(), None, None, None]
    for bb, need_db in ((None, False), (bias, True), (bias, False)):
        torch.library.opcheck(gau_heads_split_bwd.op, (None, dv, *dqs, h.detach(), g.detach(), pos, bb, e, s, False,
                                                       500.0, 2, True, need_db))


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
    with pytest.raises(TypeError, match="split_heads"):
        gau_heads(h, g, b, pos, e=6, s=8, split_heads=1)
    h7, g7, b7, pos7, _ = _inputs(1, 3, 6, 8, 7, True, torch.float32)
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

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@cuda
@needs_cuda
@pytest.mark.parametrize("nh, gating, rope_heads", [(4, True, 1), (6, True, 1), (2, True, 1), (2, False, 2)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_cuda_real_size_bf16_half_rule(nh, gating, rope_heads, with_bias):
    """FLASH / GAU shapes (e = 2048, s = 128) at T = 4096, bf16, against the fp64 naive form; the
    bf16 naive form is the half-precision rule's baseline."""
    B, T, e, s = 1, 4096, 2048, 128
    h, g, b, pos, grads = _inputs(B, T, e, s, nh, gating, torch.float64, seed=11, device="cuda", pmin=0, pmax=T)
    _check_half_rule(h, g, b, pos, grads, {"e": e, "s": s, "gating": gating, "rope_heads": rope_heads},
                     torch.bfloat16, f"cuda bf16 nh={nh}", bias=_bias(h, 11) if with_bias else None)


@cuda
@needs_cuda
def test_cuda_fp32_exact_odd_sizes_large_positions():
    """fp32 kernels against the fp32 naive form on odd sizes (T = 1037, e = 300, s = 96 in two RoPE
    groups) with positions up to 1e6 (angles far outside [-pi, pi]: an approximate sin / cos fails)."""
    h, g, b, pos, grads = _inputs(3, 1037, 300, 96, 6, True, torch.float32, seed=12, device="cuda",
                                  pmin=-1000, pmax=1_000_000)
    kw = {"e": 300, "s": 96, "rope_heads": 2, "bias": _bias(h, 12)}
    ref, out = _run("naive", h, g, b, pos, grads, **kw), _run("triton", h, g, b, pos, grads, **kw)
    for name in ref:
        assert_exact(f"cuda fp32 {name}", ref[name], out[name])


@cuda
@needs_cuda
@pytest.mark.parametrize("case", [(4096, 1536, 128, 4, False, 1, (0, 1, 2, 3)),
                                  (1037, 300, 96, 6, True, 2, (0, 1, 3, 5))], ids=_split_id)
def test_cuda_split_heads_equal_stacked(case):
    """``split_heads`` on the compiled kernels, bf16: FLASH's ``v, z`` call at its real size (e = 1536, s = 128,
    nh = 4, with its bias), and an odd gated first-to-all shape with absent head gradients -- bit for bit the
    stacked path."""
    _check_split_equals_stacked(case, torch.bfloat16, device="cuda", with_bias=not case[4])


@cuda
@needs_cuda
def test_cuda_dispatch_picks_triton(impl_calls):
    calls = impl_calls(importlib.import_module("lintime.modules.heads"), "triton")
    h, g, b, pos, _ = _inputs(1, 64, 32, 16, 4, True, torch.bfloat16, device="cuda")
    gau_heads(h, g, b, pos, e=32, s=16)
    assert calls == [1]
