"""mixed_chunk_attention, backend 'triton': the fused kernels against the naive form (forward,
final state and every gradient, incl. rel_bias and the initial state) -- on the CPU through the
Triton interpreter at small sizes (fp32 exact, fp16 by the half-precision rule), on CUDA at real
sizes (bf16 / fp16 by the half-precision rule, fp32 exact).

Without CUDA, tests/ops/conftest.py sets ``TRITON_INTERPRET=1``.  Under the interpreter the kernels use 16-wide blocks and 2-chunk segments
(:func:`lintime.ops.mixed_chunk.triton.launch.default_launch`), so these small shapes still cross several
query/key tiles per chunk, several ``S`` and ``E`` tiles, several segments per sequence, and
partial tiles everywhere.
"""

import dataclasses
import math

import pytest
import torch

from lintime.ops import MixedChunkState, mixed_chunk_attention
from lintime.ops.utils import segments
from lintime.ops.mixed_chunk.triton import launchers, plan
from lintime.ops.mixed_chunk.triton.launch import default_launch
from tolerances import assert_close, assert_exact, assert_half_rule

triton = pytest.importorskip("triton")

FLOAT_FIELDS = ("kv", "k_quad", "k_lin", "v")
INT_FIELDS = ("count", "fill")
INPUTS = ("q_quad", "k_quad", "q_lin", "k_lin", "v")
CUDA = torch.cuda.is_available()
FP32_ORDER_TOL = 1e-4  # fp32 sums of up to ~1e5 terms in another order
DEV = "cuda" if CUDA else "cpu"


def _inputs(B, T, H, S, E, C, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed * 1009 + T * 7 + S)
    xs = [torch.randn(B, T, H, S, generator=g, dtype=torch.float64) * 0.5 for _ in range(4)]
    xs.append(torch.randn(B, T, H, E, generator=g, dtype=torch.float64))
    rb = 0.5 * torch.randn(H, 2 * C - 1, generator=g, dtype=torch.float64)
    return [x.to(device, dtype) for x in xs], rb.to(device, dtype)


def _state(fills, counts, C, H, S, E, dtype, seed=1, device="cpu"):
    """A random state; buffer slots beyond ``fill`` hold junk that every form must ignore."""
    g = torch.Generator().manual_seed(seed)
    N = len(fills)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return MixedChunkState(
        kv=(rnd(N, H, S, E) * 3).to(device, acc), count=torch.tensor(counts, dtype=torch.long, device=device),
        k_quad=rnd(N, C, H, S).to(device, dtype), k_lin=rnd(N, C, H, S).to(device, dtype),
        v=rnd(N, C, H, E).to(device, dtype), fill=torch.tensor(fills, dtype=torch.long, device=device),
    )


def _cast_state(state, dtype):
    if state is None:
        return None
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return MixedChunkState(kv=state.kv.to(acc), count=state.count, k_quad=state.k_quad.to(dtype),
                           k_lin=state.k_lin.to(dtype), v=state.v.to(dtype), fill=state.fill)


def _run(backend, xs, rb, state, seed=3, launch=None, **kw):
    """Forward, final state and every gradient of one call, as a dict of named tensors; the
    loss weights every output element and every float field of the final state.  With ``launch``
    the call goes to the Triton entry with that launch configuration (``backend`` is then ignored)."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    rb = None if rb is None else rb.detach().clone().requires_grad_()
    if state is not None:
        state = MixedChunkState(**{
            f: getattr(state, f).detach().clone().requires_grad_(f in FLOAT_FIELDS) for f in FLOAT_FIELDS + INT_FIELDS
        })
    if launch is None:
        o, final = mixed_chunk_attention(*xs, rel_bias=rb, initial_state=state, backend=backend, **kw)
    else:
        from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention

        o, final = triton_mixed_chunk_attention(*xs, rel_bias=rb, initial_state=state, launch=launch, **kw)
    out = {"o": o}
    g = torch.Generator().manual_seed(seed)

    def w(x):
        return torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device)

    loss = (o.double() * w(o)).sum()
    if final is not None:
        out.update({f"final.{f}": getattr(final, f) for f in FLOAT_FIELDS + INT_FIELDS})
        for f in FLOAT_FIELDS:
            loss = loss + (getattr(final, f).double() * w(getattr(final, f))).sum()
    named = dict(zip(INPUTS, xs))
    if rb is not None:
        named["rel_bias"] = rb
    if state is not None:
        named.update({f"state.{f}": getattr(state, f) for f in FLOAT_FIELDS})
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    out.update({f"d{n}": torch.zeros_like(x) if gr is None else gr for (n, x), gr in zip(named.items(), grads)})
    return out


def _assert_exact_all(tag, ref, out):
    assert sorted(ref) == sorted(out), (sorted(ref), sorted(out))
    for name in ref:
        if name.split(".")[-1] in INT_FIELDS:
            assert torch.equal(ref[name].cpu(), out[name].cpu()), f"{tag} {name}"
        else:
            assert out[name].dtype == ref[name].dtype, f"{tag} {name} dtype {out[name].dtype}"
            assert_exact(f"{tag} {name}", ref[name], out[name])


def _assert_half_all(tag, ref64, out, base):
    for name in ref64:
        if name.split(".")[-1] in INT_FIELDS:
            assert torch.equal(ref64[name].cpu(), out[name].cpu()), f"{tag} {name}"
        elif name in ("final.kv", "dstate.kv"):
            # fp32 results of fp32 arithmetic on the same half inputs as the naive half run:
            # they differ by fp32 summation order only
            assert_close(f"{tag} {name}", base[name], out[name], FP32_ORDER_TOL)
        else:
            assert_half_rule(f"{tag} {name}", ref64[name], out[name], base[name])


# ------------------------------------------------------------------------ interpreter (CPU)

cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests: the CUDA tests below cover the compiled kernels")


@cpu_only
@pytest.mark.parametrize(
    "mode, norm, B, T, H, S, E, C",
    [
        ("causal", "tokens", 2, 37, 2, 20, 12, 16),  # two S tiles, partial tiles and chunks
        ("causal+state", "chunk", 2, 45, 1, 12, 40, 16),  # one S tile, three E tiles, mid-chunk state
        ("causal+state", "tokens", 1, 257, 1, 8, 8, 32),  # 9 chunks: several segments per sequence
        ("causal+state", "none", 1, 63, 1, 60, 20, 16),  # S = 60: four S tiles, T = 63
        ("noncausal", "chunk", 2, 63, 1, 60, 12, 32),
        ("noncausal", "tokens", 2, 37, 1, 20, 12, 16),
        ("noncausal", "none", 2, 1, 1, 4, 4, 16),
        ("causal", "none", 2, 1, 1, 4, 4, 16),
    ],
)
def test_matches_naive_fp32(mode, norm, B, T, H, S, E, C):
    """Forward, final state and every gradient (inputs, rel_bias, initial state) vs naive (the long and the wide
    states on one row: the batch index is the other cases')."""
    causal = mode != "noncausal"
    xs, rb = _inputs(B, T, H, S, E, C, torch.float32)
    state = _state([5, 0][:B], [2 * C, 3 * C][:B], C, H, S, E, torch.float32) if mode == "causal+state" else None
    kw = {"chunk_size": C, "causal": causal, "linear_norm": norm, "output_final_state": causal}
    _assert_exact_all(f"triton vs naive ({mode}, {norm}, T={T})", _run("naive", xs, rb, state, **kw),
                      _run("triton", xs, rb, state, **kw))


@cpu_only
@pytest.mark.parametrize("tma,red,causal", [(1, 1, True), (1, 1, False), (0, 0, True), (1, 0, True)],
                         ids=["tma-causal", "tma-noncausal", "pointers-causal", "tma_red_pointers-causal"])
def test_tma_and_pointer_paths(tma, red, causal, monkeypatch):
    """Both load paths at a shape where every tile is whole inside its head and chunk (S, E, C
    multiples of the interpreter's 16-wide tiles), so ``MixedChunkLaunch.tma`` decides which one runs: two heads
    (a head's tile is a column offset of the [B T, H D] view), packed sequences with short chunks
    (whole-tile loads read the next chunk's rows), an empty and a one-token sequence, an initial
    state with buffered tokens; forward, final state and every gradient vs naive (fp32 exact).  ``tma_red``: the
    fused backward reduction loads through descriptors as well (``MixedChunkLaunch.tma_red``, the default); its pointer loads
    with the other kernels on TMA: ``tma_red_pointers``."""
    taken = []
    real = launchers.tma_descriptors
    monkeypatch.setattr(launchers, "tma_descriptors",
                        lambda *specs: taken.append(real(*specs) is not None) or real(*specs))
    C, H, S, E = 32, 2, 32, 32
    # 70 tokens after 13 buffered ones: three chunks (19, 32, 19 new tokens: full chunks, then a short last one of a
    # whole walk step and a partial one), two segments; a short chunk of 13 alone; the last: a short chunk of one
    # whole walk step (16 tokens) at the end of the packed tokens
    lens = [70, 1, 0, 13, 16]
    launch = dataclasses.replace(default_launch(S, E, torch.float32, C), tma=bool(tma), tma_red=bool(red))
    assert plan.tma_shapes(launch, S, E, C, torch.device("cpu")) == bool(tma)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    xs, rb = _inputs(1, sum(lens), H, S, E, C, torch.float32, seed=12)
    st = _state([13, 0, 7, 0, 0], [2 * C, 0, C, 3 * C, C], C, H, S, E, torch.float32) if causal else None
    kw = {"chunk_size": C, "causal": causal, "output_final_state": causal, "cu_seqlens": cu}
    out = _run("triton", xs, rb, st, launch=launch, **kw)
    # the TMA run loaded through descriptors in both walks and both GEMMs (forward and backward), and with tma_red in
    # the fused reduction
    assert taken == ([True] * len(taken) if tma else []) and (len(taken) == 4 + red or not tma), taken
    _assert_exact_all(f"mixed chunk tma={tma} causal={causal}", _run("naive", xs, rb, st, **kw), out)


def _poison_new_empty(monkeypatch):
    """From here until ``monkeypatch.undo()``, floating tensors from ``Tensor.new_empty`` come filled with NaN."""
    real = torch.Tensor.new_empty

    def poisoned(self, *size, **kw):
        t = real(self, *size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)


@cpu_only
def test_unwritten_buffers_are_never_read(monkeypatch):
    """Full chunks on the TMA path, where the forward allocates ``A`` without filling it: every buffer the op gets
    from ``new_empty`` is filled with NaN, so a kernel that reads an entry nobody wrote (a causal tile above the
    diagonal, a step outside a tile's range) turns a result into NaN."""
    C, H, S, E = 32, 2, 32, 32
    launch = default_launch(S, E, torch.float32, C)
    assert plan.tma_shapes(launch, S, E, C, torch.device("cpu"))
    xs, rb = _inputs(1, 3 * C, H, S, E, C, torch.float32, seed=13)  # three chunks: two segments
    kw = {"chunk_size": C, "output_final_state": True}
    ref = _run("naive", xs, rb, None, **kw)
    _poison_new_empty(monkeypatch)
    out = _run("triton", xs, rb, None, launch=launch, **kw)
    monkeypatch.undo()
    _assert_exact_all("mixed chunk poisoned buffers", ref, out)


@cpu_only
def test_segment_lengths_agree():
    """One chunk per segment (G = 1: exact fp32 per-chunk states, nothing in registers), 3-chunk
    segments, and one segment per sequence all give the naive result (13 chunks, scale given)."""
    from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention

    C, H, S, E, T = 8, 1, 6, 5, 100
    xs, rb = _inputs(1, T, H, S, E, C, torch.float32, seed=4)
    state = _state([3], [16], C, H, S, E, torch.float32)
    kw = {"chunk_size": C, "rel_bias": rb, "scale": 0.3, "initial_state": state, "output_final_state": True}
    o_ref, s_ref = mixed_chunk_attention(*xs, backend="naive", **kw)
    base = default_launch(S, E, torch.float32, C)
    for G in (1, 3, 100):
        o, s = triton_mixed_chunk_attention(*xs, launch=dataclasses.replace(base, seg_chunks=G), **kw)
        assert_exact(f"G={G} o", o_ref, o)
        assert_exact(f"G={G} kv", s_ref.kv, s.kv)


def _rule_cases():
    """(SMs, sequences, T per sequence, cu_seqlens) over GPU-like shapes: 32k tokens in sequences of 2k-32k, packed
    and not, on devices of 4 to 1000 SMs."""
    for sms in (4, 132, 1000):
        for T in (2048, 4096, 8192, 16384, 32768):
            yield sms, 32768 // T, T, None
        yield sms, 1, 32768, torch.tensor([0, 16384, 32768])
        yield sms, 1, 32768, torch.tensor([0, 8192, 16384, 24576, 32768])


def test_segment_rule(monkeypatch):
    """The automatic chunks per segment of the state walk (``plan.seg_chunks``): one segment per sequence exactly
    where sequences x state tiles give every SM a program; otherwise the shortest segments (at least two chunks)
    whose walk programs number at most two per SM; an explicit ``seg_chunks`` wins (capped at the chunks); packed
    calls use the same rule on their chunk bound."""
    S, E, C, H = 128, 2048, 256, 1
    cfg = dataclasses.replace(default_launch(S, E, torch.bfloat16, C), seg_chunks=0)
    dev = torch.device("cpu")
    tiles = H * math.ceil(S / cfg.bs_state) * math.ceil(E / cfg.be_state)
    for sms, B, T, cu in _rule_cases():
        monkeypatch.setattr(plan, "sm_count", lambda device, sms=sms: sms)
        nct = segments.chunk_bound(B, T, C, cu)
        n = B if cu is None else cu.numel() - 1
        G = plan.seg_chunks(B, T, H, S, E, C, cu, cfg, dev)
        assert 1 <= G <= nct
        if n * tiles >= sms:
            assert G == nct  # one segment per sequence
        else:
            want = max(1, 2 * sms // tiles)  # segments for two walk programs per SM
            assert G == nct or (G >= 2 and (G == 2 or math.ceil(nct / (G - 1)) > want) and math.ceil(nct / G) <= want)
        for k in (1, 4, 10**6):
            assert plan.seg_chunks(B, T, H, S, E, C, cu, dataclasses.replace(cfg, seg_chunks=k), dev) == min(k, nct)


def test_walk_tile_rule(monkeypatch):
    """The state walk's ``S`` tile is halved (:meth:`MixedChunkLaunch.thin_walk`) exactly where that alone gives
    every SM a walk program with one segment per sequence (sequences x tiles short of the SM count, enough at half
    the tile), and nothing else changes; never with explicit segments or tiles already 64 high; packed calls count
    their sequences."""
    from lintime.ops.mixed_chunk.triton import launch as mc_launch

    S, E, C, H = 128, 2048, 256, 1
    cfg = dataclasses.replace(default_launch(S, E, torch.bfloat16, C), bs_state=128, seg_chunks=0)
    dev = torch.device("cpu")

    def tiles(c):
        return H * math.ceil(S / c.bs_state) * math.ceil(E / c.be_state)

    mc_launch._thin_walk.cache_clear()
    try:
        for sms, B, T, cu in _rule_cases():
            monkeypatch.setattr(mc_launch, "sm_count", lambda device, sms=sms: sms)
            monkeypatch.setattr(plan, "sm_count", lambda device, sms=sms: sms)
            mc_launch._thin_walk.cache_clear()
            n = B if cu is None else cu.numel() - 1
            thin = cfg.thin_walk(n, H, S, E, dev)
            halved = n * tiles(cfg) < sms <= n * tiles(dataclasses.replace(cfg, bs_state=cfg.bs_state // 2))
            assert thin == (dataclasses.replace(cfg, bs_state=cfg.bs_state // 2) if halved else cfg)
            if halved:  # one segment per sequence on the thin tiles
                assert plan.seg_chunks(B, T, H, S, E, C, cu, thin, dev) == segments.chunk_bound(B, T, C, cu)
            for other in ({"seg_chunks": 16}, {"bs_state": 64}):
                c2 = dataclasses.replace(cfg, **other)
                assert c2.thin_walk(n, H, S, E, dev) is c2
    finally:
        mc_launch._thin_walk.cache_clear()


def test_launch_config_round_trips():
    """Every default configuration crosses a custom op as ints and back unchanged, and its tiles are powers of two
    (the kernels' ``tl.arange`` sizes)."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for S, E, C in ((8, 12, 8), (128, 2048, 256), (64, 100, 48)):
            cfg = default_launch(S, E, dtype, C)
            assert type(cfg).from_ints(cfg.to_ints()) == cfg
            for f in ("bg", "bs", "bk", "be_fwd", "be_dv", "be_red", "bg_red", "bt", "bs_state", "be_state", "fix_bs",
                      "dec_bc", "dec_be", "dec_be_wide"):
                x = getattr(cfg, f)
                assert x > 0 and x & (x - 1) == 0, (f, x)


@cpu_only
def test_packed_plan_and_check_cached_per_cu_seqlens(monkeypatch):
    """A packed call's plan and the values check of ``cu_seqlens`` are done once per tensor
    (:func:`lintime.ops.utils.packed_cache`): further calls and backward passes with the same tensor (a model's
    layers) skip them; an in-place write or another tensor redoes them, and a bad ``cu_seqlens`` is still refused."""
    from lintime.ops import mixed_chunk_attention
    from lintime.ops import utils as ou

    builds, checks = [], []
    real_build, real_check = plan.chunk_plan, ou.check_cu_seqlens_values
    monkeypatch.setattr(plan, "chunk_plan", lambda *a: builds.append(1) or real_build(*a))
    monkeypatch.setattr(ou, "check_cu_seqlens_values", lambda *a: checks.append(1) or real_check(*a))
    lens = [40, 1, 0, 23]
    xs, _ = _inputs(1, sum(lens), 1, 8, 8, 16, torch.float32, seed=31)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def run(cu_):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        o, _ = mixed_chunk_attention(*leaves, chunk_size=16, cu_seqlens=cu_, backend="triton")
        return [o, *torch.autograd.grad(o.square().sum(), leaves)]

    first = run(cu)
    second = run(cu)
    assert (len(builds), len(checks)) == (1, 1)  # two forwards and backwards: one plan, one check
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    cu[2:4] = 45  # in place (sequences of 40, 5, 0, 19): the plan and the check are redone
    moved = run(cu)
    assert (len(builds), len(checks)) == (2, 2)
    ref = run(cu.clone())  # another tensor: redone again, same results
    assert (len(builds), len(checks)) == (3, 3)
    assert all(torch.equal(a, b) for a, b in zip(moved, ref))
    cu[2] = 100  # out of order: refused even though this tensor passed before
    with pytest.raises(ValueError):
        run(cu)


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_fp16_half_precision_rule(causal):
    """fp16 through the kernels (fp16 products, fp32 states at tf32) vs the fp64 naive: at most
    twice the naive-fp16 error (plus the floor), forward and every gradient."""
    C, H, S, E, T = 16, 1, 32, 16, 50
    xs64, rb64 = _inputs(2, T, H, S, E, C, torch.float64, seed=5)
    xs, rb = [x.half() for x in xs64], rb64.half()
    kw = {"chunk_size": C, "causal": causal, "output_final_state": causal}
    ref = _run("naive", xs64, rb64, None, **kw)
    base = _run("naive", xs, rb, None, **kw)
    out = _run("triton", xs, rb, None, **kw)
    assert out["o"].dtype == torch.float16
    _assert_half_all(f"fp16 causal={causal}", ref, out, base)


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_packing_matches_naive(causal):
    """Packed sequences (one of length 1, one empty, per-sequence states with partial chunks)."""
    C, H, S, E = 8, 1, 5, 6
    lens = [13, 1, 0, 21, 8]
    xs, rb = _inputs(1, sum(lens), H, S, E, C, torch.float32, seed=7)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    state = _state([3, 7, 2, 0, 5], [8, 0, 16, 24, 0], C, H, S, E, torch.float32) if causal else None
    kw = {"chunk_size": C, "causal": causal, "output_final_state": causal, "cu_seqlens": cu}
    _assert_exact_all(f"packed causal={causal}", _run("naive", xs, rb, state, **kw), _run("triton", xs, rb, state, **kw))


@cpu_only
def test_continuation_equals_one_call():
    """Pieces (mid-chunk, at a boundary, empty, one token) passed along by the state equal one
    naive call: outputs, final state and the gradients of the first state and every input."""
    C, H, S, E, T = 8, 1, 6, 5, 30
    xs, rb = _inputs(2, T, H, S, E, C, torch.float32, seed=3)
    state = _state([6, 1], [C, 0], C, H, S, E, torch.float32)
    kw = {"chunk_size": C, "linear_norm": "tokens"}
    one = _run("naive", xs, rb, state, output_final_state=True, **kw)

    def pieces(*leaves):
        *ins, rbl, kv, kq, kl, v = leaves
        st = MixedChunkState(kv=kv, count=state.count, k_quad=kq, k_lin=kl, v=v, fill=state.fill)
        outs = []
        for s, e in [(0, 5), (5, 5), (5, 16), (16, 17), (17, 30)]:
            o, st = mixed_chunk_attention(*[x[:, s:e] for x in ins], rel_bias=rbl, initial_state=st,
                                          output_final_state=True, backend="triton", **kw)
            outs.append(o)
        return torch.cat(outs, 1), st

    leaves = [x.clone().requires_grad_() for x in [*xs, rb, state.kv, state.k_quad, state.k_lin, state.v]]
    o, final = pieces(*leaves)
    g = torch.Generator().manual_seed(3)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64)).sum()
    for f in FLOAT_FIELDS:
        x = getattr(final, f)
        loss = loss + (x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, leaves)
    got = {"o": o, **{f"final.{f}": getattr(final, f) for f in FLOAT_FIELDS + INT_FIELDS}}
    names = [f"d{n}" for n in INPUTS] + ["drel_bias"] + [f"dstate.{f}" for f in FLOAT_FIELDS]
    got.update(dict(zip(names, grads)))
    _assert_exact_all("continued (triton)", one, got)


@cpu_only
def test_eager_unused_outputs():
    """Eager calls run an autograd.Function that passes ``None`` (no zero tensors) for the gradients
    of unused outputs: a loss on the output alone, or on the final kv alone (the backward then
    has no output gradient at all), gives the naive form's gradients."""
    C, H, S, E, T = 16, 1, 8, 8, 40
    xs, _ = _inputs(1, T, H, S, E, C, torch.float32, seed=5)
    state = _state([0], [16], C, H, S, E, torch.float32)
    for use in ("o", "kv"):
        res = {}
        for backend in ("naive", "triton"):
            leaves = [x.clone().requires_grad_() for x in xs] + [state.kv.clone().requires_grad_()]
            st = MixedChunkState(kv=leaves[-1], count=state.count, k_quad=state.k_quad, k_lin=state.k_lin,
                                 v=state.v, fill=state.fill)
            o, fin = mixed_chunk_attention(*leaves[:5], initial_state=st, output_final_state=True, backend=backend,
                                           chunk_size=C)
            x = o if use == "o" else fin.kv
            g = torch.Generator().manual_seed(6)
            loss = (x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64)).sum()
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            res[backend] = [torch.zeros_like(y) if gr is None else gr for y, gr in zip(leaves, grads)]
        for name, a, b in zip([*INPUTS, "kv0"], res["naive"], res["triton"]):
            assert_exact(f"loss on {use}: d{name}", a, b)


@cpu_only
def test_torch_compile_traces_the_custom_ops():
    """``torch.compile`` (aot_eager: fake tensors, no code generation) traces forward and
    backward through ``lintime::mixed_chunk_fwd`` / ``mixed_chunk_bwd`` and gives the eager result."""
    C, H, S, E, T = 8, 1, 4, 6, 20
    xs, rb = _inputs(1, T, H, S, E, C, torch.float32, seed=2)

    def f(*a):
        o, st = mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, output_final_state=True,
                                      backend="triton")
        return o, st.kv

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=False)
    leaves = [x.clone().requires_grad_() for x in [*xs, rb]]
    o, kv = compiled(*leaves)
    g1 = torch.autograd.grad((o.sum() + kv.sum()), leaves)
    leaves2 = [x.clone().requires_grad_() for x in [*xs, rb]]
    o2, kv2 = f(*leaves2)
    g2 = torch.autograd.grad((o2.sum() + kv2.sum()), leaves2)
    assert_exact("compiled o", o2, o)
    for a, b in zip(g2, g1):
        assert_exact("compiled grad", a, b)


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_opcheck(causal):
    """``torch.library.opcheck``: schema, fake tensors, autograd registration and AOT tracing of
    ``lintime::mixed_chunk_fwd`` (causal: with an initial kv and count; non-causal: packed)."""
    from lintime.ops.mixed_chunk.triton.mixed_chunk import mixed_chunk_fwd

    C, S, E = 8, 8, 12
    xs, rb = _inputs(1, 20, 1, S, E, C, torch.float32, seed=6)
    xs = [x.requires_grad_() for x in xs]
    rb.requires_grad_()
    launch = default_launch(S, E, torch.float32, C).to_ints()
    if causal:
        kv0 = torch.randn(1, 1, S, E, requires_grad=True)
        args = (*xs, rb, kv0, torch.tensor([8]), None, C, True, 1 / C, "tokens", True, launch)
    else:
        cu = torch.tensor([0, 7, 20], dtype=torch.int32)
        args = (*xs, rb, None, None, cu, C, False, 1 / C, "chunk", True, launch)
    torch.library.opcheck(mixed_chunk_fwd.op, args)


@cpu_only
def test_fp64_and_empty_calls_fall_back_to_chunk():
    xs, rb = _inputs(1, 10, 1, 4, 4, 4, torch.float64)
    o, _ = mixed_chunk_attention(*xs, chunk_size=4, rel_bias=rb, backend="triton")
    o_ref, _ = mixed_chunk_attention(*xs, chunk_size=4, rel_bias=rb, backend="naive")
    assert_exact("fp64", o_ref, o)
    state = _state([2], [4], 4, 1, 4, 4, torch.float32)
    empty = [x[:, :0].float() for x in xs]
    o, s = mixed_chunk_attention(*empty, chunk_size=4, initial_state=state, output_final_state=True, backend="triton")
    assert o.shape == (1, 0, 1, 4) and torch.equal(s.kv, state.kv) and s.fill.tolist() == [2]


# ------------------------------------------------------------------------ CUDA, real sizes

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["causal", "causal+state", "noncausal"])
def test_cuda_real_size_half_rule(dtype, mode):
    """FLASH's shape (H = 1, S = 128, E = 2048, C = 256) at T = 2085 (a partial chunk) in half
    precision vs the fp64 naive: forward, final state and every gradient."""
    C, H, S, E, T, B = 256, 1, 128, 2048, 2085, 2
    causal = mode != "noncausal"
    xs64, rb64 = _inputs(B, T, H, S, E, C, torch.float64, device="cuda")
    st64 = _state([100, 0], [2 * C, 0], C, H, S, E, torch.float64, device="cuda") if mode == "causal+state" else None
    kw = {"chunk_size": C, "causal": causal, "output_final_state": causal}
    ref = _run("naive", xs64, rb64, st64, **kw)
    xs, rb, st = [x.to(dtype) for x in xs64], rb64.to(dtype), _cast_state(st64, dtype)
    base = _run("naive", xs, rb, st, **kw)
    out = _run("triton", xs, rb, st, **kw)
    _assert_half_all(f"cuda {dtype} {mode}", ref, out, base)


@cuda
@needs_cuda
def test_cuda_unwritten_buffers_are_never_read(monkeypatch):
    """The interpreter test of the same name at FLASH's shape in bf16 (full chunks, TMA on Hopper): buffers from
    ``new_empty`` filled with NaN, so a read of an unwritten entry shows; vs the fp64 naive by the half rule."""
    C, H, S, E, T, B = 256, 1, 128, 2048, 2048, 2
    dtype = torch.bfloat16
    launch = default_launch(S, E, dtype, C)
    xs64, rb64 = _inputs(B, T, H, S, E, C, torch.float64, device="cuda", seed=14)
    kw = {"chunk_size": C, "output_final_state": True}
    ref = _run("naive", xs64, rb64, None, **kw)
    xs, rb = [x.to(dtype) for x in xs64], rb64.to(dtype)
    base = _run("naive", xs, rb, None, **kw)
    _poison_new_empty(monkeypatch)
    out = _run("triton", xs, rb, None, launch=launch, **kw)
    monkeypatch.undo()
    _assert_half_all("cuda poisoned buffers", ref, out, base)


@cuda
@needs_cuda
@pytest.mark.parametrize("S, E, tma", [(160, 300, False), (128, 256, True)], ids=["pointers", "tma"])
def test_cuda_fp32_exact_packed(S, E, tma):
    """fp32 kernels (exact fp32 products) vs naive fp32, packed sequences (short chunks) with states,
    C = 128, two heads: S = 160 (two S tiles), E = 300 (partial E tiles) on the pointer path; S = 128,
    E = 256 on the TMA path (on Hopper)."""
    C, H = 128, 2
    dev = torch.device("cuda")
    assert plan.tma_shapes(default_launch(S, E, torch.float32, C), S, E, C, dev) == (
        tma and torch.cuda.get_device_capability(dev)[0] >= 9)
    lens = [700, 1, 0, 300, 129]
    xs, rb = _inputs(1, sum(lens), H, S, E, C, torch.float32, device="cuda", seed=8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    st = _state([3, 7, 2, 0, 127], [128, 0, 256, 0, 0], C, H, S, E, torch.float32, device="cuda")
    kw = {"chunk_size": C, "output_final_state": True, "cu_seqlens": cu, "linear_norm": "chunk"}
    _assert_exact_all("cuda fp32 packed", _run("naive", xs, rb, st, **kw), _run("triton", xs, rb, st, **kw))


@cuda
@needs_cuda
@pytest.mark.parametrize("T", [1100, 16384])
def test_cuda_graph_capture_two_streams(T, monkeypatch):
    """While a CUDA graph is captured the backward forks its reductions onto a second stream and joins it; eager
    calls keep one stream.  The replayed forward + backward equal the eager ones exactly
    (the kernels are deterministic without a bias gradient), for one sequence per state-walk segment (T = 1100, a
    short last chunk) and for segments with the start fix-up (T = 16384)."""
    forks = []
    fork = launchers._Side.fork
    monkeypatch.setattr(launchers._Side, "fork", lambda self: (forks.append(1), fork(self))[1])
    C, H, S, E, B = 256, 1, 128, 2048, 2
    xs = [x.bfloat16().requires_grad_() for x in _inputs(B, T, H, S, E, C, torch.float64, device="cuda", seed=5)[0]]
    do = torch.randn(B, T, H, E, device="cuda").bfloat16()

    def step():
        o = mixed_chunk_attention(*xs, chunk_size=C, backend="triton")[0]
        return (o, *torch.autograd.grad(o, xs, do))

    from lintime.bench.measure import capture_graph

    eager = [t.detach().clone() for t in step()]
    torch.cuda.synchronize()
    assert not forks  # eager: one stream
    graph, out = capture_graph(step)
    for t in out:
        t.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert forks  # captured with the second stream
    for name, a, b in zip(("o", "dqq", "dkq", "dql", "dkl", "dv"), eager, out, strict=True):
        assert torch.equal(a, b), f"graph replay differs from eager: {name}"


@cuda
@needs_cuda
def test_cuda_long_sequence_segments():
    """T = 32768 in one sequence (the state pass is cut into segments across the SMs) vs the
    chunked PyTorch form in fp64, bf16 by the half-precision rule."""
    C, H, S, E, T = 256, 1, 128, 2048, 32768
    xs64, _ = _inputs(1, T, H, S, E, C, torch.float64, device="cuda", seed=9)
    kw = {"chunk_size": C, "rel_bias": None, "output_final_state": True}
    with torch.no_grad():
        ref, s_ref = mixed_chunk_attention(*xs64, backend="chunk", **kw)
        xs = [x.bfloat16() for x in xs64]
        base, _ = mixed_chunk_attention(*xs, backend="chunk", **kw)
        out, s = mixed_chunk_attention(*xs, backend="triton", **kw)
    assert_half_rule("cuda T=32768 o", ref, out, base)
    assert_half_rule("cuda T=32768 kv", s_ref.kv.float(), s.kv.bfloat16(), s_ref.kv.bfloat16())
