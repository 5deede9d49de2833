"""gated_linear_attention's Triton path with a static ``cu_seqlens`` (:func:`lintime.ops.utils.mark_static`): a
``[Ncap + 1]`` buffer whose trailing entries repeat the total (empty sequences) and whose values change between
calls without host code seeing them (a replayed CUDA graph).  The op must plan its segments on the device at every
call -- no host read of the buffer, nothing cached on it -- and give the results of the ordinary call with the
unpadded offsets, and of each document alone: output, final states and every gradient (q, k, v, the gates, the
initial state).

Small shapes, on the CPU through the Triton interpreter (tests/conftest.py) or compiled on a CUDA device.  ``ns``:
chunks per segment (0: one segment per sequence; 1, 2: materialised segment states, whose static plans have slack
segment rows, and chunk tables with slack chunk rows).  Half precision: bf16 on CUDA, fp16 under the interpreter
(whose ``tl.dot`` on bf16 operands gives wrong sums).
"""

import pytest
import torch
import torch.nn.functional as F

from lintime.generation.profiling import count_host_syncs
from lintime.ops import dispatch, gated_linear_attention
from lintime.ops.utils import is_static, mark_static
from host_reads import assert_no_host_read, refuse_plan_cache_for_static
from tolerances import HALF_FACTOR, HALF_FLOOR, assert_close, assert_exact, rel_rms

pytest.importorskip("triton")

from lintime.ops.gla.triton import triton_gla  # noqa: E402  (after the importorskip)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16
LENS = [5, 0, 130, 1, 9]  # an empty document in the middle; 130 tokens: three chunks, two 2-chunk segments
NCAP = 8  # three trailing padding entries
T = sum(LENS)
LAYER_LENS = [5, 0, 70, 1, 9]  # the layer test's: 70 tokens, two chunks (a partial one)
NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dh0")


def _cu(lens, cap=None):
    """Offsets of ``lens`` (int32 on the device); with ``cap`` padded to ``cap + 1`` entries and marked static."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cap is None:
        return torch.tensor(cu, dtype=torch.int32, device=DEV)
    return mark_static(torch.tensor(cu + [cu[-1]] * (cap - len(lens)), dtype=torch.int32, device=DEV))


def _inputs(H, K, V, dtype=torch.float32, seed=0):
    """q, k, v, g ``[1, T, H, *]`` (gates ``logsigmoid(x + 2) / 4``), an initial state of ``NCAP`` sequences and the
    weights of the loss (output ``do``, final states ``dfinal``), fp64 draws cast to ``dtype`` (states fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, g = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(3))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(g + 2) / 4
    h0, dfinal = (torch.randn(NCAP, H, K, V, generator=gen, dtype=torch.float64) for _ in range(2))
    do = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    xs = [x.to(DEV, dtype) for x in (q, k, v, g)]
    return xs, h0.to(DEV, torch.float32), do.to(DEV, dtype), dfinal.to(DEV, torch.float32)


def _run(xs, h0, do, dfinal, cu, ns=None, backend="triton"):
    """Output, final states and the gradients of ``<o, do> + <final, dfinal>`` (q, k, v, g and, when given, the
    initial state) of one call; ``ns`` is passed to the Triton entry, ``None`` goes through the public op."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    h = None if h0 is None else h0.detach().clone().requires_grad_()
    kw = dict(initial_state=h, output_final_state=True, cu_seqlens=cu)
    if ns is None:
        o, final = gated_linear_attention(*leaves, backend=backend, **kw)
    else:
        o, final = triton_gla(*leaves, segment_chunks=ns, **kw)
    inputs = leaves + ([h] if h is not None else [])
    loss = (o.double() * do.double()).sum() + (final.double() * dfinal[: final.shape[0]].double()).sum()
    grads = torch.autograd.grad(loss, inputs)
    return dict(zip(NAMES, (o, final, *grads)))


def _per_document(xs, h0, do, dfinal, lens, backend="naive"):
    """:func:`_run`'s results with every document its own call (no ``cu_seqlens``), assembled in token / document
    order; an empty document's final state is its initial state, whose gradient is then ``dfinal``."""
    parts = {name: [] for name in NAMES}
    t = 0
    for n, L in enumerate(lens):
        h = None if h0 is None else h0[n : n + 1]
        if L == 0:
            parts["final"].append(torch.zeros_like(dfinal[:1]) if h is None else h)
            if h is not None:
                parts["dh0"].append(dfinal[n : n + 1])
            continue
        sl = slice(t, t + L)
        out = _run([x[:, sl] for x in xs], h, do[:, sl], dfinal[n : n + 1], None, backend=backend)
        for name in NAMES:
            if name in out:
                parts[name].append(out[name])
        t += L
    return {name: torch.cat(p, 0 if name in ("final", "dh0") else 1) for name, p in parts.items() if p}


def _real(out, n):
    """``out`` with the per-sequence results (final states, initial-state gradients) cut to ``n`` sequences."""
    return {k: v[:n] if k in ("final", "dh0") else v for k, v in out.items()}


def _assert_all(tag, ref, out, check=assert_exact):
    assert sorted(ref) == sorted(out), (sorted(ref), sorted(out))
    for name in ref:
        assert out[name].dtype == ref[name].dtype, f"{tag} {name}: dtype {out[name].dtype} != {ref[name].dtype}"
        check(f"{tag} {name}", ref[name], out[name])


def _check_padding(static, h0, dfinal):
    """The padding sequences (empty) keep their initial state, whose gradient is their final state's."""
    n = len(LENS)
    assert torch.equal(static["final"][n:], h0[n:] if h0 is not None else torch.zeros_like(dfinal[n:]))
    if "dh0" in static:
        assert torch.equal(static["dh0"][n:], dfinal[n:])


# ``None``: the public op, whose automatic segment length at these shapes is one segment per sequence (asserted
# below), so it also runs the ``ns = 0`` kernels; 1, 2: materialised segments through the Triton entry
@pytest.mark.parametrize("ns, with_h0", [(1, False), (2, True), (None, True)])
def test_static_equals_dynamic_and_per_document_fp32(ns, with_h0, monkeypatch):
    """fp32: static padded offsets == the unpadded offsets (same kernels) == each document alone through the naive
    recurrence (exact tolerance), forward, final states and every gradient.  The static call (forward with the final
    state, backward with the initial state's gradient) makes no host sync of any kind and builds no tensor from host
    data (:func:`lintime.generation.profiling.count_host_syncs`), and never consults the per-tensor plan cache."""
    from lintime.ops.gla.triton.ops import segment_chunks_for

    refuse_plan_cache_for_static(monkeypatch)
    xs, h0, do, dfinal = _inputs(2, 16, 16)
    if ns is None:
        assert segment_chunks_for(xs[0], xs[2], _cu(LENS, NCAP)) == 0  # one segment per sequence
    h0 = h0 if with_h0 else None
    cu = _cu(LENS, NCAP)
    with count_host_syncs() as c:
        static = _run(xs, h0, do, dfinal, cu, ns)
    assert_no_host_read(c)
    dynamic = _run(xs, None if h0 is None else h0[: len(LENS)], do, dfinal, _cu(LENS), ns)
    alone = _per_document(xs, h0, do, dfinal, LENS)
    _check_padding(static, h0, dfinal)
    _assert_all(f"static vs dynamic (ns={ns})", dynamic, _real(static, len(LENS)))
    _assert_all(f"static vs per document (ns={ns})", alone, _real(static, len(LENS)))


@pytest.mark.parametrize("ns", [0, 2])
def test_static_half(ns):
    """Half precision: static == unpadded offsets (the same arithmetic), and each document alone through the fp64
    recurrence by the half-precision rule (base: the naive recurrence in the half dtype)."""
    xs64, h0, do64, dfinal = _inputs(1, 16, 16, torch.float64, seed=1)
    xs, do = [x.to(HALF) for x in xs64], do64.to(HALF)
    static = _run(xs, h0, do, dfinal, _cu(LENS, NCAP), ns)
    dynamic = _run(xs, h0[: len(LENS)], do, dfinal, _cu(LENS), ns)
    assert static["o"].dtype == HALF
    _check_padding(static, h0, dfinal)
    static = _real(static, len(LENS))
    _assert_all(f"{HALF} static vs dynamic", dynamic, static)
    ref64 = _per_document(xs64, h0.double(), do64, dfinal.double(), LENS)
    base = _per_document(xs, h0, do, dfinal, LENS)
    for name in NAMES:  # final states and their gradients are fp32: the half dtype's floor for all
        assert_close(f"{HALF} static {name}", ref64[name], static[name],
                     HALF_FACTOR * rel_rms(ref64[name], base[name]) + HALF_FLOOR[HALF])


@pytest.mark.parametrize("ns", [None, 1])  # the public op (here one segment per sequence), materialised segments
def test_one_buffer_two_layouts(ns):
    """Two document layouts through the same static buffer, its values rewritten between calls without a version
    bump (as a replayed CUDA graph's copy: no host code sees it): every call equals the ordinary call with its own
    offsets, so no plan built for the earlier values is reused."""
    layouts = [LENS, [70, 2, 0, 0, 73], LENS]
    assert all(sum(lens) == T for lens in layouts)
    xs, h0, do, dfinal = _inputs(1, 16, 16, seed=2)
    # the ordinary calls: one per distinct layout (the third is the first again)
    dynamic = [_run(xs, h0[: len(lens)], do, dfinal, _cu(lens), ns) for lens in layouts[:2]]
    dynamic.append(dynamic[0])
    cu = _cu(layouts[0], NCAP)
    static = []
    for lens in layouts:  # one static call after another: nothing in between would flush a cache kept on `cu`
        cu.data.copy_(_cu(lens, NCAP))  # .data: the tensor's version counter stays as it was
        static.append(_run(xs, h0, do, dfinal, cu, ns))
    assert is_static(cu)
    for lens, d, st in zip(layouts, dynamic, static, strict=True):
        _assert_all(f"layout {lens} (ns={ns})", d, _real(st, len(lens)))


def test_no_host_read(monkeypatch):
    """The one static call of the tests above not already made there: 1-chunk segments with an initial state (its
    gradient included) -- no host sync, no host-built tensor, no plan cache (the other segment lengths: in
    :func:`test_static_equals_dynamic_and_per_document_fp32`)."""
    refuse_plan_cache_for_static(monkeypatch)
    xs, h0, _, _ = _inputs(2, 16, 16, seed=3)
    leaves = [x.requires_grad_() for x in (*xs, h0)]
    cu = _cu(LENS, NCAP)
    kw = dict(initial_state=leaves[4], output_final_state=True, cu_seqlens=cu)
    with count_host_syncs() as fwd:
        o, final = triton_gla(*leaves[:4], segment_chunks=1, **kw)
    with count_host_syncs() as bwd:
        torch.autograd.grad(o.sum() + final.sum(), leaves)
    assert_no_host_read(fwd)
    assert_no_host_read(bwd)


@pytest.mark.parametrize("K, V", [(8, 16), (16, 8)])
def test_narrow_heads_are_padded_not_sent_to_the_chunked_form(K, V):
    """Heads narrower than the kernels' 16-wide tiles (gla-tiny: K = 8) go to the chunked PyTorch form with an
    ordinary ``cu_seqlens``, which reads it on the host; a static one is zero-padded to 16 for the Triton path
    instead: the same results as the ordinary call and as each document alone, and no host read."""
    xs, h0, do, dfinal = _inputs(2, K, V, seed=4)
    cu = _cu(LENS, NCAP)
    with count_host_syncs() as c:
        static = _run(xs, h0, do, dfinal, cu)
    assert (c.total, c.h2d) == (0, 0), f"host syncs {dict(c.counts)}, host->device tensors {c.h2d}"
    dynamic = _run(xs, h0[: len(LENS)], do, dfinal, _cu(LENS))
    alone = _per_document(xs, h0, do, dfinal, LENS)
    assert static["final"].shape == (NCAP, 2, K, V) and static["o"].shape == (1, T, 2, V)
    _check_padding(static, h0, dfinal)
    _assert_all("narrow static vs dynamic (chunked)", dynamic, _real(static, len(LENS)))
    _assert_all("narrow static vs per document", alone, _real(static, len(LENS)))


def test_forward_only_short_call():
    """A forward-only call of at most 16 tokens (the recurrent kernel, which reads the offsets on the device) with a
    static buffer: the ordinary call's output and final states, no host read."""
    lens = [3, 0, 9, 2]
    xs, h0, _, _ = _inputs(1, 16, 16, seed=5)
    xs = [x[:, : sum(lens)] for x in xs]
    cu = _cu(lens, NCAP)
    with torch.no_grad():
        with count_host_syncs() as c:
            o, final = gated_linear_attention(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                              backend="triton")
        ref_o, ref_final = gated_linear_attention(*xs, initial_state=h0[: len(lens)], output_final_state=True,
                                                  cu_seqlens=_cu(lens), backend="triton")
    assert c.total == 0, dict(c.counts)
    assert_exact("short static o", ref_o, o)
    assert_exact("short static final", ref_final, final[: len(lens)])
    assert torch.equal(final[len(lens):], h0[len(lens):])


@pytest.mark.parametrize("n_heads", [1, 2], ids=["K16", "K8"])
def test_layer_with_a_static_buffer(n_heads, monkeypatch):
    """:class:`~lintime.layers.gla.GatedLinearAttention` on the Triton path (forced on the CPU: the interpreter) with
    a static buffer: the output and the gradients of the input and of every parameter equal the ordinary call's, with
    no host read; the layer says so (``static_packing``).  ``K8``: gla-tiny's heads (padded on the static path, the
    chunked form on the ordinary one), two of them.  The layer's documents: :data:`LAYER_LENS` (the op's
    segments and long documents are the tests above'; its gated norm walks one row at a time under the
    interpreter)."""
    from lintime.layers.gla import GatedLinearAttention

    monkeypatch.setattr(dispatch, "triton_available", lambda device: True)
    torch.manual_seed(6)
    layer = GatedLinearAttention(32, n_heads).to(DEV)
    assert layer.static_packing()
    T = sum(LAYER_LENS)
    x = torch.randn(1, T, 32, device=DEV)
    dy = torch.randn(1, T, 32, device=DEV)

    def run(cu):
        xl = x.clone().requires_grad_()
        y, _ = layer(xl, positions=None, cu_seqlens=cu)
        grads = torch.autograd.grad((y * dy).sum(), [xl, *layer.parameters()])
        return y, grads

    cu = _cu(LAYER_LENS, NCAP)
    with count_host_syncs() as c:
        y_static, g_static = run(cu)
    assert (c.total, c.h2d) == (0, 0), f"host syncs {dict(c.counts)}, host->device tensors {c.h2d}"
    y_dyn, g_dyn = run(_cu(LAYER_LENS))
    assert_exact("layer output", y_dyn, y_static)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, g_dyn, g_static, strict=True):
        assert_exact(f"layer d{name}", a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("ns", [None, 2])
def test_static_step_captured_in_a_cuda_graph(ns):
    """Forward and backward (bf16, initial state) captured once with the static buffer and replayed with each layout
    copied in: every replay equals the eager call with that layout's unpadded offsets (the same kernels)."""
    layouts = [[300, 0, 1, 517, 64, 141], [517, 500, 0, 6], [600, 423]]
    Tc, ncap, H, K, V = 1023, 12, 4, 64, 64
    gen = torch.Generator().manual_seed(7)
    q, k, v, g = (torch.randn(1, Tc, H, D, generator=gen) for D in (K, K, V, K))
    q, k, v = (x.cuda().to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    g = (F.logsigmoid(g + 2) / 4).cuda().requires_grad_()
    h0 = torch.randn(ncap, H, K, V, generator=gen).cuda().requires_grad_()
    do = torch.randn(1, Tc, H, V, generator=gen).cuda().to(torch.bfloat16)
    dfinal = torch.randn(ncap, H, K, V, generator=gen).cuda()

    def step(cu, n):
        o, final = triton_gla(q, k, v, g, initial_state=h0[:n], output_final_state=True, cu_seqlens=cu,
                              segment_chunks=ns)
        loss = (o.float() * do.float()).sum() + (final * dfinal[:n]).sum()
        return dict(zip(NAMES, (o, final, *torch.autograd.grad(loss, (q, k, v, g, h0)))))

    buf = _cu(layouts[0], ncap)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(buf, ncap)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(buf, ncap)
    for lens in layouts:
        buf.copy_(_cu(lens, ncap))
        graph.replay()
        torch.cuda.synchronize()
        ref = step(_cu(lens), len(lens))
        n = len(lens)
        got = {name: x[:n] if name == "final" else x for name, x in outs.items()}
        ref["dh0"], got["dh0"] = ref["dh0"][:n], got["dh0"][:n]
        _assert_all(f"captured step {lens} (ns={ns})", ref, got)
