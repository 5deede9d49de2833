"""softmax_attention with a static cu_seqlens (lintime.ops.utils.mark_static): a ``[Ncap + 1]`` buffer whose
trailing entries repeat ``T`` and whose values change between calls.  It is never read on the host and gives the
results of the unpadded cu_seqlens and of the per-document reference, forward and gradients; ``max_seqlen`` bounds
the varlen kernel's grid."""

import pytest
import torch

from lintime.generation.profiling import count_host_syncs
from lintime.ops import softmax_attention
from lintime.ops.softmax import chunk as sdpa
from lintime.ops.utils import mark_static
from tolerances import assert_exact, assert_half_rule

NCAP = 9  # capacity of the static buffer: more entries than any layout below has documents
LAYOUTS = {  # document lengths of one packed row of T = 63 tokens: an empty document in the middle
    "a": [5, 0, 40, 1, 17],
    "b": [30, 2, 0, 0, 31],
}
T = 63


def _inputs(T, H, K, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, T, H, D, generator=g, dtype=torch.float64).to(dtype) for D in (K, K, V)]


def _cu(lens, ncap=None, device="cpu"):
    """Offsets of ``lens``; with ``ncap``, padded to ``ncap + 1`` entries by repeating the total."""
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    if ncap is not None:
        cu += [cu[-1]] * (ncap + 1 - len(cu))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _run(q, k, v, do, **kw):
    """Output and the gradients of q, k, v."""
    xs = [x.detach().requires_grad_() for x in (q, k, v)]
    o = softmax_attention(*xs, **kw)
    return (o, *torch.autograd.grad(o, xs, do))


def _run_static(q, k, v, do, max_seqlen=None, **kw):
    """:func:`_run` under the host-sync counter: no value of any tensor is read on the host, forward or backward
    (``max_seqlen`` passed only when given, as a caller that does not know one writes the call)."""
    if max_seqlen is not None:
        kw["max_seqlen"] = max_seqlen
    with count_host_syncs() as c:
        out = _run(q, k, v, do, **kw)
    assert c.total == 0, f"host reads on the static path: {dict(c.counts)}"
    return out


def _assert_all(name, ref, out):
    for part, a, b in zip(("o", "dq", "dk", "dv"), ref, out):
        assert_exact(f"{name} {part}", a, b)


@pytest.mark.parametrize("max_seqlen", [None, 40, 1000])
@pytest.mark.parametrize("causal", [True, False])
def test_static_padded_equals_unpadded_and_naive(causal, max_seqlen):
    q, k, v = _inputs(T, 2, 16, 8, torch.float32)
    do = torch.randn(1, T, 2, 8)
    lens = LAYOUTS["a"]
    naive = _run(q, k, v, do, causal=causal, cu_seqlens=_cu(lens), backend="naive")
    dynamic = _run(q, k, v, do, causal=causal, cu_seqlens=_cu(lens), backend="chunk")
    static = _run_static(q, k, v, do, causal=causal, cu_seqlens=mark_static(_cu(lens, NCAP)), max_seqlen=max_seqlen,
                         backend="chunk")
    _assert_all("dynamic vs naive", naive, dynamic)
    _assert_all("static vs naive", naive, static)


@pytest.mark.parametrize("causal", [True, False])
def test_static_buffer_reused_with_new_values(causal):
    """One buffer, the layouts copied into it in turn (as before each replay of a captured step): each call gives
    its own layout's results, nothing kept from the call before."""
    q, k, v = _inputs(T, 2, 16, 8, torch.float32, seed=1)
    do = torch.randn(1, T, 2, 8)
    buf = mark_static(torch.empty(NCAP + 1, dtype=torch.int32))
    for name in ("a", "b", "a"):
        lens = LAYOUTS[name]
        buf.copy_(_cu(lens, NCAP))
        static = _run_static(q, k, v, do, causal=causal, cu_seqlens=buf, backend="chunk")
        naive = _run(q, k, v, do, causal=causal, cu_seqlens=_cu(lens), backend="naive")
        _assert_all(f"reused buffer, layout {name}", naive, static)


@pytest.mark.parametrize("max_seqlen, bound", [(None, T), (40, 40), (1000, T)])
@pytest.mark.parametrize("causal", [True, False])
def test_static_cuda_path_is_one_varlen_call_with_a_host_bound(causal, max_seqlen, bound, monkeypatch):
    """The path CUDA half precision takes, on the CPU: the varlen kernel (here a stand-in that attends through the
    block-diagonal mask, device ops only) gets the buffer itself and a host bound -- ``max_seqlen`` clamped to
    ``T``, or ``T`` -- and nothing reads the buffer on the host."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        calls.append((cu_q, cu_k, max_q, max_k, window_size))
        return sdpa._masked_sdpa(q[None], k[None], v[None], cu_q, window_size == (-1, 0), scale)[0]

    monkeypatch.setattr(sdpa, "_varlen_ok", lambda q, k, v: True)
    monkeypatch.setattr(sdpa, "_varlen_fn", lambda: (varlen, "window"))
    q, k, v = _inputs(T, 2, 16, 16, torch.float32, seed=2)
    do = torch.randn(1, T, 2, 16)
    lens = LAYOUTS["a"]
    buf = mark_static(_cu(lens, NCAP))
    static = _run_static(q, k, v, do, causal=causal, cu_seqlens=buf, max_seqlen=max_seqlen, backend="chunk")
    assert len(calls) == 1
    cu_q, cu_k, max_q, max_k, window = calls[0]
    assert cu_q is buf and cu_k is buf
    assert (max_q, max_k) == (bound, bound)
    assert window == ((-1, 0) if causal else (-1, -1))
    naive = _run(q, k, v, do, causal=causal, cu_seqlens=_cu(lens), backend="naive")
    _assert_all("static varlen path vs naive", naive, static)


def test_max_seqlen_is_checked():
    q, k, v = _inputs(T, 1, 8, 8, torch.float32)
    lens = LAYOUTS["a"]  # longest 40
    for bad in (0, -3, True, 40.0):
        with pytest.raises(ValueError, match="max_seqlen must be a positive int"):
            softmax_attention(q, k, v, cu_seqlens=_cu(lens), max_seqlen=bad)
    with pytest.raises(ValueError, match=r"max_seqlen=39 is shorter than the longest sequence \(40\)"):
        softmax_attention(q, k, v, cu_seqlens=_cu(lens), max_seqlen=39)
    # a static buffer is checked on the device: an error here, a device-side assert on CUDA
    with pytest.raises(RuntimeError, match="longer than max_seqlen=39"):
        softmax_attention(q, k, v, cu_seqlens=mark_static(_cu(lens, NCAP)), max_seqlen=39)
    # the exact bound is accepted, and ignored without cu_seqlens
    softmax_attention(q, k, v, cu_seqlens=mark_static(_cu(lens, NCAP)), max_seqlen=40)
    softmax_attention(q, k, v, cu_seqlens=_cu(lens), max_seqlen=40)
    softmax_attention(q, k, v, max_seqlen=1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("max_seqlen", [None, 517])
@pytest.mark.parametrize("causal", [True, False])
def test_static_bf16_on_cuda_meets_the_half_rule(causal, max_seqlen):
    """The varlen FlashAttention call on a static buffer (empty documents in the middle and as padding, reused with
    new values) meets the half rule against the fp64 per-document reference, forward and every gradient, with no
    host read."""
    if sdpa._varlen_fn() is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    layouts = [[300, 0, 1, 517, 64, 141], [517, 500, 0, 6]]
    Tc, ncap = 1023, 12
    q, k, v = _inputs(Tc, 4, 64, 64, torch.float64, seed=3)
    do = torch.randn_like(v)
    dt = torch.bfloat16
    assert sdpa._varlen_ok(q.cuda().to(dt), k.cuda().to(dt), v.cuda().to(dt))
    buf = mark_static(torch.empty(ncap + 1, dtype=torch.int32, device="cuda"))
    for lens in layouts:
        buf.copy_(_cu(lens, ncap))
        ref = _run(q, k, v, do, causal=causal, cu_seqlens=_cu(lens), backend="naive")
        cuda = [x.cuda().to(dt) for x in (q, k, v, do)]
        base = _run(*cuda, causal=causal, cu_seqlens=_cu(lens, device="cuda"), backend="naive")
        out = _run_static(*cuda, causal=causal, cu_seqlens=buf, max_seqlen=max_seqlen, backend="chunk")
        for name, r, b, o in zip(("o", "dq", "dk", "dv"), ref, base, out):
            assert_half_rule(f"softmax static varlen {name}", r, o.cpu(), b.cpu())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("max_seqlen", [None, 600])
@pytest.mark.parametrize("causal", [True, False])
def test_static_step_captured_in_a_cuda_graph(causal, max_seqlen):
    """Forward and backward captured once with the static buffer (the bound's device-side check included), replayed
    with each layout copied in: each replay meets the half rule against that layout's fp64 reference."""
    if sdpa._varlen_fn() is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    layouts = [[300, 0, 1, 517, 64, 141], [517, 500, 0, 6], [600, 423]]
    Tc, ncap, dt = 1023, 12, torch.bfloat16
    q64, k64, v64 = _inputs(Tc, 4, 64, 64, torch.float64, seed=4)
    do64 = torch.randn_like(v64)
    q, k, v = (x.cuda().to(dt).requires_grad_() for x in (q64, k64, v64))
    do = do64.cuda().to(dt)
    buf = mark_static(_cu(layouts[0], ncap, device="cuda"))

    def step():
        o = softmax_attention(q, k, v, causal=causal, cu_seqlens=buf, max_seqlen=max_seqlen)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for lens in layouts:
        buf.copy_(_cu(lens, ncap))
        graph.replay()
        torch.cuda.synchronize()
        ref = _run(q64, k64, v64, do64, causal=causal, cu_seqlens=_cu(lens), backend="naive")
        base = _run(q.detach(), k.detach(), v.detach(), do, causal=causal, cu_seqlens=_cu(lens, device="cuda"),
                    backend="naive")
        for name, r, b, o in zip(("o", "dq", "dk", "dv"), ref, base, outs):
            assert_half_rule(f"softmax captured {name} ({lens})", r, o.cpu(), b.cpu())



def test_a_static_buffer_carries_its_bound_to_the_kernel(monkeypatch):
    """``mark_static(cu, max_seqlen=L)`` (the graph step passes its row length): the varlen call gets ``L`` with no
    ``max_seqlen`` at the call; a bound given at the call wins."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        calls.append(max_q)
        return sdpa._masked_sdpa(q[None], k[None], v[None], cu_q, window_size == (-1, 0), scale)[0]

    monkeypatch.setattr(sdpa, "_varlen_ok", lambda q, k, v: True)
    monkeypatch.setattr(sdpa, "_varlen_fn", lambda: (varlen, "window"))
    q, k, v = _inputs(T, 2, 16, 16, torch.float32, seed=3)
    buf = mark_static(_cu(LAYOUTS["a"], NCAP), max_seqlen=45)
    softmax_attention(q, k, v, cu_seqlens=buf, backend="chunk")
    softmax_attention(q, k, v, cu_seqlens=buf, backend="chunk", max_seqlen=50)
    assert calls == [45, 50]
