"""vq_attention: naive <-> chunked (three reductions) <-> recurrent, forward, final state and every
gradient; odd sizes; half precision; packing; continuation at any split; T = 32768 in bf16;
errors.

Keys are built as ``k_hat = codebook[codes]`` through a differentiable gather from a leaf
codebook: the naive form sends a key's gradient to ``k_hat``, the chunked and recurrent forms send
a cached key's gradient to ``codebook``, and only the total ``d codebook`` is the same in all."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import lintime.ops.vq as vq_mod
from lintime.ops import VQState, vq_attention
from tolerances import (
    EXACT_TOL,
    assert_close,
    assert_exact,
    assert_half_rule,
    rel_rms,
)

REDUCTIONS = ("serial", "matmul", "assoc")
FIELDS = ("cache_mean", "cache_count", "k_hat", "v", "codes", "pos")
FLOAT_FIELDS = ("cache_mean", "cache_count", "k_hat", "v")



def _gather(codebook, codes):
    """``codebook[h, codes[..., h]]``: ``[H, S, K]``, ``[..., H]`` -> ``[..., H, K]``."""
    H = codebook.shape[0]
    heads = torch.arange(H).expand_as(codes)
    return codebook[heads, codes]


def _inputs(B, T, H, K, V, S, L, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    return {
        "q": (r(B, T, H, K) * 2 * K**-0.5).to(dtype),  # scores of a few units, as after the layer's scaling
        "v": r(B, T, H, V).to(dtype),
        "bias": r(B, T, H, 2 * L).to(dtype),
        "codebook": r(H, S, K).to(dtype),
        "codes": torch.randint(0, S, (B, T, H), generator=g),
    }


def _state(pos, H, K, V, S, L, dtype, seed=1):
    """A random state at positions ``pos``: cache counts in {0..3} with random means (also for
    empty codes, which the ops must ignore), window buffers zero where unused; its ``k_hat``
    buffer is left to the caller (from the codebook)."""
    g = torch.Generator().manual_seed(seed)
    N = len(pos)
    p = torch.tensor(pos)
    slot = torch.arange(2 * L)
    live = torch.where(slot[None] < L, (p >= L)[:, None], (slot[None] - L) < (p % L)[:, None])  # [N, 2L]
    codes = torch.randint(0, S, (N, 2 * L, H), generator=g) * live[..., None]
    return {
        "cache_mean": torch.randn(N, H, S, V, generator=g, dtype=torch.float64).to(dtype),
        "cache_count": torch.randint(0, 4, (N, H, S), generator=g).to(dtype),
        "v": (torch.randn(N, 2 * L, H, V, generator=g, dtype=torch.float64) * live[..., None, None]).to(dtype),
        "codes": codes,
        "pos": p,
        "live": live,
    }


def _make_state(sd, codebook):
    k = _gather(codebook, sd["codes"]) * sd["live"][..., None, None]
    return VQState(sd["cache_mean"], sd["cache_count"], k, sd["v"], sd["codes"], sd["pos"])


def _run(backend, inp, L, reduction="serial", sd=None, cu=None, w=None):
    """Forward + loss over the output and the final state's float fields; returns the output,
    the final state and the gradients of every float leaf (inputs and initial state)."""
    leaves = {k: x.detach().clone().requires_grad_() for k, x in inp.items() if x.is_floating_point()}
    if sd is not None:
        leaves.update({f"st_{k}": sd[k].detach().clone().requires_grad_() for k in ("cache_mean", "cache_count", "v")})
    k_hat = _gather(leaves["codebook"], inp["codes"])
    state = None
    if sd is not None:
        state = _make_state({**sd, **{k: leaves[f"st_{k}"] for k in ("cache_mean", "cache_count", "v")}},
                            leaves["codebook"])
    o, fin = vq_attention(
        leaves["q"], k_hat, inp["codes"], leaves["v"], leaves["codebook"], block_len=L, bias=leaves["bias"],
        reduction=reduction, initial_state=state, output_final_state=True, cu_seqlens=cu, backend=backend,
    )
    g = torch.Generator().manual_seed(7)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    for f in FLOAT_FIELDS:
        x = getattr(fin, f)
        loss = loss + (x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    grads = {k: (torch.zeros_like(x) if gr is None else gr) for (k, x), gr in zip(leaves.items(), grads)}
    if sd is not None:
        # d/d count is one-sided where a count is 0 (log(count) = -inf there): compare it on counts > 0
        grads["st_cache_count"] = grads["st_cache_count"] * (sd["cache_count"] > 0)
    return o, fin, grads


def _assert_same(name, a, b, check=assert_exact):
    oa, fa, ga = a
    ob, fb, gb = b
    check(f"{name} o", oa, ob)
    for f in FIELDS:
        x, y = getattr(fa, f), getattr(fb, f)
        assert x.shape == y.shape and x.dtype == y.dtype, (name, f, x.shape, y.shape, x.dtype, y.dtype)
        if f in FLOAT_FIELDS:
            check(f"{name} state.{f}", x, y)
        else:
            assert torch.equal(x, y), (name, f)
    for k in ga:
        check(f"{name} d{k}", ga[k], gb[k])


# ---------------------------------------------------------------------------------------------
# chain of trust


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 2, 63, 257])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chain_naive_chunk_recurrent(dtype, T, with_state):
    """Forward, final state and every gradient (q, v, bias, codebook, initial cache and buffers)
    agree between naive, chunked (each reduction) and recurrent; K = 60, T not a multiple of L."""
    H, K, V, S, L = 2, 60, 12, 8, 16
    inp = _inputs(2, T, H, K, V, S, L, dtype, seed=T)
    sd = _state([37, 5], H, K, V, S, L, dtype) if with_state else None  # mid-block 2; block 0
    ref = _run("naive", inp, L, sd=sd)
    assert torch.isfinite(ref[0]).all()
    _assert_same("recurrent", ref, _run("recurrent", inp, L, sd=sd))
    for red in REDUCTIONS:
        _assert_same(f"chunk[{red}]", ref, _run("chunk", inp, L, reduction=red, sd=sd))


def test_chunk_and_recurrent_route_key_gradients_alike():
    """With leaf k_hat (not derived from the codebook) the chunked and recurrent forms agree on
    d k_hat (window keys only), d codebook (cached keys) and the state-buffer gradients; the
    naive form puts all of it on k_hat, so its d codebook is only the initial cache's."""
    H, K, V, S, L, T = 1, 8, 4, 5, 4, 30
    inp = _inputs(2, T, H, K, V, S, L, torch.float64, seed=3)
    sd = _state([9, 2], H, K, V, S, L, torch.float64)
    out = {}
    for be in ("naive", "chunk", "recurrent"):
        leaves = {k: x.clone().requires_grad_() for k, x in inp.items() if x.is_floating_point()}
        k_hat = _gather(inp["codebook"], inp["codes"]).requires_grad_()
        st_k = (_gather(inp["codebook"], sd["codes"]) * sd["live"][..., None, None]).requires_grad_()
        state = VQState(sd["cache_mean"], sd["cache_count"], st_k, sd["v"], sd["codes"], sd["pos"])
        o, _ = vq_attention(leaves["q"], k_hat, inp["codes"], leaves["v"], leaves["codebook"], block_len=L,
                            bias=leaves["bias"], initial_state=state, backend=be)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
        out[be] = torch.autograd.grad(o, (k_hat, st_k, leaves["codebook"], leaves["q"]), do)
    for name, a, b in zip(("dk_hat", "dstate.k_hat", "dcodebook", "dq"), out["chunk"], out["recurrent"]):
        assert_exact(f"leaf routing {name}", a, b)
    # the forms differ in where a cached key's gradient goes, not in the total
    dk = {be: out[be][0] for be in out}
    assert rel_rms(dk["naive"], dk["chunk"]) > 1e-3
    assert out["chunk"][2].abs().sum() > out["naive"][2].abs().sum() * 1.01


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reductions_agree_on_long_packed_cache(dtype):
    """Many blocks, several sequences in one row: the three reductions give the same caches."""
    H, K, V, S, L = 1, 4, 3, 6, 2
    lens = [30, 1, 0, 47, 9]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    inp = _inputs(1, sum(lens), H, K, V, S, L, dtype, seed=11)
    sd = _state([3, 0, 7, 1, 4], H, K, V, S, L, dtype)
    ref = _run("naive", inp, L, sd=sd, cu=cu)
    for red in REDUCTIONS:
        _assert_same(f"packed chunk[{red}]", ref, _run("chunk", inp, L, reduction=red, sd=sd, cu=cu))


def test_no_bias_is_zero_bias_and_initial_state_is_no_state():
    H, K, V, S, L, T = 2, 6, 5, 4, 4, 23
    inp = _inputs(2, T, H, K, V, S, L, torch.float64)
    k_hat = _gather(inp["codebook"], inp["codes"])
    empty = VQState.initial(2, H, S, K, V, L, dtype=torch.float64)
    for be in ("naive", "chunk", "recurrent"):
        args = (inp["q"], k_hat, inp["codes"], inp["v"], inp["codebook"])
        o0, none = vq_attention(*args, block_len=L, backend=be)
        assert none is None  # output_final_state=False
        o1, _ = vq_attention(*args, block_len=L, bias=torch.zeros_like(inp["bias"]), backend=be)
        o2, _ = vq_attention(*args, block_len=L, initial_state=empty, backend=be)
        assert_exact(f"{be} bias None", o1, o0)
        assert_exact(f"{be} empty state", o0, o2)
        assert rel_rms(o0, vq_attention(*args, block_len=L, bias=inp["bias"], backend=be)[0]) > 1e-3


def test_matches_softmax_over_all_keys():
    """docs/design/contract.md §2.6 directly: softmax of q_i . k_hat_j (+ bias column j - (n-1)L inside the window)."""
    B, T, H, K, V, S, L = 1, 40, 1, 5, 3, 4, 6
    inp = _inputs(B, T, H, K, V, S, L, torch.float64, seed=5)
    k_hat = _gather(inp["codebook"], inp["codes"])
    s = torch.einsum("bihk,bjhk->bhij", inp["q"], k_hat)
    for i in range(T):
        n = i // L
        for r in range(2 * L):
            j = (n - 1) * L + r
            if 0 <= j <= i:
                s[:, :, i, j] += inp["bias"][:, i, :, r]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    ref = torch.einsum("bhij,bjhv->bihv", s.softmax(-1), inp["v"])
    for be in ("naive", "chunk", "recurrent"):
        o, _ = vq_attention(inp["q"], k_hat, inp["codes"], inp["v"], inp["codebook"], block_len=L,
                            bias=inp["bias"], backend=be)
        assert_exact(f"{be} vs dense softmax", ref, o)


# ---------------------------------------------------------------------------------------------
# half precision, long sequences


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rule(dtype):
    H, K, V, S, L, T = 2, 32, 32, 16, 16, 150
    inp = _inputs(1, T, H, K, V, S, L, torch.float64, seed=2)
    k_hat = _gather(inp["codebook"], inp["codes"])
    args64 = (inp["q"], k_hat, inp["codes"], inp["v"], inp["codebook"])
    ref, _ = vq_attention(*args64, block_len=L, bias=inp["bias"], backend="naive")
    half = [x.to(dtype) if x.is_floating_point() else x for x in args64]
    hb = inp["bias"].to(dtype)
    base, _ = vq_attention(*half, block_len=L, bias=hb, backend="naive")
    for be, red in [("chunk", r) for r in REDUCTIONS] + [("recurrent", "serial")]:
        out, fin = vq_attention(*half, block_len=L, bias=hb, reduction=red, backend=be, output_final_state=True)
        assert out.dtype == dtype and fin.k_hat.dtype == dtype
        assert fin.cache_mean.dtype == torch.float32 and fin.cache_count.dtype == torch.float32
        assert_half_rule(f"vq {be}[{red}]", ref, out, base)


def test_bf16_32768_tokens_chunked():
    """T = 32768 in bf16 (512 blocks, counts up to 3e4): finite; output within the half rule of
    the fp64 run on the same inputs (base: the fp64 output rounded to bf16); fp32 cache close to
    the fp64 cache, for the serial and associative reductions.  Neither bound depends on T (the half rule is
    relative to the fp64 run's own rounding; the cache is a running mean), so 4x fewer tokens check the same
    claims over 511 merges instead of 2047, at a quarter of the time."""
    T, H, K, V, S, L = 32768, 1, 16, 16, 16, 64
    # matmul (seed Code 3) is quadratic in the number of blocks, by design; it is checked
    # against the others on shorter inputs
    inp = _inputs(1, T, H, K, V, S, L, torch.bfloat16, seed=4)
    cb = inp["codebook"]
    k_hat = _gather(cb, inp["codes"])
    args = (inp["q"], k_hat, inp["codes"], inp["v"], cb)
    outs = {}
    for red in ("serial", "assoc"):
        o, fin = vq_attention(*args, block_len=L, bias=inp["bias"], reduction=red, output_final_state=True,
                              backend="chunk")
        assert o.dtype == torch.bfloat16 and torch.isfinite(o).all()
        assert torch.isfinite(fin.cache_mean).all() and fin.cache_count.sum().item() == (T // L - 1) * L * H
        outs[red] = (o, fin)
    a64 = [x.double() if x.is_floating_point() else x for x in args]
    ref, fin64 = vq_attention(*a64, block_len=L, bias=inp["bias"].double(), output_final_state=True,
                              backend="chunk")
    for red, (o, fin) in outs.items():
        assert_half_rule(f"vq bf16 T={T} [{red}]", ref, o, ref.to(torch.bfloat16))
        # fp32 running means over 511 merges: the fp32 exact-form tolerance holds
        assert_close(f"cache mean fp32 [{red}]", fin64.cache_mean, fin.cache_mean, EXACT_TOL[torch.float32])
        assert torch.equal(fin.cache_count.double(), fin64.cache_count)


# ---------------------------------------------------------------------------------------------
# packing, continuation


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
def test_packing_equals_separate_calls(backend):
    """Packed sequences (one of length 1, one empty) with per-sequence initial states equal
    separate calls: output, final states and gradients."""
    H, K, V, S, L = 2, 6, 4, 5, 4
    lens = [5, 1, 0, 22, 13]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    inp = _inputs(1, sum(lens), H, K, V, S, L, torch.float64, seed=8)
    sd = _state([6, 0, 8, 13, 4], H, K, V, S, L, torch.float64)  # 8 = 2L: at a block end
    for red in REDUCTIONS if backend == "chunk" else ("serial",):
        packed = _run(backend, inp, L, reduction=red, sd=sd, cu=cu)
        for n in range(len(lens)):
            s, e = cu[n].item(), cu[n + 1].item()
            sub_in = {k: x if k == "codebook" else x[:, s:e] for k, x in inp.items()}
            sub_sd = {k: x[n : n + 1] for k, x in sd.items()}
            o, fin, _ = _run(backend, sub_in, L, reduction=red, sd=sub_sd)
            assert_exact(f"packed seq {n} o", o, packed[0][:, s:e])
            for f in FIELDS:
                x, y = getattr(packed[1], f)[n : n + 1], getattr(fin, f)
                if f in FLOAT_FIELDS:
                    assert_exact(f"packed seq {n} state.{f}", y, x)
                else:
                    assert torch.equal(x, y), (n, f)
    # gradients: a packed call and separate calls with the same loss
    _packed_vs_separate_grads(backend, inp, sd, cu, L)


def _packed_vs_separate_grads(backend, inp, sd, cu, L):
    leaves = {k: x.clone().requires_grad_() for k, x in inp.items() if x.is_floating_point()}
    st_leaves = {k: sd[k].clone().requires_grad_() for k in ("cache_mean", "cache_count", "v")}
    grads = {}
    for mode in ("packed", "separate"):
        k_hat = _gather(leaves["codebook"], inp["codes"])
        state = _make_state({**sd, **st_leaves}, leaves["codebook"])
        if mode == "packed":
            o, fin = vq_attention(leaves["q"], k_hat, inp["codes"], leaves["v"], leaves["codebook"], block_len=L,
                                  bias=leaves["bias"], initial_state=state, output_final_state=True,
                                  cu_seqlens=cu, backend=backend)
            fins = [fin]
        else:
            os, fins = [], []
            for n in range(cu.numel() - 1):
                s, e = cu[n].item(), cu[n + 1].item()
                o_n, f_n = vq_attention(leaves["q"][:, s:e], k_hat[:, s:e], inp["codes"][:, s:e], leaves["v"][:, s:e],
                                        leaves["codebook"], block_len=L, bias=leaves["bias"][:, s:e],
                                        initial_state=state.select(n), output_final_state=True, backend=backend)
                os.append(o_n)
                fins.append(f_n)
            o = torch.cat(os, 1)
        g = torch.Generator().manual_seed(3)
        loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
        for f in FLOAT_FIELDS:
            x = torch.cat([getattr(fi, f) for fi in fins])
            loss = loss + (x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum()
        ls = list(leaves.values()) + list(st_leaves.values())
        grads[mode] = torch.autograd.grad(loss, ls)
    names = list(leaves) + [f"state.{k}" for k in st_leaves]
    for name, a, b in zip(names, grads["packed"], grads["separate"]):
        if name == "state.cache_count":
            a, b = a * (sd["cache_count"] > 0), b * (sd["cache_count"] > 0)
        assert_exact(f"{backend} packed vs separate d{name}", b, a)


def _continue(backend, inp, splits, L, red="serial", sd=None):
    """Run ``inp`` as consecutive calls cut at ``splits``; returns output, final state, grads.

    The chunked and recurrent forms route a key's gradient by its position (window: k_hat,
    cache: codebook), the same in one call or many, so k_hat is a leaf there.  The naive form
    sends a key to k_hat unless an earlier call compressed it into the state's cache, so there
    k_hat comes from the codebook and the total d codebook is compared."""
    leaves = {k: x.clone().requires_grad_() for k, x in inp.items() if x.is_floating_point()}
    k_leaf = _gather(inp["codebook"], inp["codes"]).requires_grad_()
    if backend == "naive":
        k_leaf = _gather(leaves["codebook"], inp["codes"])
    st_leaves = None if sd is None else {k: sd[k].clone().requires_grad_() for k in ("cache_mean", "cache_count", "v")}
    state = None if sd is None else _make_state({**sd, **st_leaves}, leaves["codebook"])
    T = inp["q"].shape[1]
    cuts = [0, *splits, T]
    os = []
    for a, b in itertools.pairwise(cuts):
        sl = lambda x, a=a, b=b: x[:, a:b]
        o, state = vq_attention(sl(leaves["q"]), sl(k_leaf), sl(inp["codes"]), sl(leaves["v"]), leaves["codebook"],
                                block_len=L, bias=sl(leaves["bias"]), reduction=red, initial_state=state,
                                output_final_state=True, backend=backend)
        os.append(o)
    o = torch.cat(os, 1)
    g = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum()
    for f in FLOAT_FIELDS:
        x = getattr(state, f)
        loss = loss + (x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum()
    ks = [] if backend == "naive" else [k_leaf]
    ls = [*leaves.values(), *ks, *([] if st_leaves is None else st_leaves.values())]
    names = [*leaves, *["k_hat"] * len(ks), *([] if st_leaves is None else [f"state.{k}" for k in st_leaves])]
    gr = torch.autograd.grad(loss, ls, allow_unused=True)
    gr = {n: torch.zeros_like(x) if g_ is None else g_ for n, x, g_ in zip(names, ls, gr)}
    if sd is not None:
        gr["state.cache_count"] = gr["state.cache_count"] * (sd["cache_count"] > 0)
    return o, state, gr


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent", None])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_continuation_at_any_split(backend, dtype):
    """One call == consecutive calls cut mid-block, at block ends, into length-1 and empty calls,
    from a mid-block initial state: output, final state and gradients (leaf k_hat: each form
    routes key gradients by position, the same way in both runs)."""
    H, K, V, S, L, T = 2, 7, 5, 6, 8, 70
    inp = _inputs(2, T, H, K, V, S, L, dtype, seed=12)
    sd = _state([19, 3], H, K, V, S, L, dtype)
    rnd = sorted(torch.randperm(T - 1, generator=torch.Generator().manual_seed(9))[:3].add(1).tolist())
    for splits in ([5, 13, 21, 22, 22, 40, 69], rnd):
        for red in REDUCTIONS if backend == "chunk" else ("serial",):
            one = _continue(backend, inp, [], L, red, sd)
            many = _continue(backend, inp, splits, L, red, sd)
            name = f"{backend}[{red}] splits {splits}"
            assert_exact(f"{name} o", one[0], many[0])
            for f in FIELDS:
                x, y = getattr(one[1], f), getattr(many[1], f)
                if f in FLOAT_FIELDS:
                    assert_exact(f"{name} state.{f}", x, y)
                else:
                    assert torch.equal(x, y), (name, f)
            for k in one[2]:
                assert_exact(f"{name} d{k}", one[2][k], many[2][k])


def test_states_of_all_forms_interchange():
    """A state made by one form continues in any other."""
    H, K, V, S, L, T = 1, 5, 3, 4, 4, 29
    inp = _inputs(2, T, H, K, V, S, L, torch.float64, seed=6)
    k_hat = _gather(inp["codebook"], inp["codes"])
    args = lambda a, b: (inp["q"][:, a:b], k_hat[:, a:b], inp["codes"][:, a:b], inp["v"][:, a:b], inp["codebook"])
    ref, _ = vq_attention(*args(0, T), block_len=L, bias=inp["bias"], backend="naive")
    forms = ("naive", "chunk", "recurrent")
    for f1 in forms:
        _, s1 = vq_attention(*args(0, 10), block_len=L, bias=inp["bias"][:, :10], output_final_state=True, backend=f1)
        for f2 in forms:
            o2, _ = vq_attention(*args(10, T), block_len=L, bias=inp["bias"][:, 10:], initial_state=s1, backend=f2)
            assert_exact(f"{f1} -> {f2}", ref[:, 10:], o2)


@given(
    B=st.integers(1, 2), T=st.integers(1, 40), L=st.integers(1, 6), S=st.integers(1, 4), H=st.integers(1, 2),
    red=st.sampled_from(REDUCTIONS), use_bias=st.booleans(), packed=st.booleans(),
    cut=st.floats(0, 1), seed=st.integers(0, 2**16),
)
def test_random_shapes_splits_options(B, T, L, S, H, red, use_bias, packed, cut, seed):
    """Random sizes / options: chunked (cut into two calls) and recurrent == naive in one call."""
    K, V = 3, 2
    g = torch.Generator().manual_seed(seed)
    inp = _inputs(B, T, H, K, V, S, L, torch.float64, seed=seed)
    cu = None
    if packed:
        B = 1
        inp = {k: x[:1] if x.dim() >= 3 and k != "codebook" else x for k, x in inp.items()}
        pts = sorted(torch.randint(0, T + 1, (2,), generator=g).tolist())
        cu = torch.tensor([0, *pts, T])
    k_hat = _gather(inp["codebook"], inp["codes"])
    bias = inp["bias"] if use_bias else None
    args = lambda a, b: (inp["q"][:, a:b], k_hat[:, a:b], inp["codes"][:, a:b], inp["v"][:, a:b], inp["codebook"])
    ref, fin = vq_attention(*args(0, T), block_len=L, bias=bias, cu_seqlens=cu, output_final_state=True,
                            backend="naive")
    rec, fin_r = vq_attention(*args(0, T), block_len=L, bias=bias, cu_seqlens=cu, output_final_state=True,
                              backend="recurrent")
    assert_exact("hypothesis recurrent", ref, rec)
    if packed:
        ch, fin_c = vq_attention(*args(0, T), block_len=L, bias=bias, reduction=red, cu_seqlens=cu,
                                 output_final_state=True, backend="chunk")
    else:
        t = int(cut * T)
        o1, s1 = vq_attention(*args(0, t), block_len=L, bias=None if bias is None else bias[:, :t], reduction=red,
                              output_final_state=True, backend="chunk")
        o2, fin_c = vq_attention(*args(t, T), block_len=L, bias=None if bias is None else bias[:, t:],
                                 reduction=red, initial_state=s1, output_final_state=True, backend="chunk")
        ch = torch.cat([o1, o2], 1)
    assert_exact("hypothesis chunk", ref, ch)
    for f in FIELDS:
        for other in (fin_c, fin_r):
            x, y = getattr(fin, f), getattr(other, f)
            if f in FLOAT_FIELDS:
                assert_exact(f"hypothesis state.{f}", x, y)
            else:
                assert torch.equal(x, y), f


# ---------------------------------------------------------------------------------------------
# state object, dispatch, errors


def test_state_object():
    H, K, V, S, L = 2, 4, 3, 5, 4
    for T in (3, 50):
        inp = _inputs(3, T, H, K, V, S, L, torch.bfloat16)
        k_hat = _gather(inp["codebook"], inp["codes"])
        _, fin = vq_attention(inp["q"], k_hat, inp["codes"], inp["v"], inp["codebook"], block_len=L,
                              output_final_state=True)
        # O(1) in T: shapes depend on N, H, S, K, V, L only
        assert fin.cache_mean.shape == (3, H, S, V) and fin.cache_count.shape == (3, H, S)
        assert fin.k_hat.shape == (3, 2 * L, H, K) and fin.v.shape == (3, 2 * L, H, V)
        assert fin.codes.shape == (3, 2 * L, H) and fin.pos.tolist() == [T] * 3
        assert fin.cache_mean.dtype == torch.float32 and fin.k_hat.dtype == torch.bfloat16
        assert fin.codes.dtype == torch.long and fin.pos.dtype == torch.long
        assert fin.N == 3 and fin.block_len == L
    sub = fin.select([2, 0])
    assert torch.equal(sub.k_hat, fin.k_hat[[2, 0]]) and sub.N == 2
    assert fin.select(1).N == 1 and fin.select(slice(0, 2)).N == 2
    moved = fin.to(dtype=torch.float64)
    assert moved.k_hat.dtype == torch.float64 and moved.codes.dtype == torch.long
    assert fin.to("cpu").pos.device.type == "cpu"
    x = torch.ones(1, requires_grad=True)
    st_ = VQState(fin.cache_mean * x, fin.cache_count, fin.k_hat, fin.v, fin.codes, fin.pos)
    assert st_.cache_mean.requires_grad and not st_.detach().cache_mean.requires_grad


def test_decoding_step_dispatches_to_recurrent(impl_calls):
    calls = impl_calls(vq_mod, "recurrent")
    inp = _inputs(2, 1, 1, 4, 3, 5, 4, torch.float32)
    k_hat = _gather(inp["codebook"], inp["codes"])
    vq_attention(inp["q"], k_hat, inp["codes"], inp["v"], inp["codebook"], block_len=4)
    assert calls == [1]


def test_bad_inputs_fail_clearly():
    H, K, V, S, L, T = 1, 4, 3, 5, 4, 8
    inp = _inputs(2, T, H, K, V, S, L, torch.float32)
    q, v, cb, z, b = inp["q"], inp["v"], inp["codebook"], inp["codes"], inp["bias"]
    k = _gather(cb, z)
    ok = VQState.initial(2, H, S, K, V, L)
    cases = [
        (ValueError, "block_len", {"block_len": 0}),
        (TypeError, "block_len", {"block_len": True}),
        (TypeError, "block_len", {"block_len": 2.0}),
        (ValueError, "reduction", {"reduction": "cumsum"}),
        (ValueError, "batch size must be 1", {"cu_seqlens": torch.tensor([0, 8])}),
        (ValueError, r"2L", {"bias": b[..., :L]}),
        (TypeError, "bias has dtype", {"bias": b.double()}),
        (ValueError, "unknown backend", {"backend": "fast"}),
        (TypeError, "VQState", {"initial_state": (ok.cache_mean, ok.cache_count)}),
        (ValueError, "initial_state.k_hat", {"initial_state": VQState.initial(2, H, S, K, V, L + 1)}),
        (ValueError, r"initial_state.cache_mean must have shape \(2,", {"initial_state": VQState.initial(3, H, S, K, V, L)}),
        (ValueError, "initial_state.cache_mean", {"initial_state": VQState.initial(2, H, S + 1, K, V, L)}),
        (ValueError, "pos must be >= 0", {"initial_state": VQState(ok.cache_mean, ok.cache_count, ok.k_hat, ok.v,
                                                                      ok.codes, torch.tensor([0, -1]))}),
    ]
    for exc, match, kw in cases:
        kw = {"block_len": L, **kw}
        with pytest.raises(exc, match=match):
            vq_attention(q, k, z, v, cb, **kw)
    with pytest.raises(TypeError, match="integer"):
        vq_attention(q, k, z.float(), v, cb, block_len=L)
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        vq_attention(q, k, z + S, v, cb, block_len=L)
    with pytest.raises(ValueError, match=r"codes must have shape"):
        vq_attention(q, k, z[:, :4], v, cb, block_len=L)
    with pytest.raises(ValueError, match=r"codebook must have shape"):
        vq_attention(q, k, z, v, cb[..., :3], block_len=L)
    with pytest.raises(ValueError, match=r"codebook must have 3 dims"):
        vq_attention(q, k, z, v, cb[0], block_len=L)
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        vq_attention(q, k[:, :4], z, v, cb, block_len=L)
    with pytest.raises(TypeError, match="k_hat has dtype"):
        vq_attention(q, k.double(), z, v, cb, block_len=L)
    with pytest.raises(ValueError, match="same feature size"):
        vq_attention(q, k[..., :3], z, v, cb, block_len=L)
    with pytest.raises(TypeError, match="block_len"):
        vq_attention(q, k, z, v, cb)  # block_len is required
    with pytest.raises(ValueError, match="initial_state.cache_mean"):  # 3 packed sequences, state of 2
        vq_attention(q[:1], k[:1], z[:1], v[:1], cb, block_len=L, cu_seqlens=torch.tensor([0, 2, 5, 8]),
                     initial_state=ok)


# ---------------------------------------------------------------------------------------------
# the chunked form's machinery: closed-form reduction, many tiny packed sequences, host transfers


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_serial_closed_form_equals_the_step_by_step_scan(dtype):
    """The serial reduction (segmented prefix sums) gives the running (count, mean) of seed Code 2's
    loop, block by block, with segments of 1 block, empty codes and rows of different segments."""
    from lintime.ops.vq.chunk import REDUCTIONS as IMPLS, _reduce_scan

    g = torch.Generator().manual_seed(3)
    R, NE, H, S, V = 3, 37, 2, 5, 4
    first = torch.rand(R, NE, generator=g) < 0.25
    first[:, 0] = True
    first[1, :6] = True  # one-block segments
    cnt = torch.randint(0, 3, (R, NE, H, S), generator=g).to(dtype)
    sumv = torch.randn(R, NE, H, S, V, generator=g, dtype=torch.float64).to(dtype) * cnt[..., None]
    ref_c, ref_m = _reduce_scan(first, cnt, sumv)
    for red in REDUCTIONS:
        c, m = IMPLS[red](first, cnt, sumv)
        assert torch.equal(c, ref_c), red  # integer counts: exact
        assert_exact(f"closed form [{red}] mean", ref_m, m)
    assert (ref_c == 0).any() and first[:, 1:].any()


@pytest.mark.parametrize("red", REDUCTIONS)
def test_many_tiny_packed_sequences_from_states(red):
    """41 packed sequences of lengths 0..5 (many 0 and 1), each continuing a state at a position
    inside a block, at a block end or at 0: output, final states and every gradient equal the
    naive form's."""
    H, K, V, S, L = 1, 4, 3, 5, 4
    g = torch.Generator().manual_seed(12)
    lens = torch.randint(0, 6, (41,), generator=g)
    lens[:6] = torch.tensor([0, 1, 0, 0, 1, 5])
    pos = torch.randint(0, 3 * L, (41,), generator=g)
    pos[:6] = torch.tensor([0, 0, L, 2 * L - 1, 1, L + 3])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    inp = _inputs(1, int(cu[-1]), H, K, V, S, L, torch.float64, seed=13)
    sd = _state(pos.tolist(), H, K, V, S, L, torch.float64, seed=14)
    _assert_same(f"tiny packed [{red}]", _run("naive", inp, L, sd=sd, cu=cu),
                 _run("chunk", inp, L, reduction=red, sd=sd, cu=cu))


def test_one_device_to_host_transfer_per_call(monkeypatch):
    """The op reads values from the device once per call (codes range, cu_seqlens, state
    positions together); the chunked form itself, given those values, or with neither packing
    nor a state, reads none."""
    from lintime.ops.vq.chunk import chunk_vq_attention

    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: reads.append(_n) or _o(self, *a, **k))
    H, K, V, S, L = 1, 4, 3, 5, 4
    inp = _inputs(1, 30, H, K, V, S, L, torch.float32, seed=15)
    k_hat = _gather(inp["codebook"], inp["codes"])
    args = (inp["q"], k_hat, inp["codes"], inp["v"], inp["codebook"])
    cu = torch.tensor([0, 7, 7, 8, 30])
    state = VQState.initial(4, H, S, K, V, L)
    for kw in ({}, {"cu_seqlens": cu}, {"cu_seqlens": cu, "initial_state": state, "output_final_state": True}):
        reads.clear()
        vq_attention(*args, block_len=L, bias=inp["bias"], backend="chunk", **kw)
        assert reads == ["tolist"], (kw, reads)
    reads.clear()
    chunk_vq_attention(*args, block_len=L, bias=inp["bias"], output_final_state=True)
    chunk_vq_attention(*args, block_len=L, cu_seqlens=cu, initial_state=state, host_values=(cu.tolist(), [0] * 4))
    assert reads == ["tolist"], reads  # the test's own cu.tolist()
