"""gated_linear_attention: naive recurrence <-> recurrent (decoding) form <-> chunked form, forward,
final state and every gradient (q, k, v, g, initial_state); packing, continuation, half
precision, a long bf16 run with strong decays, error paths."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import lintime.ops.gla as gla_pkg
from lintime.ops import gated_linear_attention as gla
from tolerances import assert_close, assert_exact, assert_half_rule

BACKENDS = ("naive", "recurrent", "chunk")
NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dh0")


def _inputs(B, T, H, K, V, dtype=torch.float64, N=None, seed=0, strong=False):
    """q, k, v, g, h0 (fp64 draws cast to ``dtype``); ``g = logsigmoid(x) / 4`` (decays between
    about 0.5 and 1), or a mix with very strong decays when ``strong``."""
    gen = torch.Generator().manual_seed(seed * 1009 + T * 7 + K)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) + 2) / 4
    if strong:
        u = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
        g = torch.where(u < 0.1, torch.full_like(g, -10.0), g)
    h0 = torch.randn(B if N is None else N, H, K, V, generator=gen, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, g, h0)]


def _run(backend, q, k, v, g, h0=None, do=None, dfinal=None, **kw):
    """Forward + gradients of ``<o, do> + <final, dfinal>`` w.r.t. q, k, v, g (and h0)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g)]
    h = None if h0 is None else h0.detach().requires_grad_()
    o, final = gla(*leaves, initial_state=h, output_final_state=True, backend=backend, **kw)
    do = torch.randn_like(o) if do is None else do
    dfinal = torch.randn_like(final) if dfinal is None else dfinal
    loss = (o * do).sum() + (final * dfinal).sum()
    inputs = leaves + ([h] if h is not None else [])
    # allow_unused: an empty sequence's q, k, v, g (T = 0) do not reach the loss
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if d is None else d for x, d in zip(inputs, grads)]
    return (o, final, *grads), do, dfinal


def _compare(tag, ref, out, assert_fn=assert_exact):
    for name, a, b in zip(NAMES, ref, out):
        assert b.dtype == a.dtype, f"{tag} {name}: dtype {b.dtype} != {a.dtype}"
        assert_fn(f"{tag} {name}", a, b)


# ----------------------------------------------------------------------------- chain of trust


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "T, with_h0", [(1, False), (1, True), (2, False), (2, True), (63, False), (63, True), (257, True)]
)
def test_chain_of_trust(dtype, T, with_h0):
    """naive -> recurrent -> chunk agree: forward, final state, dq, dk, dv, dg (closed form in the
    chunked backward) and d initial_state.  K = 60, V = 20; T = 63 / 257 end mid-chunk (B = 1 at
    T = 257, and only with an initial state, to keep the step-by-step reference quick; batching
    and the zero initial state are covered at the other T)."""
    q, k, v, g, h0 = _inputs(2 if T < 257 else 1, T, 2, 60, 20, dtype)
    h0 = h0 if with_h0 else None
    ref, do, dfinal = _run("naive", q, k, v, g, h0)
    for backend in ("recurrent", "chunk"):
        out, _, _ = _run(backend, q, k, v, g, h0, do, dfinal)
        _compare(f"gla {backend} T={T} {dtype}", ref, out)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 40])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_chunk_options(chunk_size, scale):
    """Every chunk size (1, a prime 7 -> sub-chunk 7, 16 = one sub-chunk, 40 -> sub-chunks of 10)
    and an explicit scale give the naive result; T = 45 is no multiple of any of them but 1."""
    q, k, v, g, h0 = _inputs(2, 45, 2, 6, 5)
    ref, do, dfinal = _run("naive", q, k, v, g, h0, scale=scale)
    out, _, _ = _run("chunk", q, k, v, g, h0, do, dfinal, scale=scale, chunk_size=chunk_size)
    _compare(f"gla chunk C={chunk_size} scale={scale}", ref, out)


def test_strong_decays_fp64():
    """Gates of -10 (decay 4.5e-5) inside sub-chunks and across chunks: the log-space forms keep
    every exponent <= 0 and still match the textbook recurrence, gradients included."""
    q, k, v, g, h0 = _inputs(1, 100, 2, 8, 4, strong=True)
    g = g.clone()
    g[0, 30:33] = -200.0  # decay exp(-200): the state is wiped (fp32 would underflow exp(G) to 0)
    ref, do, dfinal = _run("naive", q, k, v, g, h0)
    out, _, _ = _run("chunk", q, k, v, g, h0, do, dfinal, chunk_size=32)
    _compare("gla chunk strong decays", ref, out)


def test_output_final_state_off_and_dtypes():
    q, k, v, g, h0 = _inputs(2, 9, 1, 4, 3, torch.bfloat16)
    for backend in BACKENDS:
        o, final = gla(q, k, v, g, backend=backend)
        assert final is None and o.dtype == torch.bfloat16 and o.shape == (2, 9, 1, 3)
        o, final = gla(q, k, v, g, initial_state=h0, output_final_state=True, backend=backend)
        assert final.dtype == torch.float32 and final.shape == (2, 1, 4, 3), backend


def test_empty_call_returns_initial_state():
    q, k, v, g, h0 = _inputs(2, 0, 1, 4, 3)
    for backend in BACKENDS:
        o, final = gla(q, k, v, g, initial_state=h0, output_final_state=True, backend=backend)
        assert o.shape == (2, 0, 1, 3)
        assert torch.equal(final, h0), backend


def test_automatic_dispatch(monkeypatch):
    """T == 1 decodes with the recurrent form, longer calls use the chunked form."""
    calls = []
    for name in ("recurrent", "chunk"):
        impl = gla_pkg._IMPLS[name]
        monkeypatch.setitem(gla_pkg._IMPLS, name, lambda *a, _n=name, _f=impl, **kw: calls.append(_n) or _f(*a, **kw))
    q, k, v, g, _ = _inputs(1, 5, 1, 4, 4)
    gla(q, k, v, g)
    gla(q[:, :1], k[:, :1], v[:, :1], g[:, :1])
    assert calls == ["chunk", "recurrent"]


# ----------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rule(dtype):
    """Chunked half-precision forward and gradients vs the fp64 reference: error <= 2 x the naive
    same-dtype error + floor (tests/tolerances.py rule)."""
    q, k, v, g, h0 = _inputs(1, 96, 2, 32, 32, strong=True)
    ref, do, dfinal = _run("naive", q, k, v, g, h0)
    half = [x.to(dtype) for x in (q, k, v, g)]
    base, _, _ = _run("naive", *half, h0.float(), do.to(dtype), dfinal.float())
    out, _, _ = _run("chunk", *half, h0.float(), do.to(dtype), dfinal.float())
    assert out[0].dtype == dtype and out[1].dtype == torch.float32
    for name, r, b, o in zip(NAMES, ref, base, out):
        if o.dtype == dtype:
            assert_half_rule(f"gla chunk {dtype} {name}", r, o, b)
        else:  # final state and d initial_state are fp32 sums of the same half inputs in both forms
            assert_exact(f"gla chunk {dtype} {name} vs naive", b, o)


def test_long_bf16_strong_decays():
    """T = 32768 in bf16 with g = logsigmoid(x)/16, 5% of gates at -10 and a few at -1000:
    forward and gradients finite, and equal to an fp32 run on the same (bf16-rounded) inputs up
    to the bf16 rounding of the results (relative error <= 2^-8, bf16's unit roundoff: both runs
    compute in fp32 from the same values); the fp32 run itself matches fp64 (see the bound below).
    The bounds are the ones set at T = 65536 (the bf16 one does not depend on T; fp32's order error grows with it),
    unchanged at half the tokens and half the time."""
    T, H, K, V = 32768, 1, 16, 16
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, T, H, d, generator=gen).bfloat16() for d in (K, K, V))
    g = F.logsigmoid(torch.randn(1, T, H, K, generator=gen)) / 16
    u = torch.rand(1, T, H, K, generator=gen)
    g = torch.where(u < 0.05, -10.0, torch.where(u > 0.999, -1000.0, g)).bfloat16()
    do = torch.randn(1, T, H, V, generator=gen).bfloat16()
    (o, final, *grads), _, _ = _run("chunk", q, k, v, g, do=do, dfinal=torch.zeros(1, H, K, V))
    for name, x in zip(NAMES, (o, final, *grads)):
        assert torch.isfinite(x).all(), f"gla bf16 T={T}: {name} not finite"
    (o32, final32, *grads32), _, _ = _run(
        "chunk", *(x.float() for x in (q, k, v, g)), do=do.float(), dfinal=torch.zeros(1, H, K, V)
    )
    assert_close(f"gla bf16 T={T} vs fp32", o32, o, 2.0**-8)
    assert_exact(f"gla bf16 T={T} final state vs fp32", final32, final)
    for name, a, b in zip(("dq", "dk", "dv", "dg"), grads32, grads):
        assert_close(f"gla bf16 T={T} {name} vs fp32", a, b, 2.0**-8)
    o64, final64 = gla(*(x.double() for x in (q, k, v, g)), output_final_state=True, backend="chunk")
    # fp32 through 64k-128k tokens sits at the edge of the 5e-6 exact rule (measured 4.9e-6 for the
    # output, 7.6e-8 for the final state): allow 2e-5 for the output, the exact rule for the state
    assert_close(f"gla fp32 T={T} vs fp64", o64, o32, 2e-5)
    assert_exact(f"gla fp32 T={T} final vs fp64", final64, final32)


# ----------------------------------------------------------------------------- packing, continuation


@pytest.mark.parametrize("backend", BACKENDS)
def test_packing_equals_separate_calls(backend):
    """Packed sequences (lengths 5, 1, 0, 40, 17; per-sequence initial states) == separate naive
    calls: outputs, final states and every gradient."""
    lens = [5, 1, 0, 40, 17]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, h0 = _inputs(1, sum(lens), 2, 6, 5, N=len(lens))
    out, do, dfinal = _run(backend, q, k, v, g, h0, cu_seqlens=cu, chunk_size=16)
    o, final, dq, dk, dv, dg, dh0 = out
    for n in range(len(lens)):
        s, e = cu[n].item(), cu[n + 1].item()
        sl = slice(s, e)
        ref, _, _ = _run("naive", q[:, sl], k[:, sl], v[:, sl], g[:, sl], h0[n : n + 1], do[:, sl], dfinal[n : n + 1])
        got = (o[:, sl], final[n : n + 1], dq[:, sl], dk[:, sl], dv[:, sl], dg[:, sl], dh0[n : n + 1])
        _compare(f"gla {backend} packed seq {n}", ref, got)


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_continuation_equals_one_call(backend):
    """Splitting at 37 (mid-chunk), 64 (chunk boundary), 65, 101 and carrying the final state
    gives one call's outputs, final state and gradients (through the chain of states)."""
    q, k, v, g, h0 = _inputs(2, 150, 2, 6, 5)
    ref, do, dfinal = _run("naive", q, k, v, g, h0)
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, h0)]
    state, outs = leaves[4], []
    cuts = [0, 37, 64, 65, 101, 150]
    for s, e in zip(cuts, cuts[1:]):
        o, state = gla(*(x[:, s:e] for x in leaves[:4]), initial_state=state, output_final_state=True,
                       chunk_size=32, backend=backend)
        outs.append(o)
    o = torch.cat(outs, dim=1)
    grads = torch.autograd.grad((o * do).sum() + (state * dfinal).sum(), leaves)
    _compare(f"gla {backend} continuation", ref, (o, state, *grads))


@given(
    lens=st.lists(st.integers(0, 23), min_size=1, max_size=3).filter(lambda ls: sum(ls) > 0),
    packed=st.booleans(),
    H=st.integers(1, 2),
    K=st.integers(1, 9),
    V=st.integers(1, 7),
    chunk_size=st.integers(1, 20),
    split=st.floats(0.0, 1.0),
    with_h0=st.booleans(),
    scale=st.one_of(st.none(), st.floats(0.1, 2.0)),
)
def test_hypothesis_random_shapes(lens, packed, H, K, V, chunk_size, split, with_h0, scale):
    """Random shapes / packing / chunk sizes / scale: chunked == naive (forward, final state, all
    gradients), and a continuation at a random split of every sequence == one call."""
    if packed:
        B, T, N = 1, sum(lens), len(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    else:
        B, T, N, cu = len(lens), max(lens), len(lens), None
    q, k, v, g, h0 = _inputs(B, T, H, K, V, N=N, seed=chunk_size)
    h0 = h0 if with_h0 else None
    kw = dict(scale=scale, cu_seqlens=cu)
    ref, do, dfinal = _run("naive", q, k, v, g, h0, **kw)
    out, _, _ = _run("chunk", q, k, v, g, h0, do, dfinal, chunk_size=chunk_size, **kw)
    _compare("gla hypothesis chunk", ref, out)
    # continuation: each sequence cut at the same fraction of its length
    if packed:
        cuts = [math.floor(split * n) for n in lens]
        first = [(s, s + c) for s, c in zip(cu.tolist(), cuts)]
        second = [(s + c, e) for s, c, e in zip(cu.tolist(), cuts, cu.tolist()[1:])]
        idx = lambda parts: torch.tensor([t for a, b in parts for t in range(a, b)], dtype=torch.long)
        cu_of = lambda parts: torch.tensor([0, *torch.tensor([b - a for a, b in parts]).cumsum(0).tolist()])
        i1, i2 = idx(first), idx(second)
        o1, s1 = gla(*(x[:, i1] for x in (q, k, v, g)), initial_state=h0, output_final_state=True,
                     chunk_size=chunk_size, scale=scale, cu_seqlens=cu_of(first), backend="chunk")
        o2, s2 = gla(*(x[:, i2] for x in (q, k, v, g)), initial_state=s1, output_final_state=True,
                     chunk_size=chunk_size, scale=scale, cu_seqlens=cu_of(second), backend="chunk")
        o = torch.zeros_like(ref[0]).index_copy(1, i1, o1).index_copy(1, i2, o2)
    else:
        c = math.floor(split * T)
        o1, s1 = gla(q[:, :c], k[:, :c], v[:, :c], g[:, :c], initial_state=h0, output_final_state=True,
                     chunk_size=chunk_size, scale=scale, backend="chunk")
        o2, s2 = gla(q[:, c:], k[:, c:], v[:, c:], g[:, c:], initial_state=s1, output_final_state=True,
                     chunk_size=chunk_size, scale=scale, backend="chunk")
        o = torch.cat([o1, o2], dim=1)
    assert_exact("gla hypothesis continuation o", ref[0], o)
    assert_exact("gla hypothesis continuation final", ref[1], s2)


# ----------------------------------------------------------------------------- errors


def test_bad_inputs_fail_clearly(monkeypatch):
    q, k, v, g, h0 = _inputs(2, 8, 1, 4, 3, torch.float32)
    cu = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match="batch size must be 1"):
        gla(q, k, v, g, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        gla(q, k, v[:, :4], g)
    with pytest.raises(ValueError, match="feature size K"):
        gla(q, k, v, g[..., :2])
    with pytest.raises(ValueError, match="feature size K"):
        gla(q, k[..., :3], v, g)
    with pytest.raises(ValueError, match="must have 4 dims"):
        gla(q, k, v, g[0])
    with pytest.raises(TypeError, match="share a dtype"):
        gla(q, k.double(), v, g)
    with pytest.raises(TypeError, match="floating"):
        gla(q, k, v, g.long())
    with pytest.raises(TypeError, match="torch.Tensor"):
        gla(q, k, v, 0.5)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        gla(q, k, v, g, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        gla(q, k, v, g, chunk_size=16.0)
    with pytest.raises(TypeError, match="scale"):
        gla(q, k, v, g, scale="0.5")
    with pytest.raises(TypeError, match="output_final_state"):
        gla(q, k, v, g, output_final_state=1)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        gla(q, k, v, g, initial_state=h0[:1])
    with pytest.raises(ValueError, match="initial_state must have shape"):
        gla(q, k, v, g, initial_state=h0.transpose(2, 3))
    with pytest.raises(ValueError, match="initial_state must have shape"):  # N = 2 sequences, not B = 1
        gla(q[:1], k[:1], v[:1], g[:1], initial_state=h0[:1], cu_seqlens=torch.tensor([0, 3, 8]))
    with pytest.raises(TypeError, match="floating"):
        gla(q, k, v, g, initial_state=h0.long())
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        gla(q[:1], k[:1], v[:1], g[:1], cu_seqlens=torch.tensor([0, 3, 7]))
    with pytest.raises(TypeError, match="integer"):
        gla(q[:1], k[:1], v[:1], g[:1], cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="unknown backend"):
        gla(q, k, v, g, backend="cuda")
    # a CPU tensor without the interpreter; the kernel module is imported first, while the
    # interpreter is on, so it is not built for a GPU that later tests in this process lack
    importlib.import_module("lintime.ops.gla.triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, g, _ = _inputs(2, 8, 1, 16, 16, torch.float32)  # heads the kernels take (narrower: the chunked form)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        gla(q, k, v, g, backend="triton")


def test_chunk_form_ignores_autocast():
    """Under autocast (bf16 inputs, as a layer's projections give them) the chunked form computes in its own fp32:
    the same output and gradients as outside autocast (it failed in backward before, an fp32 state meeting a bf16
    gradient)."""
    q, k, v, g, _ = _inputs(2, 70, 2, 8, 16, dtype=torch.float32)
    q, k, v = (x.bfloat16() for x in (q, k, v))

    def run(amp, backward_in_autocast=False):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            o, _ = gla(*leaves, backend="chunk")
            if backward_in_autocast:
                o.float().square().sum().backward()
        if not backward_in_autocast:
            o.float().square().sum().backward()
        return [o] + [x.grad for x in leaves]

    plain = run(False)
    # the backward called inside the autocast region too (its einsums once ran in bf16 there)
    for amp_run in (run(True), run(True, backward_in_autocast=True)):
        for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), plain, amp_run):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_chunk_backward_has_no_data_dependent_op():
    """The chunked form's forward and backward on meta tensors (shapes only): an op whose output
    shape depends on values (``nonzero``, a boolean-mask index) or a host read fails there, and on
    CUDA it is a device sync that a CUDA graph cannot hold (the MQAR sweep captures gla-tiny's step,
    whose 8-wide heads take this form).  Rule: it runs and the gradients have the inputs' shapes."""
    from lintime.ops.gla.chunk import ChunkGLAFunction, sub_chunk_size
    from lintime.ops.utils import chunk_layout

    B, T, C, H, K = 2, 40, 16, 2, 8
    layout = chunk_layout(B, T, C, None, "meta")
    q, k, v, g = (layout.to_chunks(torch.randn(B, T, H, K, device="meta")).requires_grad_() for _ in range(4))
    o, final = ChunkGLAFunction.apply(q, k, v, g, None, K**-0.5, layout, sub_chunk_size(C))
    (o.sum() + final.sum()).backward()
    assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v, g))
