"""linear_attention's Triton path with a static ``cu_seqlens`` (:func:`lintime.ops.utils.mark_static`): a ``[Ncap +
1]`` buffer whose trailing entries repeat the total (empty sequences) and whose values change between calls without
host code seeing them (a replayed CUDA graph).  The op must plan its segments on the device at every call -- no host
read of the buffer, nothing cached on it -- and give the results of the ordinary call with the unpadded offsets, and
of each document alone: output, final states (non-causal: the sequence totals) and every gradient (q, k, v, both
parts of the initial state).

Small shapes, on the CPU through the Triton interpreter (tests/conftest.py) or compiled on a CUDA device.  ``ns``:
chunks per segment (0: one segment per sequence; 1, 2: materialised segment states, whose static plans have slack
segment rows).  Half precision: bf16 on CUDA, fp16 under the interpreter (whose ``tl.dot`` on bf16 operands gives
wrong sums).
"""

import pytest
import torch
import torch.nn.functional as F

from lintime.generation.profiling import count_host_syncs
from lintime.ops import dispatch, linear_attention
from lintime.ops.utils import is_static, mark_static
from host_reads import assert_no_host_read, refuse_plan_cache_for_static
from tolerances import HALF_FACTOR, HALF_FLOOR, assert_close, assert_exact, rel_rms

pytest.importorskip("triton")

from lintime.ops.linear.triton import triton_linear_attention  # noqa: E402  (after the importorskip)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16
LENS = [5, 0, 130, 1, 9]  # an empty document in the middle; 130 tokens: three chunks, two 2-chunk segments
NCAP = 8  # three trailing padding entries
T = sum(LENS)
PER_SEQ = ("kv", "ks", "dkv0", "dks0")  # results with one row per sequence


def _cu(lens, cap=None):
    """Offsets of ``lens`` (int32 on the device); with ``cap`` padded to ``cap + 1`` entries and marked static."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cap is None:
        return torch.tensor(cu, dtype=torch.int32, device=DEV)
    return mark_static(torch.tensor(cu + [cu[-1]] * (cap - len(lens)), dtype=torch.int32, device=DEV))


def _inputs(H, K, V, dtype=torch.float32, seed=0):
    """Positive q, k (``elu + 1``: the normaliser is > 0) and v ``[1, T, H, *]``, an initial state of ``NCAP``
    sequences (the sums of a few positive-key tokens), and the loss weights of the output and of the final states;
    fp64 draws cast to ``dtype`` (states fp32)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.elu(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)) + 1 for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    k0 = F.elu(torch.randn(NCAP, 5, H, K, generator=gen, dtype=torch.float64)) + 1
    v0 = torch.randn(NCAP, 5, H, V, generator=gen, dtype=torch.float64)
    state = (torch.einsum("nthk,nthv->nhkv", k0, v0), k0.sum(1))
    w = {"o": torch.randn(1, T, H, V, generator=gen, dtype=torch.float64),
         "kv": torch.randn(NCAP, H, K, V, generator=gen, dtype=torch.float64),
         "ks": torch.randn(NCAP, H, K, generator=gen, dtype=torch.float64)}
    return ([x.to(DEV, dtype) for x in (q, k, v)], tuple(s.to(DEV, torch.float32) for s in state),
            {name: x.to(DEV) for name, x in w.items()})


def _run(xs, state, w, cu, ns=None, *, causal, normalize, backend="triton"):
    """Output, final states and the gradients of a fixed projection of both (q, k, v and, when given, the initial
    state's parts) of one call; ``ns`` is passed to the Triton entry, ``None`` goes through the public op.
    ``state``: ``(kv, k_sum)``, its first part alone without the normaliser."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    parts = () if state is None else tuple(s.detach().clone().requires_grad_() for s in state[: 1 + normalize])
    kw = dict(causal=causal, normalize=normalize, output_final_state=True, cu_seqlens=cu,
              initial_state=None if state is None else (parts if normalize else parts[0]))
    if ns is None:
        o, fin = linear_attention(*leaves, backend=backend, **kw)
    else:
        o, fin = triton_linear_attention(*leaves, segment_chunks=ns, **kw)
    out = {"o": o, **dict(zip(("kv", "ks"), fin if normalize else (fin,)))}
    loss = sum((x.double() * w[name][: x.shape[0]]).sum() for name, x in out.items())
    grads = torch.autograd.grad(loss, [*leaves, *parts])
    out.update(zip(("dq", "dk", "dv", "dkv0", "dks0"), grads))
    return out


def _per_document(xs, state, w, lens, *, causal, normalize, backend="naive"):
    """:func:`_run`'s results with every document its own call (no ``cu_seqlens``), assembled in token / document
    order; an empty document's final state is its initial state (causal) or zero (the total of nothing), and the
    initial state's gradient then is the final state's loss weight."""
    parts, t = {}, 0
    for n, L in enumerate(lens):
        st = None if state is None else tuple(s[n : n + 1] for s in state)
        if L == 0:
            empty = {"kv": torch.zeros_like(w["kv"][:1], dtype=torch.float32)}
            if normalize:
                empty["ks"] = torch.zeros_like(w["ks"][:1], dtype=torch.float32)
            if st is not None:
                empty.update(kv=st[0], dkv0=w["kv"][n : n + 1].float())
                if normalize:
                    empty.update(ks=st[1], dks0=w["ks"][n : n + 1].float())
            for name, x in empty.items():
                parts.setdefault(name, []).append(x)
            continue
        sl = slice(t, t + L)
        wn = {"o": w["o"][:, sl], "kv": w["kv"][n : n + 1], "ks": w["ks"][n : n + 1]}
        out = _run([x[:, sl] for x in xs], st, wn, None, causal=causal, normalize=normalize, backend=backend)
        for name, x in out.items():
            parts.setdefault(name, []).append(x)
        t += L
    return {name: torch.cat(p, 0 if name in PER_SEQ else 1) for name, p in parts.items()}


def _real(out, n):
    """``out`` with the per-sequence results cut to ``n`` sequences (the documents before the padding)."""
    return {k: v[:n] if k in PER_SEQ else v for k, v in out.items()}


def _assert_all(tag, ref, out, check=assert_exact):
    assert sorted(ref) == sorted(out), (sorted(ref), sorted(out))
    for name in ref:
        assert out[name].dtype == ref[name].dtype, f"{tag} {name}: dtype {out[name].dtype} != {ref[name].dtype}"
        check(f"{tag} {name}", ref[name], out[name])


def _check_padding(static, state, w, causal):
    """The padding sequences (empty) keep their initial state (causal) or total nothing, and the initial state's
    gradient is the final state's loss weight."""
    n = len(LENS)
    for i, name in enumerate(("kv", "ks")):
        if name not in static:
            continue
        pad = static[name][n:]
        assert torch.equal(pad, state[i][n:] if (causal and state is not None) else torch.zeros_like(pad)), name
        if f"d{name}0" in static:
            assert torch.equal(static[f"d{name}0"][n:], w[name][n:].float()), f"d{name}0"


# ``None``: the public op, whose automatic segment length at these shapes is one segment per sequence (asserted in
# the test), so (True, True, None) also runs the ``ns = 0`` kernels causal and normalised
CASES = [(True, False, 1), (True, True, 2), (True, True, None), (False, True, 0), (False, True, 2), (False, False, 1)]


@pytest.mark.parametrize("causal, normalize, ns", CASES)
def test_static_equals_dynamic_and_per_document_fp32(causal, normalize, ns, monkeypatch):
    """fp32: static padded offsets == the unpadded offsets (same kernels) == each document alone through the naive
    form (exact tolerance), forward, final states and every gradient.  The static call (forward with the final states,
    backward with the initial state's gradients) makes no host sync of any kind and builds no tensor from host data
    (:func:`lintime.generation.profiling.count_host_syncs`), and never consults the per-tensor plan cache."""
    from lintime.ops.linear.triton.ops import segment_chunks_for

    refuse_plan_cache_for_static(monkeypatch)
    xs, state, w = _inputs(2, 16, 16)
    state = state if causal else None
    kw = dict(causal=causal, normalize=normalize)
    cu = _cu(LENS, NCAP)
    if ns is None:
        assert segment_chunks_for(xs[0], xs[2], cu) == 0  # one segment per sequence
    with count_host_syncs() as c:
        static = _run(xs, state, w, cu, ns, **kw)
    assert_no_host_read(c)
    dynamic = _run(xs, None if state is None else tuple(s[: len(LENS)] for s in state), w, _cu(LENS), ns, **kw)
    alone = _per_document(xs, state, w, LENS, **kw)
    _check_padding(static, state, w, causal)
    tag = f"causal={causal} normalize={normalize} ns={ns}"
    _assert_all(f"static vs dynamic ({tag})", dynamic, _real(static, len(LENS)))
    _assert_all(f"static vs per document ({tag})", alone, _real(static, len(LENS)))


@pytest.mark.parametrize("causal, ns", [(True, 0), (True, 2), (False, 1)])
def test_static_half(causal, ns):
    """Half precision: static == unpadded offsets (the same arithmetic), and each document alone through the fp64
    naive form by the half-precision rule (base: the naive form in the half dtype; the fp32 final states and
    initial-state gradients under the half dtype's floor too: their only error source is the half inputs)."""
    xs64, state, w = _inputs(1, 16, 16, torch.float64, seed=1)
    xs = [x.to(HALF) for x in xs64]
    state = state if causal else None
    kw = dict(causal=causal, normalize=True)
    static = _run(xs, state, w, _cu(LENS, NCAP), ns, **kw)
    dynamic = _run(xs, None if state is None else tuple(s[: len(LENS)] for s in state), w, _cu(LENS), ns, **kw)
    assert static["o"].dtype == HALF
    _check_padding(static, state, w, causal)
    static = _real(static, len(LENS))
    _assert_all(f"{HALF} static vs dynamic", dynamic, static)
    ref64 = _per_document(xs64, None if state is None else tuple(s.double() for s in state), w, LENS, **kw)
    base = _per_document(xs, state, w, LENS, **kw)
    for name in ref64:
        assert_close(f"{HALF} static {name}", ref64[name], static[name],
                     HALF_FACTOR * rel_rms(ref64[name], base[name]) + HALF_FLOOR[HALF])


@pytest.mark.parametrize("causal, ns", [(True, None), (True, 2), (False, 1)])
def test_one_buffer_two_layouts(causal, ns):
    """Two document layouts through the same static buffer, its values rewritten between calls without a version
    bump (as a replayed CUDA graph's copy: no host code sees it): every call equals the ordinary call with its own
    offsets, so no plan built for the earlier values is reused."""
    layouts = [LENS, [70, 2, 0, 0, 73], LENS]
    assert all(sum(lens) == T for lens in layouts)
    xs, state, w = _inputs(1, 16, 16, seed=2)
    state = state if causal else None
    kw = dict(causal=causal, normalize=True)
    dynamic = [_run(xs, None if state is None else tuple(s[: len(lens)] for s in state), w, _cu(lens), ns, **kw)
               for lens in layouts[:2]]
    dynamic.append(dynamic[0])  # the third layout is the first
    cu = _cu(layouts[0], NCAP)
    static = []
    for lens in layouts:  # one static call after another: nothing in between would flush a cache kept on `cu`
        cu.data.copy_(_cu(lens, NCAP))  # .data: the tensor's version counter stays as it was
        static.append(_run(xs, state, w, cu, ns, **kw))
    assert is_static(cu)
    for lens, d, st in zip(layouts, dynamic, static, strict=True):
        _assert_all(f"layout {lens} (causal={causal}, ns={ns})", d, _real(st, len(lens)))


def test_no_host_read(monkeypatch):
    """The one static call of the tests above not already made there: causal and normalised with 1-chunk segments
    and an initial state (both parts' gradients included) -- no host sync, no host-built tensor, no plan cache (the
    other cases: in :func:`test_static_equals_dynamic_and_per_document_fp32`)."""
    refuse_plan_cache_for_static(monkeypatch)
    xs, state, _ = _inputs(2, 16, 16, seed=3)
    leaves = [x.requires_grad_() for x in xs]
    parts = tuple(s.requires_grad_() for s in state)
    cu = _cu(LENS, NCAP)
    kw = dict(causal=True, output_final_state=True, cu_seqlens=cu, initial_state=parts)
    with count_host_syncs() as fwd:
        o, (kv, ks) = triton_linear_attention(*leaves, segment_chunks=1, **kw)
    with count_host_syncs() as bwd:
        torch.autograd.grad(o.sum() + kv.sum() + ks.sum(), [*leaves, *parts])
    assert_no_host_read(fwd)
    assert_no_host_read(bwd)


def test_forward_only_short_call():
    """A forward-only causal call of at most 16 tokens (the recurrent kernel, which reads the offsets on the device)
    with a static buffer: the ordinary call's output and final states, no host read."""
    lens = [3, 0, 9, 2]
    xs, state, _ = _inputs(1, 16, 16, seed=5)
    xs = [x[:, : sum(lens)] for x in xs]
    cu = _cu(lens, NCAP)
    with torch.no_grad():
        with count_host_syncs() as c:
            o, (kv, ks) = linear_attention(*xs, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                           backend="triton")
        ref_o, (ref_kv, ref_ks) = linear_attention(*xs, initial_state=tuple(s[: len(lens)] for s in state),
                                                   output_final_state=True, cu_seqlens=_cu(lens), backend="triton")
    assert c.total == 0, dict(c.counts)
    assert_exact("short static o", ref_o, o)
    assert_exact("short static kv", ref_kv, kv[: len(lens)])
    assert_exact("short static k_sum", ref_ks, ks[: len(lens)])
    assert torch.equal(kv[len(lens):], state[0][len(lens):]) and torch.equal(ks[len(lens):], state[1][len(lens):])


@pytest.mark.parametrize("causal", [True, False])
def test_layer_with_a_static_buffer(causal, monkeypatch):
    """:class:`~lintime.layers.linear_attention.LinearAttention` on the Triton path (forced on the CPU: the
    interpreter) with a static buffer: the output and the gradients of the input and of every parameter equal the
    ordinary call's, with no host read; the layer says so (``static_packing``), and heads wider than the automatic
    choice sends to the kernels (the chunked form, which reads the offsets) say they cannot."""
    from lintime.layers.linear_attention import LinearAttention

    assert not LinearAttention(256, 2).static_packing()  # head_dim 128
    monkeypatch.setattr(dispatch, "triton_available", lambda device: True)
    torch.manual_seed(6)
    layer = LinearAttention(32, 2, causal=causal).to(DEV)  # two heads of 16
    assert layer.static_packing()
    x = torch.randn(1, T, 32, device=DEV)
    dy = torch.randn(1, T, 32, device=DEV)

    def run(cu):
        xl = x.clone().requires_grad_()
        y, _ = layer(xl, positions=None, cu_seqlens=cu)
        grads = torch.autograd.grad((y * dy).sum(), [xl, *layer.parameters()])
        return y, grads

    cu = _cu(LENS, NCAP)
    with count_host_syncs() as c:
        y_static, g_static = run(cu)
    assert (c.total, c.h2d) == (0, 0), f"host syncs {dict(c.counts)}, host->device tensors {c.h2d}"
    y_dyn, g_dyn = run(_cu(LENS))
    assert_exact("layer output", y_dyn, y_static)
    names = ["x", *(n for n, _ in layer.named_parameters())]
    for name, a, b in zip(names, g_dyn, g_static, strict=True):
        assert_exact(f"layer d{name}", a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal, ns", [(True, None), (True, 2), (False, 2)])
def test_static_step_captured_in_a_cuda_graph(causal, ns):
    """Forward and backward (bf16; causal: with an initial state) captured once with the static buffer and replayed
    with each layout copied in: every replay equals the eager call with that layout's unpadded offsets (the same
    kernels)."""
    layouts = [[300, 0, 1, 517, 64, 141], [517, 500, 0, 6], [600, 423]]
    Tc, ncap, H, K, V = 1023, 12, 4, 64, 64
    gen = torch.Generator().manual_seed(7)
    q, k = (F.elu(torch.randn(1, Tc, H, K, generator=gen)) + 1 for _ in range(2))
    v = torch.randn(1, Tc, H, V, generator=gen)
    q, k, v = (x.cuda().to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    kv0 = torch.rand(ncap, H, K, V, generator=gen).cuda().requires_grad_()
    ks0 = (torch.rand(ncap, H, K, generator=gen) + 1).cuda().requires_grad_()
    do = torch.randn(1, Tc, H, V, generator=gen).cuda().to(torch.bfloat16)
    dkv, dks = torch.randn(ncap, H, K, V, generator=gen).cuda(), torch.randn(ncap, H, K, generator=gen).cuda()
    wrt = (q, k, v, kv0, ks0) if causal else (q, k, v)

    def step(cu, n):
        o, (kv, ks) = triton_linear_attention(q, k, v, causal=causal, initial_state=(kv0[:n], ks0[:n]) if causal
                                              else None, output_final_state=True, cu_seqlens=cu, segment_chunks=ns)
        loss = (o.float() * do.float()).sum() + (kv * dkv[:n]).sum() + (ks * dks[:n]).sum()
        grads = torch.autograd.grad(loss, wrt)
        return dict(zip(("o", "kv", "ks", "dq", "dk", "dv", "dkv0", "dks0"), (o, kv, ks, *grads)))

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
        n = len(lens)
        _assert_all(f"captured step {lens} (causal={causal}, ns={ns})", _real(step(_cu(lens), n), n), _real(outs, n))
