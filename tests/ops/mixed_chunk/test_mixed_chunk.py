"""mixed_chunk_attention: naive <-> chunk <-> recurrent (forward, final state, every gradient),
odd sizes, half precision, packing, continuation at any split, a long bf16 run, error paths."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lintime.ops.mixed_chunk as mc_module
from lintime.ops import MixedChunkState, mixed_chunk_attention
from tolerances import assert_close, assert_exact, assert_half_rule, rel_rms

NORMS = ("tokens", "chunk", "none")
FLOAT_FIELDS = ("kv", "k_quad", "k_lin", "v")
INT_FIELDS = ("count", "fill")
INPUTS = ("q_quad", "k_quad", "q_lin", "k_lin", "v")


def _inputs(B, T, H, S, E, C, dtype, seed=0):
    """The five inputs and a rel_bias, drawn in float64 and rounded to ``dtype``."""
    g = torch.Generator().manual_seed(seed * 1009 + T * 7 + S)
    xs = [torch.randn(B, T, H, S, generator=g, dtype=torch.float64) for _ in range(4)]
    xs.append(torch.randn(B, T, H, E, generator=g, dtype=torch.float64))
    rb = 0.5 * torch.randn(H, 2 * C - 1, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in xs], rb.to(dtype)


def _state(fills, counts, C, H, S, E, dtype, seed=1):
    """A random state; buffer slots beyond ``fill`` hold junk that every form must ignore."""
    g = torch.Generator().manual_seed(seed)
    N = len(fills)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return MixedChunkState(
        kv=rnd(N, H, S, E).to(acc) * 3,
        count=torch.tensor(counts, dtype=torch.long),
        k_quad=rnd(N, C, H, S).to(dtype), k_lin=rnd(N, C, H, S).to(dtype), v=rnd(N, C, H, E).to(dtype),
        fill=torch.tensor(fills, dtype=torch.long),
    )


def _leaves(xs, rb, state):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    rb = None if rb is None else rb.detach().clone().requires_grad_()
    if state is not None:
        state = MixedChunkState(**{
            f: getattr(state, f).detach().clone().requires_grad_(f in FLOAT_FIELDS) for f in FLOAT_FIELDS + INT_FIELDS
        })
    return xs, rb, state


def _loss(o, final, seed=3):
    """A scalar reaching every output element and every float field of the final state."""
    g = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    if final is not None:
        for f in FLOAT_FIELDS:
            x = getattr(final, f).double()
            loss = loss + (x * torch.randn(x.shape, generator=g, dtype=torch.float64)).sum()
    return loss


def _grads(loss, named):
    """Gradients of ``loss`` w.r.t. ``named`` leaves (zeros where unused)."""
    names = list(named)
    if not loss.requires_grad:  # nothing reached the loss (an empty call)
        return {f"d{n}": torch.zeros_like(named[n]) for n in names}
    gs = torch.autograd.grad(loss, [named[n] for n in names], allow_unused=True)
    return {f"d{n}": torch.zeros_like(named[n]) if g is None else g for n, g in zip(names, gs)}


def _named_leaves(xs, rb, state):
    named = dict(zip(INPUTS, xs))
    if rb is not None:
        named["rel_bias"] = rb
    if state is not None:
        named.update({f"state.{f}": getattr(state, f) for f in FLOAT_FIELDS})
    return named


def _run(backend, xs, rb, state, **kw):
    """Forward + final state + every gradient of one call, as a dict of named tensors."""
    xs, rb, state = _leaves(xs, rb, state)
    o, final = mixed_chunk_attention(*xs, rel_bias=rb, initial_state=state, backend=backend, **kw)
    out = {"o": o}
    if final is not None:
        out.update({f"final.{f}": getattr(final, f) for f in FLOAT_FIELDS + INT_FIELDS})
    out.update(_grads(_loss(o, final), _named_leaves(xs, rb, state)))
    return out


def _assert_same(tag, ref, out):
    assert sorted(ref) == sorted(out), (sorted(ref), sorted(out))
    for name in ref:
        if name.split(".")[-1] in INT_FIELDS:
            assert torch.equal(ref[name], out[name]), f"{tag} {name}: {ref[name]} vs {out[name]}"
        else:
            assert out[name].dtype == ref[name].dtype, f"{tag} {name} dtype"
            assert_exact(f"{tag} {name}", ref[name], out[name])



# --------------------------------------------------------------------------- chain of trust

C_CHAIN, H_CHAIN, S_CHAIN, E_CHAIN = 16, 2, 60, 12


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", ["causal", "causal+state", "noncausal"])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("T", [1, 2, 63, 257])
def test_chain_naive_chunk_recurrent(dtype, mode, norm, T):
    """Forward, final state and the gradients w.r.t. all inputs, rel_bias and the initial state
    agree across the three forms (S = 60; T = 63, 257 leave a partial last chunk)."""
    C, H, S, E = C_CHAIN, H_CHAIN, S_CHAIN, E_CHAIN
    xs, rb = _inputs(2, T, H, S, E, C, dtype)
    causal = mode != "noncausal"
    # sequence 0 continues mid-chunk after two chunks, sequence 1 at a chunk boundary
    state = _state([5, 0], [2 * C, 3 * C], C, H, S, E, dtype) if mode == "causal+state" else None
    kw = {"chunk_size": C, "causal": causal, "linear_norm": norm, "output_final_state": causal}
    ref = _run("naive", xs, rb, state, **kw)
    assert ref["o"].dtype == dtype
    for backend in ("chunk", "recurrent") if causal else ("chunk",):
        _assert_same(f"{backend} vs naive ({mode}, {norm}, T={T})", ref, _run(backend, xs, rb, state, **kw))


def _loops_reference(xs, rb, C, causal, norm, scale):
    """docs/design/contract.md §2.3 read literally, one (query, key) pair at a time: the anchor the naive form is
    checked against (everything else is checked against the naive form)."""
    qq, kq, ql, kl, v = (x[0].double() for x in xs)  # B = 1
    T, H, E = v.shape
    o = torch.zeros(T, H, E, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            lin, n = torch.zeros(E, dtype=torch.float64), 0
            for j in range(T):
                if i // C == j // C and (j <= i or not causal):
                    a = scale * torch.dot(qq[i, h], kq[j, h]) + rb[h, i - j + C - 1]
                    o[i, h] += max(a.item(), 0.0) ** 2 * v[j, h]
                if j // C < i // C or not causal:
                    lin += torch.dot(ql[i, h], kl[j, h]) * v[j, h]
                    n += 1
            N = {"tokens": n, "chunk": C, "none": 1}[norm]
            o[i, h] += lin / N if N > 0 else 0.0
    return o[None]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("norm", NORMS)
def test_naive_matches_spec_loops(causal, norm):
    C = 3
    xs, rb = _inputs(1, 8, 2, 3, 2, C, torch.float64, seed=9)
    o, _ = mixed_chunk_attention(*xs, chunk_size=C, causal=causal, rel_bias=rb, linear_norm=norm, backend="naive")
    assert_exact(f"naive vs loops ({norm}, causal={causal})", _loops_reference(xs, rb, C, causal, norm, 1 / C), o)


def test_final_state_layout():
    """The final state: fp32 sum over completed chunks, buffers in the input dtype, zero past fill."""
    C = 8
    xs, rb = _inputs(2, 21, 1, 4, 3, C, torch.bfloat16)
    for backend in ("naive", "chunk", "recurrent"):
        _, s = mixed_chunk_attention(*xs, chunk_size=C, rel_bias=rb, output_final_state=True, backend=backend)
        assert s.kv.dtype == torch.float32 and s.kv.shape == (2, 1, 4, 3)
        assert s.k_quad.dtype == torch.bfloat16 and s.v.shape == (2, C, 1, 3)
        assert s.fill.tolist() == [5, 5] and s.count.tolist() == [16, 16]
        assert (s.k_lin[:, 5:] == 0).all() and (s.k_quad[:, :5] != 0).any()
        kv = torch.einsum("bths,bthe->bhse", xs[3][:, :16].float(), xs[4][:, :16].float())
        assert_exact(f"{backend} state kv", kv, s.kv)
        assert torch.equal(s.v[:, :5], xs[4][:, 16:])


def test_buffer_slots_past_fill_are_ignored():
    C, H, S, E = 8, 2, 4, 3
    xs, rb = _inputs(2, 11, H, S, E, C, torch.float64)
    state = _state([3, 6], [8, 0], C, H, S, E, torch.float64)
    clean = MixedChunkState(**{f: getattr(state, f).clone() for f in FLOAT_FIELDS + INT_FIELDS})
    for f in ("k_quad", "k_lin", "v"):
        getattr(clean, f)[0, 3:] = 0
        getattr(clean, f)[1, 6:] = 0
    for backend in ("naive", "chunk", "recurrent"):
        kw = {"chunk_size": C, "rel_bias": rb, "output_final_state": True, "backend": backend}
        o1, s1 = mixed_chunk_attention(*xs, initial_state=state, **kw)
        o2, s2 = mixed_chunk_attention(*xs, initial_state=clean, **kw)
        assert torch.equal(o1, o2), backend
        for f in FLOAT_FIELDS:
            assert torch.equal(getattr(s1, f), getattr(s2, f)), (backend, f)


def test_first_chunk_tokens_norm_is_zero_not_nan():
    """'tokens': the first chunk's linear sum is empty -> linear part 0, finite gradients."""
    C = 8
    xs, _ = _inputs(1, C, 1, 4, 3, C, torch.float32)
    for backend in ("naive", "chunk", "recurrent"):
        leaves = [x.clone().requires_grad_() for x in xs]
        o, _ = mixed_chunk_attention(*leaves, chunk_size=C, backend=backend)
        no_lin, _ = mixed_chunk_attention(*xs[:2], torch.zeros_like(xs[2]), *xs[3:], chunk_size=C, backend=backend)
        assert torch.equal(o.detach(), no_lin)
        grads = _grads(o.sum(), dict(zip(INPUTS, leaves)))
        assert all(torch.isfinite(g).all() for g in grads.values())
        assert (grads["dq_lin"] == 0).all()


# --------------------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("norm", NORMS)
def test_half_precision_rule(dtype, causal, norm):
    """Chunked (and recurrent) half-precision forms against the fp64 naive, forward and grads."""
    C, H, S, E, T = 16, 2, 32, 16, 90
    xs64, rb64 = _inputs(2, T, H, S, E, C, torch.float64, seed=5)
    xs = [x.to(dtype) for x in xs64]
    rb = rb64.to(dtype)
    kw = {"chunk_size": C, "causal": causal, "linear_norm": norm}
    ref = _run("naive", xs64, rb64, None, **kw)
    base = _run("naive", xs, rb, None, **kw)
    for backend in ("chunk", "recurrent") if causal else ("chunk",):
        out = _run(backend, xs, rb, None, **kw)
        assert out["o"].dtype == dtype
        for name in ref:
            assert_half_rule(f"{backend} {name} ({norm})", ref[name], out[name], base[name])


def test_long_bf16_sequence_is_finite_and_matches_fp32():
    """T = 131072 in bf16 through the chunked form: the 'tokens' normaliser divides sums over
    ~1e5 tokens.  The inputs have a positive mean (like silu features) so the sums grow with T.
    bf16 and fp32 runs see the same (bf16) values and both accumulate in fp32, so they may differ
    only by the final rounding to bf16: the bound is twice that rounding error."""
    T, C = 131072, 128
    g = torch.Generator().manual_seed(11)
    xs = [(torch.randn(1, T, 1, 8, generator=g) * 0.5 + 0.3).to(torch.bfloat16) for _ in range(5)]
    rb = torch.randn(1, 2 * C - 1, generator=g).to(torch.bfloat16)
    for norm in ("tokens", "none"):
        kw = {"chunk_size": C, "rel_bias": rb, "linear_norm": norm, "output_final_state": True, "backend": "chunk"}
        o16, s16 = mixed_chunk_attention(*xs, **kw)
        o32, s32 = mixed_chunk_attention(*[x.float() for x in xs], **kw)
        assert o16.dtype == torch.bfloat16 and torch.isfinite(o16).all() and torch.isfinite(s16.kv).all()
        assert s16.count.item() == T
        rounding = rel_rms(o32, o32.to(torch.bfloat16))
        assert_close(f"bf16 T={T} ({norm})", o32, o16, 2 * rounding)
        assert_exact(f"bf16 T={T} state kv ({norm})", s32.kv, s16.kv)
    # the 'tokens' linear part alone (k_quad = 0, no bias: relu2(0) = 0) against an fp64 chunk-level
    # cumsum of the same values, divided by the number of tokens before each chunk
    q_lin, k_lin, v = (x.double().view(T // C, C, 8) for x in xs[2:])
    kv = torch.einsum("ncs,nce->nse", k_lin, v).cumsum(0) - torch.einsum("ncs,nce->nse", k_lin, v)
    n = (torch.arange(T // C, dtype=torch.float64) * C).clamp(min=1)[:, None, None]
    ref = (torch.einsum("ncs,nse->nce", q_lin, kv) / n).reshape(1, T, 1, 8)
    lin16, _ = mixed_chunk_attention(xs[0], torch.zeros_like(xs[1]), *xs[2:], chunk_size=C, backend="chunk")
    assert_half_rule(f"bf16 T={T} linear part ('tokens')", ref, lin16, ref.to(torch.bfloat16))


# --------------------------------------------------------------------------- packing


def _packed_inputs(lens, H, S, E, C, dtype):
    xs, rb = _inputs(1, sum(lens), H, S, E, C, dtype, seed=7)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return xs, rb, cu


@pytest.mark.parametrize(
    "backend, causal", [("naive", True), ("chunk", True), ("recurrent", True), ("naive", False), ("chunk", False)]
)
def test_packing_equals_separate_calls(backend, causal):
    """Packed sequences (one of length 1, one empty, per-sequence initial states) give exactly what
    separate calls give: outputs, final states and gradients."""
    C, H, S, E = 8, 2, 5, 60
    lens = [13, 1, 0, 21, 8]
    xs, rb, cu = _packed_inputs(lens, H, S, E, C, torch.float64)
    state = _state([3, 7, 2, 0, 5], [8, 0, 16, 24, 0], C, H, S, E, torch.float64) if causal else None
    kw = {"chunk_size": C, "causal": causal, "output_final_state": causal, "backend": backend}

    xl, rbl, sl = _leaves(xs, rb, state)
    o, final = mixed_chunk_attention(*xl, rel_bias=rbl, initial_state=sl, cu_seqlens=cu, **kw)
    packed = {"o": o, **_grads(_loss(o, final), _named_leaves(xl, rbl, sl))}

    yl, rbs, ss = _leaves(xs, rb, state)
    outs, finals = [], []
    for n in range(len(lens)):
        s, e = cu[n].item(), cu[n + 1].item()
        o_n, f_n = mixed_chunk_attention(
            *[x[:, s:e] for x in yl], rel_bias=rbs, initial_state=None if ss is None else ss.select([n]), **kw
        )
        outs.append(o_n)
        finals.append(f_n)
    o_sep = torch.cat(outs, dim=1)
    f_sep = None
    if causal:
        f_sep = MixedChunkState(**{f: torch.cat([getattr(x, f) for x in finals]) for f in FLOAT_FIELDS + INT_FIELDS})
    separate = {"o": o_sep, **_grads(_loss(o_sep, f_sep), _named_leaves(yl, rbs, ss))}
    if causal:
        packed.update({f"final.{f}": getattr(final, f) for f in FLOAT_FIELDS + INT_FIELDS})
        separate.update({f"final.{f}": getattr(f_sep, f) for f in FLOAT_FIELDS + INT_FIELDS})
    _assert_same(f"packed vs separate ({backend}, causal={causal})", separate, packed)


def test_packing_never_mixes_sequences():
    """Changing one packed sequence leaves the others' outputs bit-identical (non-causal too)."""
    C, lens = 8, [11, 6, 17]
    xs, rb, cu = _packed_inputs(lens, 1, 4, 4, C, torch.float32)
    for causal in (True, False):
        kw = {"chunk_size": C, "causal": causal, "rel_bias": rb, "cu_seqlens": cu, "backend": "chunk"}
        o, _ = mixed_chunk_attention(*xs, **kw)
        ys = [x.clone() for x in xs]
        for y in ys:
            y[:, 11:17] = 100.0
        o2, _ = mixed_chunk_attention(*ys, **kw)
        assert torch.equal(o[:, :11], o2[:, :11]) and torch.equal(o[:, 17:], o2[:, 17:])


# --------------------------------------------------------------------------- continuation


def _continued(backends, xs, rb, state, splits, cu_parts=None, **kw):
    """Run the sequence in pieces ``[splits[k], splits[k+1])``, passing the state along.
    With ``cu_parts`` every piece is a packed call (``xs`` then holds per-piece inputs)."""
    outs = []
    for k in range(len(splits) - 1):
        s, e = splits[k], splits[k + 1]
        piece = [x[:, s:e] for x in xs]
        cu = None if cu_parts is None else cu_parts[k]
        o, state = mixed_chunk_attention(
            *piece, rel_bias=rb, initial_state=state, output_final_state=True, cu_seqlens=cu,
            backend=backends[k % len(backends)], **kw,
        )
        outs.append(o)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("backends", [("chunk",), ("recurrent",), ("naive",), ("chunk", "recurrent", None)])
def test_continuation_equals_one_call(dtype, norm, backends):
    """Splits mid-chunk, at chunk boundaries, single tokens (auto -> recurrent) and empty pieces:
    forward, final state and every gradient (incl. the first initial state) equal one call."""
    C, H, S, E, T = 8, 2, 6, 5, 45
    xs, rb = _inputs(2, T, H, S, E, C, dtype, seed=3)
    state = _state([6, 1], [C, 0], C, H, S, E, dtype)
    splits = [0, 2, 2, 10, 16, 17, 18, 29, 45]
    kw = {"chunk_size": C, "linear_norm": norm}

    xl, rbl, sl = _leaves(xs, rb, state)
    o, final = mixed_chunk_attention(*xl, rel_bias=rbl, initial_state=sl, output_final_state=True,
                                     backend="naive", **kw)
    one = {"o": o, **{f"final.{f}": getattr(final, f) for f in FLOAT_FIELDS + INT_FIELDS}}
    one.update(_grads(_loss(o, final), _named_leaves(xl, rbl, sl)))

    yl, rbp, sp = _leaves(xs, rb, state)
    o, final = _continued(backends, yl, rbp, sp, splits, **kw)
    pieces = {"o": o, **{f"final.{f}": getattr(final, f) for f in FLOAT_FIELDS + INT_FIELDS}}
    pieces.update(_grads(_loss(o, final), _named_leaves(yl, rbp, sp)))
    _assert_same(f"continued {backends} ({norm})", one, pieces)


@pytest.mark.parametrize("backend", ["chunk", "recurrent"])
def test_packed_continuation(backend):
    """Two packed calls, each sequence split at its own point (one piece empty), == one packed call."""
    C, H, S, E = 8, 1, 4, 3
    lens = [19, 1, 30]
    cut = [5, 1, 16]
    xs, rb, cu = _packed_inputs(lens, H, S, E, C, torch.float64)
    kw = {"chunk_size": C, "rel_bias": rb, "output_final_state": True, "backend": backend}
    o, final = mixed_chunk_attention(*xs, cu_seqlens=cu, **kw)
    idx1 = torch.cat([torch.arange(cu[n], cu[n] + cut[n]) for n in range(3)])
    idx2 = torch.cat([torch.arange(cu[n] + cut[n], cu[n + 1]) for n in range(3)])
    cu1 = torch.tensor([0, *torch.tensor(cut).cumsum(0).tolist()])
    cu2 = torch.tensor([0, *torch.tensor([a - b for a, b in zip(lens, cut)]).cumsum(0).tolist()])
    o1, s1 = mixed_chunk_attention(*[x[:, idx1] for x in xs], cu_seqlens=cu1, **kw)
    o2, s2 = mixed_chunk_attention(*[x[:, idx2] for x in xs], cu_seqlens=cu2, initial_state=s1, **kw)
    o_cont = torch.empty_like(o)
    o_cont[:, idx1] = o1
    o_cont[:, idx2] = o2
    assert_exact("packed continuation o", o, o_cont)
    for f in FLOAT_FIELDS:
        assert_exact(f"packed continuation {f}", getattr(final, f), getattr(s2, f))
    assert torch.equal(final.fill, s2.fill) and torch.equal(final.count, s2.count)


def test_state_select_and_to():
    """select reorders sequences (beam reordering): continuing the selected state equals
    continuing the matching sequences; to() and zeros() give usable states."""
    C, H, S, E = 4, 1, 3, 2
    xs, rb = _inputs(3, 10, H, S, E, C, torch.float64)
    _, s = mixed_chunk_attention(*[x[:, :6] for x in xs], chunk_size=C, rel_bias=rb, output_final_state=True)
    order = [2, 0, 0]
    o_sel, _ = mixed_chunk_attention(*[x[order, 6:] for x in xs], chunk_size=C, rel_bias=rb,
                                     initial_state=s.select(order))
    o_all, _ = mixed_chunk_attention(*[x[:, 6:] for x in xs], chunk_size=C, rel_bias=rb, initial_state=s)
    assert torch.equal(o_sel, o_all[order])
    assert s.select(torch.tensor([False, True, False])).N == 1
    assert s.to("cpu").chunk_size == C
    z = MixedChunkState.zeros(3, C, H, S, E, dtype=torch.float64)
    o_z, _ = mixed_chunk_attention(*xs, chunk_size=C, rel_bias=rb, initial_state=z)
    o_none, _ = mixed_chunk_attention(*xs, chunk_size=C, rel_bias=rb)
    assert torch.equal(o_z, o_none)


def test_single_token_dispatches_to_recurrent(impl_calls):
    calls = impl_calls(mc_module, "recurrent")
    xs, _ = _inputs(1, 1, 1, 4, 4, 8, torch.float32)
    mixed_chunk_attention(*xs, chunk_size=8)
    assert calls == [1]


# --------------------------------------------------------------------------- hypothesis


@given(
    B=st.integers(1, 2), T=st.integers(1, 40), C=st.integers(1, 8), H=st.integers(1, 2),
    S=st.integers(1, 6), E=st.integers(1, 6), causal=st.booleans(), norm=st.sampled_from(NORMS),
    use_bias=st.booleans(), scale=st.sampled_from([None, 0.3]), seed=st.integers(0, 99), data=st.data(),
)
def test_hypothesis_forms_and_split_agree(B, T, C, H, S, E, causal, norm, use_bias, scale, seed, data):
    """Random sizes and options, optionally packed and/or from a random state: the three forms agree
    (forward, final state, every gradient), and a causal call split at a random point equals one call."""
    cu = None
    if data.draw(st.booleans(), label="packed"):
        lens = data.draw(st.lists(st.integers(0, 12), min_size=1, max_size=3), label="lens")
        B, T = 1, sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    N = B if cu is None else cu.numel() - 1
    xs, rb = _inputs(B, T, H, S, E, C, torch.float64, seed=seed)
    rb = rb if use_bias else None
    state = None
    if causal and data.draw(st.booleans(), label="from a state"):
        fills = data.draw(st.lists(st.integers(0, C - 1), min_size=N, max_size=N), label="fills")
        state = _state(fills, [C * k for k in range(N)], C, H, S, E, torch.float64, seed=seed)
    kw = {"chunk_size": C, "causal": causal, "linear_norm": norm, "scale": scale, "output_final_state": causal,
          "cu_seqlens": cu}
    ref = _run("naive", xs, rb, state, **kw)
    for backend in ("chunk", "recurrent") if causal else ("chunk",):
        _assert_same(f"hyp {backend}", ref, _run(backend, xs, rb, state, **kw))
    if causal and cu is None:
        a = data.draw(st.integers(0, T), label="split")
        o, final = _continued(("chunk", "recurrent"), xs, rb, state, [0, a, T],
                              chunk_size=C, linear_norm=norm, scale=scale)
        assert_exact("hyp split o", ref["o"], o)
        assert_exact("hyp split kv", ref["final.kv"], final.kv)
        assert torch.equal(ref["final.fill"], final.fill) and torch.equal(ref["final.count"], final.count)


# --------------------------------------------------------------------------- errors


def test_bad_inputs_fail_clearly():
    C = 4
    xs, _ = _inputs(2, 8, 2, 3, 5, C, torch.float32)
    q, k, ql, kl, v = xs
    f = mixed_chunk_attention
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        f(q, k[:, :4], ql, kl, v, chunk_size=C)
    with pytest.raises(ValueError, match="feature size"):
        f(q, k[..., :2], ql, kl, v, chunk_size=C)
    with pytest.raises(ValueError, match="4 dims"):
        f(q[0], k, ql, kl, v, chunk_size=C)
    with pytest.raises(TypeError, match="v is torch.float64"):
        f(q, k, ql, kl, v.double(), chunk_size=C)
    with pytest.raises(TypeError, match="chunk_size must be an int"):
        f(*xs, chunk_size=4.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        f(*xs, chunk_size=0)
    with pytest.raises(ValueError, match="linear_norm"):
        f(*xs, chunk_size=C, linear_norm="length")
    with pytest.raises(ValueError, match=r"rel_bias must have shape \[H, 2C-1\]"):
        f(*xs, chunk_size=C, rel_bias=torch.zeros(2, 2 * C))
    with pytest.raises(TypeError, match="scale"):
        f(*xs, chunk_size=C, scale="1/C")
    with pytest.raises(ValueError, match="batch size must be 1"):
        f(*xs, chunk_size=C, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        f(*[x[:1] for x in xs], chunk_size=C, cu_seqlens=torch.tensor([0, 3, 7]))
    state = MixedChunkState.zeros(2, C, 2, 3, 5)
    with pytest.raises(ValueError, match="initial_state needs causal=True"):
        f(*xs, chunk_size=C, causal=False, initial_state=state)
    with pytest.raises(ValueError, match="output_final_state needs causal=True"):
        f(*xs, chunk_size=C, causal=False, output_final_state=True)
    with pytest.raises(ValueError, match="not implemented"):
        f(*xs, chunk_size=C, causal=False, backend="recurrent")
    with pytest.raises(TypeError, match="MixedChunkState"):
        f(*xs, chunk_size=C, initial_state=torch.zeros(2, 2, 3, 5))
    with pytest.raises(ValueError, match=r"initial_state.k_quad has shape"):
        f(*xs, chunk_size=C + 1, initial_state=state)
    with pytest.raises(ValueError, match=r"initial_state.kv has shape"):
        f(*xs, chunk_size=C, initial_state=state.select([0]))
    bad = state.select([0, 1])
    bad.fill = torch.tensor([0, C])
    with pytest.raises(ValueError, match="fill must lie in"):
        f(*xs, chunk_size=C, initial_state=bad)
