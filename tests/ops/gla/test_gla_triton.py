"""gated_linear_attention, backend 'triton': the fused kernels against the naive recurrence (chain
of trust naive -> chunk in tests/ops/gla/test_gla.py, naive -> triton here).  Forward, final state and
every gradient (q, k, v, the gates by the closed form, the initial state), both state forms (one
segment per sequence; materialised segment states), odd lengths, strong decays, packing,
continuation, the decoding kernel, fallbacks, and the custom ops under ``torch.compile``.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py) at small sizes, fp32
(exact tolerance) and fp16 (half-precision rule); the tests marked ``cuda`` repeat the checks at
real sizes, bf16 included.
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Triton picks interpreter vs compiler when a kernel module is imported; tests/conftest.py
    # sets this too -- repeated so this file also runs on its own
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lintime.ops import gated_linear_attention as gla
from tolerances import (
    EXACT_TOL,
    HALF_FACTOR,
    HALF_FLOOR,
    assert_close,
    assert_exact,
    rel_rms,
)

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dh0")


def _inputs(B, T, H, K, V, dtype=torch.float32, N=None, seed=0, strong=False, device=DEV):
    """q, k, v, g, h0 (fp64 draws cast to ``dtype``; h0 fp32); ``g = logsigmoid(x + 2) / 4``, or
    with 10% of the gates at -10 (decay 4.5e-5) when ``strong``."""
    gen = torch.Generator().manual_seed(seed * 1009 + T * 7 + K)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) + 2) / 4
    if strong:
        u = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
        g = torch.where(u < 0.1, torch.full_like(g, -10.0), g)
    h0 = torch.randn(B if N is None else N, H, K, V, generator=gen, dtype=torch.float64)
    return [x.to(device, dtype) for x in (q, k, v, g)] + [h0.to(device, torch.float32)]


def _run(backend, q, k, v, g, h0=None, do=None, dfinal=None, segment_chunks=None, **kw):
    """Forward + gradients of ``<o, do> + <final, dfinal>`` w.r.t. q, k, v, g (and h0)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    h = None if h0 is None else h0.detach().clone().requires_grad_()
    if backend == "triton":
        from lintime.ops.gla.triton import triton_gla

        o, final = triton_gla(*leaves, initial_state=h, output_final_state=True, segment_chunks=segment_chunks, **kw)
    else:
        o, final = gla(*leaves, initial_state=h, output_final_state=True, backend=backend, **kw)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) if do is None else do
    dfinal = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(final) if dfinal is None else dfinal
    inputs = leaves + ([h] if h is not None else [])
    grads = torch.autograd.grad((o * do).sum() + (final * dfinal).sum(), inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, grads)]
    return (o, final, *grads), do, dfinal


def _compare(tag, ref, out):
    for name, a, b in zip(NAMES, ref, out):
        assert b.dtype == a.dtype, f"{tag} {name}: dtype {b.dtype} != {a.dtype}"
        assert_exact(f"{tag} {name}", a, b)


def _compare_half(tag, ref64, base, out, dtype):
    """Half rule for every entry against the fp64 result (base: the naive form in ``dtype``)."""
    for name, r, b, o in zip(NAMES, ref64, base, out):
        assert o.dtype == b.dtype, f"{tag} {name}: dtype {o.dtype} != {b.dtype}"
        assert_close(f"{tag} {name}", r, o, HALF_FACTOR * rel_rms(r, b) + HALF_FLOOR[dtype])


def _to64(x):
    return x.double()


# ----------------------------------------------------------------------------- chain of trust


@pytest.mark.parametrize(
    "T, ns, with_h0, strong",
    [(1, 0, True, False), (65, 0, False, False), (130, 1, True, True), (150, 2, True, False)],
)
def test_chain_of_trust_fp32(T, ns, with_h0, strong):
    """triton == naive (fp32, exact tolerance): forward, final state, dq, dk, dv, dg and
    d initial_state; K = 20, V = 24 (padded tiles); T = 65 / 130 / 150 end mid-chunk; ns = 1, 2
    materialise segment states; strong decays (gates of -10) exercise the log-space sub-chunks."""
    q, k, v, g, h0 = _inputs(2 if T < 100 else 1, T, 1, 20, 24, strong=strong)
    h0 = h0 if with_h0 else None
    scale = None if T > 1 else 0.3
    ref, do, dfinal = _run("naive", q, k, v, g, h0, scale=scale)
    out, _, _ = _run("triton", q, k, v, g, h0, do, dfinal, segment_chunks=ns, scale=scale)
    _compare(f"gla triton T={T} ns={ns}", ref, out)


def test_wide_heads_split_tiles_fp32():
    """K = 40, V = 160: the output and dv walks run 2 V-blocks, the dq/dk/dg walk 3 K-blocks, the
    A kernel 2 K-blocks, all with partial last blocks; materialised segments, initial state."""
    q, k, v, g, h0 = _inputs(1, 100, 1, 40, 160)
    ref, do, dfinal = _run("naive", q, k, v, g, h0)
    out, _, _ = _run("triton", q, k, v, g, h0, do, dfinal, segment_chunks=1)
    _compare("gla triton wide heads", ref, out)


def test_strong_decays_match_fp64_better_than_chunked():
    """With 10% of the gates at -10 and a run of -30 gates (a sub-chunk decaying by more than
    SPAN_MAX nats takes the direct log-space form), the fp32 kernels stay within the exact tolerance
    of the fp64 recurrence and no further from it than the fp32 PyTorch chunked form (the exponents
    are sums local to the sub-chunks, never differences of chunk-wide cumulative sums)."""
    q, k, v, g, h0 = _inputs(1, 128, 1, 16, 16, strong=True)
    g = g.clone()
    g[0, 70:73] = -30.0
    ref, do, dfinal = _run("naive", *(_to64(x) for x in (q, k, v, g)), _to64(h0))
    out, _, _ = _run("triton", q, k, v, g, h0, do.float(), dfinal.float(), segment_chunks=1)
    chunk, _, _ = _run("chunk", q, k, v, g, h0, do.float(), dfinal.float())
    for name, r, o, c in zip(NAMES, ref, out, chunk):
        assert_close(f"gla triton strong {name}", r, o, max(EXACT_TOL[torch.float32], 2 * rel_rms(r, c)))


def test_half_precision_fp16():
    q, k, v, g, h0 = _inputs(1, 100, 2, 16, 16, torch.float64, strong=True)
    ref, do, dfinal = _run("naive", q, k, v, g, h0.double())
    half = [x.half() for x in (q, k, v, g)]
    base, _, _ = _run("naive", *half, h0, do.half(), dfinal.float())
    out, _, _ = _run("triton", *half, h0, do.half(), dfinal.float(), segment_chunks=0)
    assert out[0].dtype == torch.float16 and out[1].dtype == torch.float32
    _compare_half("gla triton fp16", ref, base, out, torch.float16)


# ----------------------------------------------------------------------------- packing, continuation


@pytest.mark.parametrize("ns", [0, 1])
def test_packing_equals_separate_calls(ns):
    """Packed sequences (lengths 5, 1, 0, 70, 17; per-sequence initial states) == separate naive
    calls: outputs, final states and every gradient."""
    lens = [5, 1, 0, 70, 17]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    q, k, v, g, h0 = _inputs(1, sum(lens), 1, 16, 16, N=len(lens))
    out, do, dfinal = _run("triton", q, k, v, g, h0, cu_seqlens=cu, segment_chunks=ns)
    o, final, dq, dk, dv, dg, dh0 = out
    for n in range(len(lens)):
        sl = slice(cu[n].item(), cu[n + 1].item())
        ref, _, _ = _run("naive", q[:, sl], k[:, sl], v[:, sl], g[:, sl], h0[n : n + 1], do[:, sl], dfinal[n : n + 1])
        got = (o[:, sl], final[n : n + 1], dq[:, sl], dk[:, sl], dv[:, sl], dg[:, sl], dh0[n : n + 1])
        _compare(f"gla triton packed seq {n} ns={ns}", ref, got)


def test_packed_layout_read_once_per_cu_seqlens(monkeypatch):
    """The packed segment layout (one host read of ``cu_seqlens``) is built once per tensor and shared by
    the forward and backward of every call with it (a model's layers); an in-place write or another
    tensor rebuilds it, with the same results."""
    from lintime.ops.utils import segments as seg_mod

    builds = []
    real = seg_mod._packed_segments
    monkeypatch.setattr(seg_mod, "_packed_segments", lambda *a: builds.append(a[3]) or real(*a))
    lens = [5, 1, 0, 40, 17]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV, dtype=torch.int32)  # as models pass it
    q, k, v, g, h0 = _inputs(1, sum(lens), 1, 16, 16, N=len(lens))
    first, do, dfinal = _run("triton", q, k, v, g, h0, cu_seqlens=cu, segment_chunks=1)
    n_first = len(builds)
    assert n_first >= 1
    second, _, _ = _run("triton", q, k, v, g, h0, do, dfinal, cu_seqlens=cu, segment_chunks=1)
    assert len(builds) == n_first  # the second call, forward and backward: no new layout
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    cu[2:4] = 8  # in place (lengths 5, 3, 0, 38, 17): rebuilt
    moved, _, _ = _run("triton", q, k, v, g, h0, do, dfinal, cu_seqlens=cu, segment_chunks=1)
    assert len(builds) > n_first
    ref, _, _ = _run("triton", q, k, v, g, h0, do, dfinal, cu_seqlens=cu.clone(), segment_chunks=1)
    assert all(torch.equal(a, b) for a, b in zip(moved, ref))


def test_continuation_equals_one_call():
    """Splitting at 37 (mid-chunk), 64 (chunk boundary), 65 and carrying the final state gives one
    call's outputs, final state and gradients (through the chain of states)."""
    q, k, v, g, h0 = _inputs(1, 100, 1, 16, 16)
    ref, do, dfinal = _run("naive", q, k, v, g, h0)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, h0)]
    state, outs = leaves[4], []
    cuts = [0, 37, 64, 65, 100]
    for s, e in zip(cuts, cuts[1:]):
        o, state = gla(*(x[:, s:e] for x in leaves[:4]), initial_state=state, output_final_state=True,
                       backend="triton")
        outs.append(o)
    o = torch.cat(outs, dim=1)
    grads = torch.autograd.grad((o * do).sum() + (state * dfinal).sum(), leaves)
    _compare("gla triton continuation", ref, (o, state, *grads))


def test_prefill_then_decode():
    """Prefill through the chunked kernels, then one token per call (forward-only calls of <= 16
    tokens run the recurrent kernel), two sequences packed: equal to one naive call."""
    lens = [30, 21]
    cu = torch.tensor([0, 30, 51], device=DEV)
    q, k, v, g, h0 = _inputs(1, 51, 2, 16, 16, N=2)
    ref, ref_final = gla(q, k, v, g, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="naive")
    P = 17
    with torch.no_grad():
        idx = lambda parts: torch.tensor([t for a, b in parts for t in range(a, b)], dtype=torch.long, device=DEV)
        i1 = idx([(0, P), (30, 30 + P)])
        o1, st = gla(*(x[:, i1] for x in (q, k, v, g)), initial_state=h0, output_final_state=True,
                     cu_seqlens=torch.tensor([0, P, 2 * P], device=DEV), backend="triton")
        out = torch.zeros_like(ref).index_copy(1, i1, o1)
        for step in range(max(lens) - P):
            pos = [(s + P + step, s + P + step + 1) if P + step < L else (0, 0) for s, L in zip((0, 30), lens)]
            it = idx(pos)
            cu_t = torch.tensor([0, *torch.tensor([b - a for a, b in pos]).cumsum(0).tolist()], device=DEV)
            o_t, st = gla(*(x[:, it] for x in (q, k, v, g)), initial_state=st, output_final_state=True,
                          cu_seqlens=cu_t, backend="triton")
            out = out.index_copy(1, it, o_t)
    assert_exact("gla prefill+decode o", ref, out)
    assert_exact("gla prefill+decode state", ref_final, st)


# ----------------------------------------------------------------------------- custom ops, fallbacks


def test_custom_op_compiles_and_checks():
    """The forward op passes torch.library.opcheck (schema, fake tensors, autograd registration),
    refuses a backward when it kept no per-chunk states, and a torch.compile'd call (fullgraph)
    traces through it, gradients included."""
    from lintime.ops.gla.triton.ops import gla_fwd_op

    q, k, v, g, h0 = _inputs(1, 20, 1, 16, 16)
    args = tuple(x.requires_grad_() for x in (q, k, v, g, h0)) + (None, 0.25, 0, True)
    torch.library.opcheck(gla_fwd_op.op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    # a forward that kept no per-chunk states (keep=False, forward-only calls) refuses a backward
    o = gla_fwd_op.op(*args[:-1], False)[0]
    with pytest.raises(RuntimeError, match="keep=False"):
        o.sum().backward()

    def f(q, k, v, g):
        o, s = gla(q, k, v, g, output_final_state=True, backend="triton")
        return o.float().sum() + s.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    g1 = torch.autograd.grad(compiled(*leaves), leaves)
    leaves2 = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
    g2 = torch.autograd.grad(f(*leaves2), leaves2)
    for a, b in zip(g2, g1):
        assert_exact("compiled grad", a, b)


def test_fallbacks():
    """fp64 inputs and head sizes above 256 take the chunked PyTorch form."""
    from lintime.ops.gla.triton import triton_gla

    q, k, v, g, h0 = _inputs(1, 10, 1, 8, 8, torch.float64)
    assert_exact("fp64 fallback", gla(q, k, v, g, backend="chunk")[0], triton_gla(q, k, v, g)[0])
    q, k, v, g, h0 = _inputs(1, 5, 1, 4, 260)
    assert_exact("V=260 fallback", gla(q, k, v, g, backend="chunk")[0], triton_gla(q, k, v, g)[0])


def test_heads_narrower_than_a_tile_take_the_chunked_form(monkeypatch):
    """K or V below 16 (gla-tiny at width 64: K = 8) never reach the kernels: the chunked form's result, gradients
    included, on every device."""
    from lintime.ops.gla import chunk as chunk_mod
    from lintime.ops.gla.triton import triton_gla

    calls = []
    real = chunk_mod.chunk_gla
    monkeypatch.setattr(chunk_mod, "chunk_gla", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for K, V in ((8, 16), (16, 8)):
        q, k, v, g, h0 = _inputs(2, 70, 2, K, V)
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        o, _ = triton_gla(*leaves)
        ref = real(*(x.detach().clone() for x in (q, k, v, g)), scale=K**-0.5)[0]
        assert_exact(f"K={K} V={V}", ref, o)
    assert len(calls) == 2


# ----------------------------------------------------------------------------- CUDA, real sizes


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ns", [None, 0])
def test_cuda_real_sizes(dtype, ns):
    """B = 2, T = 1000, H = 2, K = 128, V = 256 (the issue's GLA head) with an initial state and
    strong decays, against the fp64 recurrence: fp32 to the exact tolerance, half precision by the
    rule (base: the naive form in that dtype).  ``ns=None``: automatic segments (materialised at
    this size)."""
    q, k, v, g, h0 = _inputs(2, 1000, 2, 128, 256, torch.float64, strong=True)
    ref, do, dfinal = _run("naive", q, k, v, g, h0.double())
    x = [t.to(dtype) for t in (q, k, v, g)]
    base, _, _ = _run("naive", *x, h0, do.to(dtype), dfinal.float())
    out, _, _ = _run("triton", *x, h0, do.to(dtype), dfinal.float(), segment_chunks=ns)
    if dtype == torch.float32:
        _compare(f"gla cuda fp32 ns={ns}", base, out)
    else:
        _compare_half(f"gla cuda {dtype} ns={ns}", ref, base, out, dtype)


@cuda
@needs_cuda
def test_cuda_packing_bf16():
    lens = [1000, 1, 0, 2049, 77]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    q, k, v, g, h0 = _inputs(1, sum(lens), 2, 128, 256, torch.float64, N=len(lens))
    ref, do, dfinal = _run("naive", q, k, v, g, h0.double(), cu_seqlens=cu)
    x = [t.bfloat16() for t in (q, k, v, g)]
    base, _, _ = _run("naive", *x, h0, do.bfloat16(), dfinal.float(), cu_seqlens=cu)
    out, _, _ = _run("triton", *x, h0, do.bfloat16(), dfinal.float(), cu_seqlens=cu)
    _compare_half("gla cuda packed bf16", ref, base, out, torch.bfloat16)


@cuda
@needs_cuda
def test_cuda_long_bf16_strong_decays():
    """T = 131072 in bf16 with g = logsigmoid(x)/16, 5% of gates at -10 and a few at -1000:
    forward and gradients finite and equal to an fp32 triton run on the same (bf16-rounded)
    inputs up to bf16 rounding (2^-8, final state included); the fp32 run matches the fp64 chunked form (exact rule
    for the state, 2e-5 for the output as in tests/ops/gla/test_gla.py)."""
    T, H, K, V = 131072, 1, 64, 64
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, H, d, generator=gen).bfloat16().to(DEV) for d in (K, K, V))
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen)) / 16
    u = torch.rand(1, T, H, K, generator=gen)
    g = torch.where(u < 0.05, -10.0, torch.where(u > 0.999, -1000.0, g)).bfloat16().to(DEV)
    do = torch.randn(1, T, H, V, generator=gen).bfloat16().to(DEV)
    dfinal = torch.zeros(1, H, K, V, device=DEV)
    (o, final, *grads), _, _ = _run("triton", q, k, v, g, do=do, dfinal=dfinal)
    for name, x in zip(NAMES, (o, final, *grads)):
        assert torch.isfinite(x).all(), f"gla triton bf16 T={T}: {name} not finite"
    x32 = [t.float() for t in (q, k, v, g)]
    (o32, final32, *grads32), _, _ = _run("triton", *x32, do=do.float(), dfinal=dfinal)
    assert_close(f"gla triton bf16 T={T} vs fp32", o32, o, 2.0**-8)
    # the bf16 run rounds the decayed keys to bf16 in the state matmul: bf16 rounding, not exact
    assert_close(f"gla triton bf16 T={T} final vs fp32", final32, final, 2.0**-8)
    for name, a, b in zip(("dq", "dk", "dv", "dg"), grads32, grads):
        assert_close(f"gla triton bf16 T={T} {name} vs fp32", a, b, 2.0**-8)
    o64, final64 = gla(*(t.double() for t in x32), output_final_state=True, backend="chunk")
    assert_close(f"gla triton fp32 T={T} vs fp64", o64, o32, 2e-5)
    assert_exact(f"gla triton fp32 T={T} final vs fp64", final64, final32)


@cuda
@needs_cuda
@pytest.mark.parametrize("K,V", [(32, 16), (64, 64)])
def test_cuda_small_heads_bf16(K, V):
    """Small heads (smaller tiles, fewer warps) with materialised segments, bf16 half rule."""
    q, k, v, g, h0 = _inputs(2, 700, 3, K, V, torch.float64, strong=True)
    ref, do, dfinal = _run("naive", q, k, v, g, h0.double())
    x = [t.bfloat16() for t in (q, k, v, g)]
    base, _, _ = _run("naive", *x, h0, do.bfloat16(), dfinal.float())
    out, _, _ = _run("triton", *x, h0, do.bfloat16(), dfinal.float(), segment_chunks=4)
    _compare_half(f"gla cuda small heads K={K} V={V}", ref, base, out, torch.bfloat16)


# ----------------------------------------------------------------------------- in-chunk paths


@cuda  # also in the GPU runs' `-m cuda` selection; runs on the CPU (interpreter) as well
@pytest.mark.parametrize("one_level", [True, False])
def test_one_level_span_guard(one_level):
    """The one-level in-chunk products (``GLALaunch.one_level``; bf16's default) and their run-time guard:
    gates that are mild in one K-block and, in some chunks only, strong (-10, a span far beyond 40
    nats) in the other, so one call takes both paths, per chunk and per K-block, in the prep and the
    dq/dk/dg kernels; packed sequences with partial chunks.  fp32 (exact rule) everywhere, and bf16
    by the half-precision rule on CUDA."""
    from lintime.ops.gla.triton.launch import default_launch
    from lintime.ops.gla.triton.ops import gla_bwd, gla_fwd

    lens, H, K, V = [150, 1, 0, 131], 2, 64, 48
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    q, k, v, g, h0 = _inputs(1, sum(lens), H, K, V, torch.float64, N=len(lens))
    tok = torch.arange(sum(lens), device=DEV)
    strong = ((tok // 64) % 2 == 1)[None, :, None, None] & (torch.arange(K, device=DEV) >= K // 2)
    g = torch.where(strong & (torch.rand(g.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
                              .to(DEV) < 0.2), torch.full_like(g, -10.0), g)
    ref, do, dfinal = _run("naive", q, k, v, g, h0.double(), cu_seqlens=cu)
    for dtype in (torch.float32, torch.bfloat16) if CUDA else (torch.float32,):
        # the path forced either way; dq/dk/dg tiles of [32 keys, 16 values] (several V-blocks)
        cfg = dataclasses.replace(default_launch(K, V, dtype), one_level=one_level, prep_bk=32, dqkg_bk=32, dqkg_bv=16,
                                  dqkg_maxnreg=128 if one_level else 0)
        x = [t.to(dtype) for t in (q, k, v, g)]
        base, _, _ = _run("naive", *x, h0, do.to(dtype), dfinal.float(), cu_seqlens=cu)
        for ns in (0, 2):
            o, ht, *saved = gla_fwd(*x, h0, cu, K**-0.5, ns, True, cfg)
            out = (o, ht, *gla_bwd(*x, *saved, do.to(dtype), dfinal.float(), cu, K**-0.5, ns, True, cfg))
            if dtype == torch.float32:
                _compare(f"gla one_level={one_level} ns={ns}", base, out)
            else:
                _compare_half(f"gla bf16 one_level={one_level} ns={ns}", ref, base, out, dtype)
