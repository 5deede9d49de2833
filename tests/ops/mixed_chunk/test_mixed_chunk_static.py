"""mixed_chunk_attention's Triton path with a static ``cu_seqlens`` (:func:`lintime.ops.utils.mark_static`): a
``[Ncap + 1]`` buffer whose trailing entries repeat the total (empty sequences) and whose values change between
calls without host code seeing them (a replayed CUDA graph).  The op must build its plan on the device from the
buffer at every call -- no host read of it, nothing cached on it -- and give the numbers of the ordinary call with the
unpadded offsets, and of each document alone: forward, final state and every gradient.

Small shapes, on the CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py without
CUDA) or compiled on a CUDA device.  ``segments``: the state walk cuts sequences into 2-chunk segments, so the static
plan's slack segment rows meet the start fix-up; ``one``: one segment per sequence (the walk from the initial state).
Half precision: bf16 on CUDA, fp16 under the interpreter (whose ``tl.dot`` on bf16 operands gives wrong sums).
"""

import dataclasses

import pytest
import torch

from lintime.generation.profiling import count_host_syncs
from lintime.ops import MixedChunkState, mixed_chunk_attention
from lintime.ops.utils import segments
from lintime.ops.mixed_chunk.triton import launchers, plan
from lintime.ops.mixed_chunk.triton import mixed_chunk as mc_entry
from lintime.ops.mixed_chunk.triton.launch import default_launch
from lintime.ops.utils import is_static, mark_static
from tolerances import assert_exact, assert_half_rule

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEV == "cuda" else torch.float16

C, H, S, E = 16, 1, 16, 16  # one tile each way: the static plans are the point (the tiles: the Triton tests)
LENS = [23, 0, 40, 1, 16]  # an empty document in the middle, short last chunks, a one-token and a one-chunk one
NCAP = 8  # three trailing padding entries
INPUTS = ("q_quad", "k_quad", "q_lin", "k_lin", "v")
FLOAT_FIELDS = ("kv", "k_quad", "k_lin", "v")
INT_FIELDS = ("count", "fill")


def _cu(lens, cap=None):
    """Offsets of ``lens`` (int32); with ``cap`` padded to ``cap + 1`` entries and marked static."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if cap is None:
        return torch.tensor(cu, dtype=torch.int32, device=DEV)
    return mark_static(torch.tensor(cu + [cu[-1]] * (cap - len(lens)), dtype=torch.int32, device=DEV))


def _inputs(T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, T, H, S, generator=g, dtype=torch.float64) * 0.5 for _ in range(4)]
    xs.append(torch.randn(1, T, H, E, generator=g, dtype=torch.float64))
    rb = 0.5 * torch.randn(H, 2 * C - 1, generator=g, dtype=torch.float64)
    return [x.to(DEV, dtype) for x in xs], rb.to(DEV, dtype)


def _loss_weights(T, seed=5):
    """Fixed random weights of every output element and of ``NCAP`` final states' float fields (fp64)."""
    g = torch.Generator().manual_seed(seed)
    w = {"o": torch.randn(1, T, H, E, generator=g, dtype=torch.float64)}
    shapes = {"kv": (NCAP, H, S, E), "k_quad": (NCAP, C, H, S), "k_lin": (NCAP, C, H, S), "v": (NCAP, C, H, E)}
    w.update({f: torch.randn(*s, generator=g, dtype=torch.float64) for f, s in shapes.items()})
    return {k: x.to(DEV) for k, x in w.items()}


def _run(xs, rb, wts, *, cu=None, backend="triton", launch=None, state=None, **kw):
    """Output, final state (its first ``cu`` sequences) and every gradient of one call, named; the loss weights the
    output and every float field of every final state (a static call's padding states too)."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    rb = rb.detach().clone().requires_grad_()
    if launch is None:
        o, final = mixed_chunk_attention(*xs, rel_bias=rb, cu_seqlens=cu, backend=backend, initial_state=state, **kw)
    else:
        o, final = mc_entry.triton_mixed_chunk_attention(*xs, rel_bias=rb, cu_seqlens=cu, launch=launch,
                                                         initial_state=state, **kw)
    out = {"o": o}
    loss = (o.double() * wts["o"]).sum()
    if final is not None:
        for f in FLOAT_FIELDS:
            x = getattr(final, f)
            loss = loss + (x.double() * wts[f][: x.shape[0]]).sum()
        out.update({f"final.{f}": getattr(final, f) for f in FLOAT_FIELDS + INT_FIELDS})
    grads = torch.autograd.grad(loss, [*xs, rb])
    out.update({f"d{n}": gr for n, gr in zip((*INPUTS, "rel_bias"), grads, strict=True)})
    return out


def _per_document(xs, rb, wts, lens, backend, **kw):
    """:func:`_run`'s results with every document its own call (no ``cu_seqlens``), assembled: outputs and gradients
    in token order, final states in document order (an empty document's: the zero state)."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    rbl = rb.detach().clone().requires_grad_()
    causal = kw.get("causal", True)
    os_, finals, loss, t = [], [], 0.0, 0
    for n, L in enumerate(lens):
        if L == 0:
            dt = xs[0].dtype
            finals.append(MixedChunkState.zeros(1, C, H, S, E, dtype=dt, device=xs[0].device))
            continue
        o, fin = mixed_chunk_attention(*[x[:, t:t + L] for x in leaves], rel_bias=rbl, backend=backend, **kw)
        os_.append(o)
        loss = loss + (o.double() * wts["o"][:, t:t + L]).sum()
        if causal:
            for f in FLOAT_FIELDS:
                loss = loss + (getattr(fin, f).double() * wts[f][n:n + 1]).sum()
            finals.append(fin)
        t += L
    o = torch.cat(os_, 1)
    out = {"o": o}
    if causal:
        out.update({f"final.{f}": torch.cat([getattr(s, f) for s in finals]) for f in FLOAT_FIELDS + INT_FIELDS})
    grads = torch.autograd.grad(loss, [*leaves, rbl])
    out.update({f"d{n}": gr for n, gr in zip((*INPUTS, "rel_bias"), grads, strict=True)})
    return out


def _real(out, n):
    """``out`` with the final states cut to the first ``n`` sequences (the documents before the padding)."""
    return {k: v[:n] if k.startswith("final.") else v for k, v in out.items()}


def _check_padding(out, n):
    """The padding sequences' final states are the zero state (nothing walked, nothing buffered)."""
    for f in FLOAT_FIELDS + INT_FIELDS:
        pad = out[f"final.{f}"][n:]
        assert pad.shape[0] == NCAP - n and not pad.any(), f"padding final.{f} is not zero"


def _assert_all(tag, ref, out, check):
    assert sorted(ref) == sorted(out), (sorted(ref), sorted(out))
    for name in ref:
        if name.split(".")[-1] in INT_FIELDS:
            assert torch.equal(ref[name].cpu(), out[name].cpu()), f"{tag} {name}"
        else:
            assert out[name].dtype == ref[name].dtype, f"{tag} {name} dtype {out[name].dtype}"
            check(f"{tag} {name}", ref[name], out[name])


def _launch(walk, dtype=torch.float32, C=C):
    """The default launch with 2-chunk segments (``segments``) or one segment per sequence (``one``)."""
    return dataclasses.replace(default_launch(S, E, dtype, C), seg_chunks=2 if walk == "segments" else 1 << 20)


# every norm causal, both walks causal and non-causal, each norm with a walk and "tokens" with both (the norm weights
# the output; the walk is the states': they meet only through ``causal``, so one causal case per norm covers both
# walks causal, and "tokens" meets both walks across the causal and non-causal cases)
@pytest.mark.parametrize("causal, norm, walk", [(True, "tokens", "segments"), (True, "chunk", "segments"),
                                                (True, "none", "one"), (False, "tokens", "one"),
                                                (False, "chunk", "segments")])
def test_static_equals_dynamic_and_per_document_fp32(causal, norm, walk):
    """fp32: static padded offsets == the unpadded offsets (same kernels, exact) == each document alone through the
    naive form (exact), forward, final states (the padding's: zero) and every gradient."""
    T = sum(LENS)
    xs, rb = _inputs(T, torch.float32)
    wts = _loss_weights(T)
    launch = _launch(walk)
    kw = {"chunk_size": C, "causal": causal, "linear_norm": norm, "output_final_state": causal}
    static = _run(xs, rb, wts, cu=_cu(LENS, NCAP), launch=launch, **kw)
    dynamic = _run(xs, rb, wts, cu=_cu(LENS), launch=launch, **kw)
    alone = _per_document(xs, rb, wts, LENS, "naive", **kw)
    if causal:
        _check_padding(static, len(LENS))
    _assert_all(f"static vs dynamic ({walk})", dynamic, _real(static, len(LENS)), assert_exact)
    _assert_all(f"static vs per document ({walk})", alone, _real(static, len(LENS)), assert_exact)


# the walk's half-precision loads are the same kernel's in both walks (one segment per sequence only skips the fp32
# start fix-up, whose static plan the fp32 cases above check in both walks): 2-chunk segments, causal and not
@pytest.mark.parametrize("causal, walk", [(True, "segments"), (False, "segments")])
def test_static_half(causal, walk):
    """Half precision: static == unpadded offsets (the same arithmetic: exact), and against each document alone
    through the fp64 naive form by the half-precision rule (base: the naive form in the half dtype)."""
    T = sum(LENS)
    xs64, rb64 = _inputs(T, torch.float64, seed=2)
    xs, rb = [x.to(HALF) for x in xs64], rb64.to(HALF)
    wts = _loss_weights(T, seed=6)
    kw = {"chunk_size": C, "causal": causal, "output_final_state": causal}
    launch = _launch(walk, HALF)
    static = _run(xs, rb, wts, cu=_cu(LENS, NCAP), launch=launch, **kw)
    dynamic = _run(xs, rb, wts, cu=_cu(LENS), launch=launch, **kw)
    assert static["o"].dtype == HALF
    if causal:
        _check_padding(static, len(LENS))
    static = _real(static, len(LENS))
    _assert_all(f"{HALF} static vs dynamic", dynamic, static, assert_exact)
    ref64 = _per_document(xs64, rb64, wts, LENS, "naive", **kw)
    base = _per_document(xs, rb, wts, LENS, "naive", **kw)
    for name in ref64:
        if name.split(".")[-1] in INT_FIELDS:
            assert torch.equal(ref64[name], static[name]), name
        elif name != "final.kv":  # fp32 sums of the same half inputs: covered by the exact comparison above
            assert_half_rule(f"{HALF} static {name}", ref64[name], static[name], base[name])


def test_one_buffer_two_layouts():
    """Two document layouts through the same static buffer, its values rewritten between calls without a version
    bump (as a replayed CUDA graph's copy: no host code sees it): every call equals the ordinary call with its own
    offsets, so no plan or weight built for the earlier values is reused."""
    layouts = [LENS, [5, 50, 0, 0, 25], LENS]
    T = sum(LENS)
    assert all(sum(lens) == T for lens in layouts)
    xs, rb = _inputs(T, torch.float32, seed=3)
    wts = _loss_weights(T, seed=7)
    kw = {"chunk_size": C, "output_final_state": True}
    dynamic = [_run(xs, rb, wts, cu=_cu(lens), **kw) for lens in layouts[:2]]  # the third layout is the first
    dynamic.append(dynamic[0])
    cu = _cu(layouts[0], NCAP)
    static = []
    for lens in layouts:  # one static call after another: nothing in between would flush a cache kept on `cu`
        cu.data.copy_(_cu(lens, NCAP))  # .data: the tensor's version counter stays as it was
        static.append(_run(xs, rb, wts, cu=cu, **kw))
    assert is_static(cu)
    for lens, d, st in zip(layouts, dynamic, static, strict=True):
        _check_padding(st, len(lens))
        _assert_all(f"layout {lens}", d, _real(st, len(lens)), assert_exact)


def test_no_host_read(monkeypatch):
    """A static call (forward with the final state, then backward) makes no host sync of any kind and builds no
    tensor from host data (:func:`lintime.generation.profiling.count_host_syncs`: value reads, value-sized ops such as
    ``repeat_interleave`` without ``output_size``), and never goes near the per-tensor cache or the host copy of the
    sequence bounds."""
    def refuse(name, real):
        def f(*args):
            if any(is_static(a) for a in args if isinstance(a, torch.Tensor)):
                raise AssertionError(f"{name} called with a static cu_seqlens")
            return real(*args)
        return f

    monkeypatch.setattr(segments, "packed_cache", refuse("packed_cache", segments.packed_cache))
    monkeypatch.setattr(segments, "sequence_bounds", refuse("sequence_bounds", segments.sequence_bounds))
    monkeypatch.setattr(mc_entry, "sequence_bounds", refuse("sequence_bounds", mc_entry.sequence_bounds))
    T = sum(LENS)
    xs, rb = _inputs(T, torch.float32, seed=4)
    leaves = [x.requires_grad_() for x in [*xs, rb]]
    cu = _cu(LENS, NCAP)
    with count_host_syncs() as fwd:
        o, final = mixed_chunk_attention(*leaves[:5], rel_bias=leaves[5], chunk_size=C, cu_seqlens=cu,
                                         output_final_state=True, backend="triton")
    with count_host_syncs() as bwd:
        torch.autograd.grad(o.sum() + final.kv.sum() + final.v.sum(), leaves)
    assert bwd.ops > 0  # the counter saw the backward's calls
    for tag, c in (("forward", fwd), ("backward", bwd)):
        assert (c.total, c.h2d) == (0, 0), f"{tag}: host syncs {dict(c.counts)}, host->device tensors {c.h2d}"


def test_state_without_buffered_tokens():
    """An initial state whose sequences end on chunk boundaries (``fill = 0``: kv and count only) goes with a static
    buffer and equals the ordinary call; one with buffered tokens needs a host re-packing: refused by name."""
    T = sum(LENS)
    xs, rb = _inputs(T, torch.float32, seed=8)
    wts = _loss_weights(T, seed=9)
    g = torch.Generator().manual_seed(10)

    def state(n, fill):
        return MixedChunkState(
            kv=torch.randn(n, H, S, E, generator=g), count=torch.arange(n) * C, k_quad=torch.zeros(n, C, H, S),
            k_lin=torch.zeros(n, C, H, S), v=torch.zeros(n, C, H, E), fill=torch.full((n,), fill),
        ).to(DEV)

    st = state(NCAP, 0)
    sub = MixedChunkState(**{f: getattr(st, f)[: len(LENS)] for f in FLOAT_FIELDS + INT_FIELDS})
    kw = {"chunk_size": C, "output_final_state": True}
    static = _run(xs, rb, wts, cu=_cu(LENS, NCAP), state=st, **kw)
    dynamic = _run(xs, rb, wts, cu=_cu(LENS), state=sub, **kw)
    _assert_all("state fill=0", dynamic, _real(static, len(LENS)), assert_exact)
    assert torch.equal(static["final.kv"][len(LENS):], st.kv[len(LENS):])  # the padding keeps its state
    with pytest.raises(ValueError, match="static cu_seqlens"):
        mixed_chunk_attention(*xs, chunk_size=C, cu_seqlens=_cu(LENS, NCAP), initial_state=state(NCAP, 3),
                              backend="triton")


@pytest.mark.parametrize("Cw", [16, 8], ids=["flat", "per-chunk"])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_walk_with_empty_sequences(Cw, reverse):
    """The state walk with one segment per sequence over a static plan whose sequences are empty at the start, in
    the middle (after short chunks) and at the end: a segment of no chunks touches no chunk -- no state written, no
    table entry read (the tables and the state buffers get guard entries just outside them) -- and its sequence's
    result is its initial state; the others' states entering every chunk and results are the reference sums.
    ``flat``: chunks of whole walk steps (one loop over a segment's full chunks), ``per-chunk``: one loop per chunk."""
    lens = [0, 21, 0, 0, 37, 0]
    N, T = len(lens), sum(lens)
    cu = _cu(lens, N)
    cfg = _launch("one", C=Cw)
    dev = torch.device(DEV)
    p = segments.chunk_plan(1, T, Cw, plan.seg_chunks(1, T, H, S, E, Cw, cu, cfg, dev), cu, dev)
    assert p.one_segment and p.NSEG == N
    wq, wf = plan.weights(p, Cw, True, "tokens", None)
    w = wq if reverse else wf
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, T, H, S, generator=g).to(DEV)
    y = torch.randn(1, T, H, E, generator=g).to(DEV)
    init = torch.randn(N, H, S, E, generator=g).to(DEV)

    def guarded(t, before):  # t's entries with one guard entry before and after (a short chunk's length: 1)
        return torch.cat([t.new_full((1,), before), t, t.new_full((1,), before)])[1:-1]

    p = dataclasses.replace(p, ch_len=guarded(p.ch_len, 1), ch_start=guarded(p.ch_start, 0))
    w = guarded(w, 1.0)
    hbuf = torch.full((p.NC_alloc + 2, H, S, E), float("nan"), device=DEV)
    tbuf = torch.full((N + 2, H, S, E), float("nan"), device=DEV)
    hout, tot = hbuf[1:-1], tbuf[1:-1]
    launchers._walk(x, y, w, p, cfg, H=H, C=Cw, reverse=reverse, store=True, hout=hout, tot=tot, init=init)
    for buf in (hbuf, tbuf):
        assert buf[0].isnan().all() and buf[-1].isnan().all(), "a walk wrote outside its buffers"
    xf, yf = x[0].double(), y[0].double()
    c, t0 = 0, 0
    for n, L in enumerate(lens):
        chunks = list(range(c, c + -(-L // Cw)))
        h = init[n].double()
        for k in reversed(chunks) if reverse else chunks:
            assert_exact(f"state entering chunk {k}", h, hout[k])
            s, e = t0 + (k - c) * Cw, min(t0 + (k - c + 1) * Cw, t0 + L)
            h = h + w[k].double() * torch.einsum("ths,the->hse", xf[s:e], yf[s:e])
        assert_exact(f"result of sequence {n} (length {L})", h, tot[n])
        c, t0 = c + len(chunks), t0 + L
    assert hout[c:].isnan().all()  # rows past the chunks: written by no walk


def _reference_tables(lens, C, G):
    """The plan's tables written out from their definition: chunks ``(start, length, sequence, k)``, segments
    ``(first chunk, chunks, sequence)`` (an empty sequence: one segment of no chunks) and ``seq_ptr``."""
    chunks, segs, seq_ptr, t, c0 = [], [], [0], 0, 0
    for n, L in enumerate(lens):
        nch = -(-L // C)
        chunks += [(t + k * C, min(C, L - k * C), n, k) for k in range(nch)]
        nseg = max(1, -(-nch // G))
        segs += [(c0 + j * G, min(G, nch - j * G), n) for j in range(nseg)]
        seq_ptr.append(seq_ptr[-1] + nseg)
        t, c0 = t + L, c0 + nch
    return chunks, segs, seq_ptr


@pytest.mark.parametrize("G", [1, 2, 3, 1 << 20])
@pytest.mark.parametrize("lens", [[0, 21, 0, 0, 37, 0], [16, 32, 1], [100]], ids=["empties", "whole", "one"])
def test_plan_tables(lens, G):
    """The device-built tables (:func:`lintime.ops.utils.segments.chunk_plan`) against their definition,
    for ``G``-chunk segments: the ordinary call's exactly; a static buffer's (two padding entries: empty sequences)
    the same rows first, then empty chunk rows (length 0 at the end of the tokens) and segment rows of no chunks
    (of the last sequence, past ``seq_ptr``'s end)."""
    T = sum(lens)
    cfg = dataclasses.replace(default_launch(S, E, torch.float32, C), seg_chunks=G)
    for pad in (0, 2):
        full = lens + [0] * pad
        chunks, segs, seq_ptr = _reference_tables(full, C, G)
        cu = _cu(lens, len(full)) if pad else _cu(lens)
        dev = torch.device(DEV)
        p = segments.chunk_plan(1, T, C, plan.seg_chunks(1, T, H, S, E, C, cu, cfg, dev), cu, dev)
        got = list(zip(*(x.tolist() for x in (p.ch_start, p.ch_len, p.ch_seq, p.ch_k)), strict=True))
        assert got[:len(chunks)] == chunks and p.ch_id.tolist() == list(range(p.NC))
        assert all(r[:2] == (T, 0) for r in got[len(chunks):]) and (p.NC == len(chunks) or pad)
        got = list(zip(*(x.tolist() for x in (p.seg_first, p.seg_n, p.seg_seq)), strict=True))
        assert got[:len(segs)] == segs and (p.NSEG == len(segs) or pad)
        assert all(r[1:] == (0, len(full) - 1) for r in got[len(segs):])
        assert p.seq_ptr.tolist() == seq_ptr and p.lengths.tolist() == full
        one = G >= -(-T // C) if pad else seq_ptr[-1] == len(full)  # static: from shapes alone
        assert p.one_segment == one and (not one or p.NSEG == len(full))
