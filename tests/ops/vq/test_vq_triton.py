"""vq_attention, backend 'triton': the fused kernels against the naive and chunked forms -- forward, final state
and every gradient (q, v, bias, codebook through k_hat = codebook[codes], the initial state's float fields),
odd lengths, packing, continuation at any split, with and without a bias.

On the CPU through the Triton interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1``) with 16-wide tiles
(:func:`lintime.ops.vq.triton.launch.default_launch`), so small shapes cross several query tiles per block, window
tiles that straddle the block boundary, partial code and value tiles: fp32 by the exact rule, fp16 by the
half-precision rule (``tl.dot`` on bf16 is wrong in the interpreter).  The ``cuda`` tests repeat the checks at the
vq-base shape (``K = 128, V = 1536, S = L = 512``) in bf16 and fp32.  Tolerances: tests/tolerances.py, as in
tests/ops/vq/test_vq.py, whose input helpers these tests share.
"""

import itertools

import pytest
import torch
from test_vq import FIELDS, FLOAT_FIELDS, _assert_same, _inputs, _state

import lintime.ops.vq as vq_mod
from lintime.ops import VQState, vq_attention
from tolerances import assert_exact, assert_half_rule

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
cuda = pytest.mark.cuda
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests: the CUDA tests below cover the compiled kernels")


def _gather(codebook, codes):
    """``codebook[h, codes[..., h]]`` (test_vq's, with the head index on ``codes``' device)."""
    heads = torch.arange(codebook.shape[0], device=codes.device).expand_as(codes)
    return codebook[heads, codes]


def _make_state(sd, codebook):
    k = _gather(codebook, sd["codes"]) * sd["live"][..., None, None]
    return VQState(sd["cache_mean"], sd["cache_count"], k, sd["v"], sd["codes"], sd["pos"])


def _run(backend, inp, L, *, reduction="serial", sd=None, cu=None, bias=True, device="cpu"):
    """Output, final state and the gradient of every float leaf (inputs, initial state) of one call, for a loss
    over the output and the final state's float fields (fixed random weights).  ``inp`` / ``sd`` as made by
    test_vq's ``_inputs`` / ``_state``, moved to ``device``."""
    mv = lambda x: x.to(device)
    leaves = {k: mv(x).requires_grad_() for k, x in inp.items() if x.is_floating_point() and (bias or k != "bias")}
    state = None
    if sd is not None:
        st_leaves = {k: mv(sd[k]).requires_grad_() for k in ("cache_mean", "cache_count", "v")}
        leaves.update({f"st_{k}": x for k, x in st_leaves.items()})
        state = _make_state({**{k: mv(x) for k, x in sd.items()}, **st_leaves}, leaves["codebook"])
    codes = mv(inp["codes"])
    o, fin = vq_attention(
        leaves["q"], _gather(leaves["codebook"], codes), codes, leaves["v"], leaves["codebook"], block_len=L,
        bias=leaves.get("bias"), reduction=reduction, initial_state=state, output_final_state=True,
        cu_seqlens=None if cu is None else mv(cu), backend=backend,
    )
    g = torch.Generator().manual_seed(7)
    w = lambda x: torch.randn(x.shape, generator=g, dtype=torch.float64).to(device)
    loss = (o.double() * w(o)).sum()
    for f in FLOAT_FIELDS:
        x = getattr(fin, f)
        loss = loss + (x.double() * w(x)).sum()
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    if sd is not None:  # d/d count is one-sided at a count of 0 (log 0 = -inf): compared on counts > 0
        grads["st_cache_count"] = grads["st_cache_count"] * (mv(sd["cache_count"]) > 0)
    return o, fin, grads


def _half_rule(name, ref, out, base):
    """Output, final float state and every gradient of ``out`` (a half-precision run) within the half rule of
    the fp64 run ``ref``, ``base`` the naive form in the same half dtype; integer fields equal."""
    assert_half_rule(f"{name} o", ref[0], out[0], base[0])
    for f in FIELDS:
        x, y, z = getattr(ref[1], f), getattr(out[1], f), getattr(base[1], f)
        if f in FLOAT_FIELDS:
            if f.startswith("cache"):  # fp32 in every form, from the same half inputs: the exact fp32 rule
                assert y.dtype == z.dtype == torch.float32
                assert_exact(f"{name} state.{f}", z, y)
            else:
                assert y.dtype == out[0].dtype
                assert_half_rule(f"{name} state.{f}", x, y, z)
        else:
            assert torch.equal(x, y), (name, f)
    for k in ref[2]:
        g = out[2][k]
        half = out[0].dtype
        assert_half_rule(f"{name} d{k}", ref[2][k], g if g.dtype == half else g.to(half), base[2][k].to(half))


def _to(inp, dtype):
    return {k: x.to(dtype) if x.is_floating_point() else x for k, x in inp.items()}


# ------------------------------------------------------------------------ interpreter (CPU)


@cpu_only
@pytest.mark.parametrize(
    "B, T, H, K, V, S, L, pos, reduction",
    [
        # two query tiles per block, window tiles across the block boundary, a mid-block state
        (2, 45, 1, 20, 24, 10, 20, [37, 5], "serial"),
        # blocks shorter than a tile, three value tiles, two heads, no state
        (1, 23, 2, 16, 40, 16, 8, None, "assoc"),
    ],
)
def test_matches_naive_and_chunk_fp32(B, T, H, K, V, S, L, pos, reduction):
    """fp32: output, final state and every gradient equal the naive and the chunked forms' (exact rule)."""
    inp = _inputs(B, T, H, K, V, S, L, torch.float32, seed=T)
    sd = None if pos is None else _state(pos, H, K, V, S, L, torch.float32)
    out = _run("triton", inp, L, reduction=reduction, sd=sd)
    assert torch.isfinite(out[0]).all()
    _assert_same("triton vs naive", _run("naive", inp, L, sd=sd), out)
    _assert_same("triton vs chunk", _run("chunk", inp, L, reduction=reduction, sd=sd), out)


@cpu_only
def test_without_bias_and_length_one():
    """No bias (a separate kernel variant) equals the chunked form; so does a one-token call continuing a state
    at a block end (backend named: the automatic choice for T = 1 is the recurrent form)."""
    H, K, V, S, L = 1, 16, 12, 8, 8
    inp = _inputs(1, 30, H, K, V, S, L, torch.float32, seed=4)
    _assert_same("no bias", _run("chunk", inp, L, bias=False), _run("triton", inp, L, bias=False))
    one = _inputs(2, 1, H, K, V, S, L, torch.float32, seed=5)
    sd = _state([2 * L, 3], H, K, V, S, L, torch.float32)
    _assert_same("T = 1", _run("naive", one, L, sd=sd), _run("triton", one, L, sd=sd))


def _training_case(reduction, lens, *, B=2, T=32, H=1, K=16, V=20, S=6, L=8, device="cpu"):
    """Output and input gradients of the chunked and the Triton forms for one training call (no state in or out;
    ``lens``: packed sequences, else ``B`` rows of ``T``), queries and bias strided slices of wider tensors, fp32;
    compared by the exact rule."""
    if lens is not None:
        B, T = 1, sum(lens)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    inp = {k: x.to(device) for k, x in _inputs(B, T, H, K, V, S, L, torch.float32, seed=21).items()}
    outs = {}
    for backend in ("chunk", "triton"):
        lv = {k: x.clone().requires_grad_() for k, x in inp.items() if x.is_floating_point()}
        wide = lambda x: torch.cat([x, 2 * x], -1)[..., : x.shape[-1]]  # same values, not contiguous
        o, fin = vq_attention(wide(lv["q"]), _gather(lv["codebook"], inp["codes"]), inp["codes"], lv["v"],
                              lv["codebook"], block_len=L, bias=wide(lv["bias"]), reduction=reduction, cu_seqlens=cu,
                              backend=backend)
        assert fin is None
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).to(device)
        outs[backend] = (o, *torch.autograd.grad((o * w).sum(), list(lv.values())))
    names = ["o", *(f"d{k}" for k, x in inp.items() if x.is_floating_point())]
    for name, a, b in zip(names, outs["chunk"], outs["triton"]):
        assert_exact(f"training call {name}", a, b)


@cpu_only
@pytest.mark.parametrize("reduction, lens", [("serial", None), ("matmul", None), ("serial", [16, 16, 16]),
                                             ("serial", [8, 24, 0, 16])])
def test_training_call_without_final_state(reduction, lens):
    """The training call -- no state in or out, sequences of whole blocks (rows, or packed of equal or unequal
    lengths): the scan keeps no fp32 means, only each query block's cache means in the inputs' dtype, and the
    block layout is the tokens' own order.  Output and every gradient equal the chunked form's."""
    _training_case(reduction, lens)


@cpu_only
def test_state_at_block_ends_matches_naive():
    """States at block ends (positions multiples of L, one at 0) and whole blocks: queries in the tokens' order,
    keys through the layout with the state's buffers; output, final state and every gradient equal the naive
    form's."""
    H, K, V, S, L = 1, 16, 12, 5, 8
    inp = _inputs(3, 16, H, K, V, S, L, torch.float32, seed=9)
    sd = _state([8, 0, 24], H, K, V, S, L, torch.float32)
    _assert_same("block-end state", _run("naive", inp, L, sd=sd), _run("triton", inp, L, sd=sd))


@cpu_only
def test_packing_with_states_matches_naive():
    """Packed sequences (one of length 1, one empty) each continuing its own state (mid-block, at 0, at a block
    end): no token attends across a boundary, in the window or the cache."""
    H, K, V, S, L = 1, 16, 6, 5, 4
    lens = [5, 1, 0, 22, 13]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    inp = _inputs(1, sum(lens), H, K, V, S, L, torch.float32, seed=8)
    sd = _state([6, 0, 8, 13, 4], H, K, V, S, L, torch.float32)
    _assert_same("packed", _run("naive", inp, L, sd=sd, cu=cu), _run("triton", inp, L, reduction="matmul", sd=sd,
                                                                        cu=cu))


def _continue(inp, splits, L, sd):
    """``inp`` as consecutive Triton calls cut at ``splits`` from the state ``sd``: output, final state and the
    gradients of the inputs, of a leaf ``k_hat`` and of the state's float fields."""
    leaves = {k: x.clone().requires_grad_() for k, x in inp.items() if x.is_floating_point()}
    k_leaf = _gather(inp["codebook"], inp["codes"]).requires_grad_()
    st_leaves = {k: sd[k].clone().requires_grad_() for k in ("cache_mean", "cache_count", "v")}
    state = _make_state({**sd, **st_leaves}, leaves["codebook"])
    os = []
    for a, b in itertools.pairwise([0, *splits, inp["q"].shape[1]]):
        sl = lambda x, a=a, b=b: x[:, a:b]
        o, state = vq_attention(sl(leaves["q"]), sl(k_leaf), sl(inp["codes"]), sl(leaves["v"]), leaves["codebook"],
                                block_len=L, bias=sl(leaves["bias"]), initial_state=state, output_final_state=True,
                                backend="triton")
        os.append(o)
    o = torch.cat(os, 1)
    g = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=g)).sum()
    for f in FLOAT_FIELDS:
        x = getattr(state, f)
        loss = loss + (x * torch.randn(x.shape, generator=g, dtype=x.dtype)).sum()
    ls = {**leaves, "k_hat": k_leaf, **{f"state.{k}": x for k, x in st_leaves.items()}}
    grads = dict(zip(ls, torch.autograd.grad(loss, list(ls.values()))))
    grads["state.cache_count"] = grads["state.cache_count"] * (sd["cache_count"] > 0)
    return o, state, grads


@cpu_only
def test_continuation_at_any_split():
    """One call == calls cut mid-block, at a block end, into an empty call: output, final state and every
    gradient (leaf k_hat: windowed keys' gradients go to k_hat, cached ones' to the codebook, in both runs)."""
    H, K, V, S, L, T = 1, 16, 5, 6, 8, 40
    inp = _inputs(2, T, H, K, V, S, L, torch.float32, seed=12)
    sd = _state([19, 3], H, K, V, S, L, torch.float32)
    one, many = _continue(inp, [], L, sd), _continue(inp, [13, 21, 21], L, sd)
    assert_exact("split o", one[0], many[0])
    for f in FIELDS:
        x, y = getattr(one[1], f), getattr(many[1], f)
        if f in FLOAT_FIELDS:
            assert_exact(f"split state.{f}", x, y)
        else:
            assert torch.equal(x, y), f
    for k in one[2]:
        assert_exact(f"split d{k}", one[2][k], many[2][k])


@cpu_only
def test_fp16_half_rule():
    """fp16 through the interpreter: output, final state and every gradient within the half-precision rule of
    the fp64 naive form (base: the naive form in fp16)."""
    H, K, V, S, L, T = 1, 32, 32, 16, 16, 40
    inp = _inputs(1, T, H, K, V, S, L, torch.float64, seed=2)
    sd = _state([21], H, K, V, S, L, torch.float64)
    sd16 = {k: x.to(torch.float16) if x.is_floating_point() and k != "cache_count" else x for k, x in sd.items()}
    sd16["cache_mean"], sd16["cache_count"] = sd["cache_mean"].float(), sd["cache_count"].float()
    ref = _run("naive", inp, L, sd=sd)
    base = _run("naive", _to(inp, torch.float16), L, sd=sd16)
    out = _run("triton", _to(inp, torch.float16), L, sd=sd16)
    assert out[0].dtype == torch.float16
    _half_rule("triton fp16", ref, out, base)


@cpu_only
def test_custom_ops_pass_opcheck():
    """Schema, fake tensors and autograd registration of ``lintime::vq_fwd`` / ``lintime::vq_bwd`` on one query
    block (flat block 2, after a pseudo-block and a previous block), and of ``lintime::vq_scan`` / ``_bwd``.
    Not ``test_aot_dispatch_dynamic``: about 5 s of tracing on the CPU (CI budget)."""
    from lintime.ops.vq.triton.launch import default_launch

    g = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g)
    L, H, K, V, S = 4, 1, 16, 16, 5
    q, k, v = r(1, L, H, K), r(3, L, H, K), r(3, L, H, V)
    kvalid = torch.tensor([0] * L + [1] * (2 * L), dtype=torch.int8)
    qblk, qa, qb = (torch.tensor(x, dtype=torch.int32) for x in ([2], [-1, -1, 0], [-1, 0, -1]))
    pvalid = torch.tensor([1], dtype=torch.int8)
    cb, cm = r(H, S, K), r(1, H, S, V)
    logc = torch.tensor([[[0.0, float("-inf"), 1.0, 0.5, float("-inf")]]])
    launch = default_launch(K, V, torch.float32).to_ints()
    args = [q, k, v, kvalid, qblk, pvalid, qa, qb, r(1, L, H, 2 * L), cb, logc, cm]
    utils = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(torch.ops.lintime.vq_fwd, (*[x.requires_grad_() if x.is_floating_point() else x
                                                       for x in args], L, False, launch), test_utils=utils)
    o, pw, pc = torch.ops.lintime.vq_fwd(*[x.detach() for x in args], L, False, launch)
    torch.library.opcheck(torch.ops.lintime.vq_bwd, (r(1, L, H, V), *[x.detach() for x in args], o, pw, pc, L,
                                                     False, launch), test_utils=utils)
    first = torch.tensor([[1, 0, 0, 1, 0]], dtype=torch.int8)
    cnt, sumv = torch.randint(0, 3, (1, 5, H, S), generator=g).float(), r(1, 5, H, S, V)
    qmap = torch.tensor([-1, 1, -1, 0, -1], dtype=torch.int32)
    torch.library.opcheck(torch.ops.lintime.vq_scan, (first, cnt.requires_grad_(), sumv.requires_grad_(), qmap, 2,
                                                      True, torch.float16), test_utils=utils)
    tot, mean, cm = torch.ops.lintime.vq_scan(first, cnt.detach(), sumv.detach(), qmap, 2, True, torch.float16)
    torch.library.opcheck(torch.ops.lintime.vq_scan_bwd, (first, cnt.detach(), tot, mean, qmap, r(1, 5, H, S),
                                                          r(1, 5, H, S, V), r(2, H, S, V).half(), True),
                          test_utils=utils)


def test_scatter_sums_equal_block_sums():
    """The Triton path's per-block sums (scatter-adds) equal the chunked form's one-hot products, with empty
    slots (zero values, random codes, as the block layout leaves them) and empty codes."""
    from lintime.ops.vq.state import block_sums
    from lintime.ops.vq.state import scatter_sums

    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 7, (3, 5, 6, 2), generator=g)
    v = torch.randn(3, 5, 6, 2, 4, generator=g, dtype=torch.float64)
    valid = torch.rand(3, 5, 6, generator=g) > 0.3
    v = v * valid[..., None, None]
    (c0, s0), (c1, s1) = block_sums(codes, v, valid, 9), scatter_sums(codes, v, valid, 9)
    assert torch.equal(c0, c1) and (c1[..., 7:] == 0).all()
    assert_exact("scatter sums", s0, s1)


@cpu_only
def test_sum_grad_kernel_is_the_row_gather():
    """``lintime::vq_sum_grad`` (the one-hot sums' backward on CUDA) through the interpreter: each valid slot's
    row of the gradient at its code, zero for an empty slot (fp32 output: exact)."""
    from lintime.ops.vq.triton.scan import vq_sum_grad_op

    g = torch.Generator().manual_seed(3)
    G, L, H, S, V = 3, 7, 2, 5, 20
    grad = torch.randn(G, H, S, V, generator=g)
    codes = torch.randint(0, S, (G, L, H), generator=g)
    valid = (torch.rand(G, L, generator=g) > 0.3).to(torch.int8)
    want = grad[torch.arange(G)[:, None, None], torch.arange(H)[None, None, :], codes] * valid[..., None, None]
    assert torch.equal(vq_sum_grad_op(grad, codes, valid, torch.float32), want)
    torch.library.opcheck(torch.ops.lintime.vq_sum_grad.default, (grad, codes, valid, torch.float16),
                          test_utils=("test_schema", "test_faketensor"))


@cuda
@pytest.mark.parametrize("H", [1, 2])
def test_cuda_onehot_sums_equal_block_sums(H):
    """Half values on CUDA take the one-hot product (fp32 accumulation): counts equal, sums within fp32 rounding of
    the fp64 one-hot sums of the same values, and the values' gradient is each valid slot's row of the incoming
    gradient rounded once to bf16 (zero for an empty slot)."""
    from lintime.ops.vq.state import block_sums
    from lintime.ops.vq.triton.scan import block_sums_cuda

    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 37, (3, 4, 64, H), generator=g)
    valid = torch.rand(3, 4, 64, generator=g) > 0.3
    v = (torch.randn(3, 4, 64, H, 96, generator=g) * valid[..., None, None]).bfloat16()
    vg = v.cuda().requires_grad_()
    c1, s1 = block_sums_cuda(codes.cuda(), vg, valid.cuda(), 40)
    c0, s0 = block_sums(codes, v.double(), valid, 40)
    assert s1.dtype == torch.float32 and torch.equal(c1.cpu(), c0.float())
    assert_exact("one-hot sums", s0, s1.cpu())
    w = torch.randn(s1.shape, generator=g)
    (dv,) = torch.autograd.grad((s1 * w.cuda()).sum(), vg)
    heads = torch.arange(H).expand_as(codes)
    want = w[torch.arange(3)[:, None, None, None], torch.arange(4)[None, :, None, None], heads, codes]
    assert torch.equal(dv.cpu(), (want * valid[..., None, None]).bfloat16())


def test_block_summary_masks_empty_slots():
    """The decoding step's block summary (scatter-adds): equal to the one-hot sums over the valid slots divided by
    the counts, also when the empty slots hold values (it masks them itself); the mean's gradient reaches only the
    valid slots' values."""
    from lintime.ops.vq.state import block_sums, block_summary

    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 5, (2, 8, 1), generator=g)
    v = torch.randn(2, 8, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)
    valid = torch.rand(2, 8, generator=g) > 0.4
    c0, s0 = block_sums(codes, v * valid[..., None, None], valid, 6)
    c1, m1 = block_summary(codes, v, valid, 6)
    assert torch.equal(c0, c1)
    assert_exact("block mean", s0 / c0.clamp_min(1)[..., None], m1)
    m1.sum().backward()
    assert (v.grad[~valid] == 0).all() and (v.grad[valid] != 0).all()


@cpu_only
def test_scan_kernel_equals_the_serial_closed_form():
    """The serial reduction's scan kernel (running count and mean, reset at every pseudo-block) equals the chunked
    form's closed form on rows of several sequences (one-block ones, empty codes): both results and the
    gradients of the counts and the sums."""
    from lintime.ops.vq.chunk import _reduce_serial
    from lintime.ops.vq.triton.scan import scan_serial

    g = torch.Generator().manual_seed(3)
    R, NE, H, S, V = 2, 9, 2, 5, 20  # 16-wide tiles: two row tiles, two column tiles
    first = torch.rand(R, NE, generator=g) < 0.3
    first[:, 0] = True
    first[1, 3:5] = True
    cnt = torch.randint(0, 3, (R, NE, H, S), generator=g).float()
    sumv = torch.randn(R, NE, H, S, V, generator=g) * cnt[..., None]
    wc, wm = torch.randn(R, NE, H, S, generator=g), torch.randn(R, NE, H, S, V, generator=g)
    out = {}
    for name, fn in (("closed", _reduce_serial), ("scan", scan_serial)):
        c, s_ = cnt.clone().requires_grad_(), sumv.clone().requires_grad_()
        tot, mean = fn(first, c, s_)
        out[name] = (tot, mean, *torch.autograd.grad((tot * wc).sum() + (mean * wm).sum(), (c, s_)))
    for what, a, b in zip(("count", "mean", "d count", "d sum"), out["closed"], out["scan"]):
        assert_exact(f"scan {what}", a, b)


def test_automatic_choice(impl_calls):
    """Automatic: the recurrent form for one token; for T > 1 the Triton kernels on CUDA, else the chunked form."""
    inp = _inputs(1, 9, 1, 4, 3, 5, 4, torch.float32)
    args = (inp["q"], _gather(inp["codebook"], inp["codes"]), inp["codes"], inp["v"], inp["codebook"])
    calls = {be: impl_calls(vq_mod, be) for be in ("triton", "chunk", "recurrent")}
    vq_attention(*args, block_len=4)
    vq_attention(*(x[:, :1] for x in args[:4]), args[4], block_len=4)
    assert calls == {"triton": [], "chunk": [1], "recurrent": [1]}


# ------------------------------------------------------------------------ CUDA


def _cuda_case(dtype, T, *, pos=None, lens=None, bias=True, K=128, V=1536, S=512, L=512, seed=0):
    """The Triton run in ``dtype`` on CUDA with its references: fp32 -- the chunked form in fp32 (the exact rule
    compares forms in one dtype); half -- the fp64 naive run and the naive run in ``dtype``."""
    B = 1 if lens is not None or pos is None else len(pos)
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    inp = _inputs(B, T, 1, K, V, S, L, torch.float64, seed=seed)
    sd = None if pos is None else _state(pos, 1, K, V, S, L, torch.float64)
    if dtype == torch.float32:
        inp, sd = _to(inp, dtype), None if sd is None else _to(sd, dtype)
        ref = _run("chunk", inp, L, sd=sd, cu=cu, bias=bias, device="cuda")
        return ref, _run("triton", inp, L, sd=sd, cu=cu, bias=bias, device="cuda"), None
    ref = _run("naive", inp, L, sd=sd, cu=cu, bias=bias, device="cuda")
    sdh = None
    if sd is not None:
        sdh = _to(sd, dtype)
        sdh["cache_mean"], sdh["cache_count"] = sd["cache_mean"].float(), sd["cache_count"].float()
    base = _run("naive", _to(inp, dtype), L, sd=sdh, cu=cu, bias=bias, device="cuda")
    out = _run("triton", _to(inp, dtype), L, sd=sdh, cu=cu, bias=bias, device="cuda")
    return ref, out, base


@cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_vq_base_bf16():
    """bf16 at the vq-base shape, T not a multiple of L, continuing a mid-block state: half-precision rule for the
    output, the final state and every gradient."""
    ref, out, base = _cuda_case(torch.bfloat16, 2348, pos=[700])
    _half_rule("cuda vq-base bf16", ref, out, base)


@cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_packed_bf16_without_bias():
    ref, out, base = _cuda_case(torch.bfloat16, 2100, lens=[1300, 1, 0, 799], bias=False, seed=1)
    _half_rule("cuda packed bf16", ref, out, base)


@cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_fp32_exact():
    """fp32 (IEEE products) at a mid-sized shape, two sequences from states: the exact rule against the chunked
    form on the output, the final state and every gradient."""
    ref, out, _ = _cuda_case(torch.float32, 1000, pos=[70, 300], K=64, V=192, S=64, L=128, seed=2)
    _assert_same("cuda fp32", ref, out)


@cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("lens", [None, [256, 256, 256], [128, 384, 0, 256]])
def test_cuda_training_call_fp32_exact(lens):
    """The training call on CUDA (no state in or out, whole blocks: rows, equal and unequal packed rows), fp32:
    the exact rule against the chunked form on the output and every gradient."""
    _training_case("serial", lens, B=2, T=512, K=64, V=192, S=64, L=128, device="cuda")


@cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_dispatch_picks_triton(impl_calls):
    calls = impl_calls(vq_mod, "triton")
    inp = _inputs(1, 64, 1, 16, 16, 8, 16, torch.bfloat16)
    args = [inp[k].cuda() for k in ("q", "codes", "v", "codebook")]
    vq_attention(args[0], _gather(args[3], args[1]), args[1], args[2], args[3], block_len=16)
    assert calls == [1]
