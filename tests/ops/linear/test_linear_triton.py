"""linear_attention, backend 'triton': the fused kernels against the naive form (chain of trust
naive -> chunk in tests/ops/linear/test_linear.py, naive -> triton here).  Forward, final state and every
gradient (both parts of the initial state included), causal and not, normalised and not, both
state forms (one segment per sequence; materialised segment states), odd lengths, packing,
continuation, the decoding kernel, fallbacks, and the custom ops under ``torch.compile``.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py) at small sizes: fp32
(exact tolerance -- fp32 inputs use IEEE matmuls) and fp16 (half-precision rule; the
interpreter's bf16 matmul is wrong, so bf16 runs on CUDA only).  The tests marked ``cuda`` repeat
the checks at real sizes, bf16 included.
"""

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Triton picks interpreter vs compiler when a kernel module is imported; tests/conftest.py
    # sets this too -- repeated so this file also runs on its own
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lintime.ops import linear_attention
from lintime.ops.utils.segments import choose_segment_chunks
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


def _inputs(B, T, H, K, V, dtype=torch.float32, seed=0, device=DEV):
    """Positive q, k (``elu + 1``, the layer's feature map) so the normaliser is > 0."""
    g = torch.Generator().manual_seed(seed * 1000 + T * 7 + K)
    q = F.elu(torch.randn(B, T, H, K, generator=g, dtype=torch.float64)) + 1
    k = F.elu(torch.randn(B, T, H, K, generator=g, dtype=torch.float64)) + 1
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    return [x.to(device, dtype) for x in (q, k, v)]


def _state(N, H, K, V, normalize, device=DEV, seed=1):
    """A plausible fp32 state: the sums of a few earlier (positive-key) tokens."""
    _q, k, v = _inputs(N, 5, H, K, V, torch.float64, seed=seed, device=device)
    kv = torch.einsum("nthk,nthv->nhkv", k, v).float()
    return (kv, k.sum(1).float()) if normalize else kv


def _parts(state):
    return () if state is None else (tuple(state) if isinstance(state, tuple) else (state,))


def _leaf(state, dtype=None):
    if state is None:
        return None
    parts = tuple(x.detach().to(dtype or x.dtype).clone().requires_grad_() for x in _parts(state))
    return parts if isinstance(state, tuple) else parts[0]


def _collect(o, fin, wrt):
    """Output, final-state parts and the gradients w.r.t. ``wrt`` of a fixed random projection of
    all of them (so the final state's backward runs too)."""
    g = torch.Generator().manual_seed(2)
    loss = 0.0
    for x in (o, *_parts(fin)):
        loss = loss + (x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device)).sum()
    grads = torch.autograd.grad(loss, wrt)
    out = {"o": o, **{f"final{i}": x for i, x in enumerate(_parts(fin))}}
    out.update(zip(("dq", "dk", "dv", "ds0", "ds1"), grads))
    return out


def _run(backend, q, k, v, state, segment_chunks=None, **opts):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    state = _leaf(state)
    if backend == "triton":
        from lintime.ops.linear.triton import triton_linear_attention

        o, fin = triton_linear_attention(q, k, v, initial_state=state, output_final_state=True,
                                         segment_chunks=segment_chunks, **opts)
    else:
        o, fin = linear_attention(q, k, v, initial_state=state, output_final_state=True, backend=backend, **opts)
    return _collect(o, fin, (q, k, v, *_parts(state)))


def _assert_all(tag, ref, out, zero=()):
    """Every entry agrees to the exact tolerance; names in ``zero`` are zero in exact arithmetic
    (both sides rounding noise, measured against dk)."""
    assert ref.keys() == out.keys(), (tag, ref.keys(), out.keys())
    for name in ref:
        assert out[name].dtype == ref[name].dtype, (tag, name, out[name].dtype)
        if name in zero:
            unit = ref["dk"].double().pow(2).mean().sqrt()
            for side, x in (("ref", ref[name]), ("out", out[name])):
                assert_close(f"{tag} {name} {side} == 0", torch.zeros_like(x), x / unit, EXACT_TOL[x.dtype])
        else:
            assert_exact(f"{tag} {name}", ref[name], out[name])


def _assert_half(tag, ref64, base, out, dtype):
    """Half-precision rule for every entry: the output and input gradients in ``dtype`` within 2x
    the naive same-dtype error (+ floor) of the fp64 result; the fp32 final state and
    initial-state gradients likewise (their only error source is the half inputs)."""
    for name in ref64:
        bound = HALF_FACTOR * rel_rms(ref64[name], base[name]) + HALF_FLOOR[dtype]
        assert_close(f"{tag} {name}", ref64[name], out[name], bound)


# --------------------------------------------------------------------------------------------
# chain of trust (interpreter on CPU, compiled on CUDA)

CASES = [(1, 0), (65, 0), (150, 1)]  # (T, chunks per segment): 150 = 3 chunks in 3 segments


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("T,ns", CASES)
def test_chain_of_trust_fp32(causal, normalize, T, ns):
    B, H, K, V = 2, 1, 20, 12  # K, V not powers of two: padded tiles
    q, k, v = _inputs(B, T, H, K, V)
    state = _state(B, H, K, V, normalize) if causal else None
    opts = dict(causal=causal, normalize=normalize, scale=None if T > 1 else 0.7)
    ref = _run("naive", q, k, v, state, **opts)
    out = _run("triton", q, k, v, state, segment_chunks=ns, **opts)
    zero = ("dq",) if (T == 1 and normalize and not causal) else ()  # one token seen non-causally: o = v
    _assert_all(f"triton causal={causal} normalize={normalize} T={T} ns={ns}", ref, out, zero)


@pytest.mark.parametrize("causal", [True, False])
def test_wide_heads_split_tiles_fp32(causal):
    """K = 100, V = 72: the state no longer fits one tile, so the output walk runs 3 V-blocks, the
    dq walk 4 K-blocks, and dk / dv take separate walks (4 K-blocks, 3 V-blocks), all with partial
    last blocks; materialised segments, normalised, with an initial state."""
    B, T, H, K, V = 1, 130, 1, 100, 72
    q, k, v = _inputs(B, T, H, K, V)
    state = _state(B, H, K, V, True) if causal else None
    ref = _run("naive", q, k, v, state, causal=causal)
    out = _run("triton", q, k, v, state, segment_chunks=1, causal=causal)
    _assert_all(f"triton wide heads causal={causal}", ref, out)


@pytest.mark.parametrize("causal,normalize", [(True, True), (True, False), (False, True)])
def test_half_precision_fp16(causal, normalize):
    B, T, H, K, V = 1, 100, 2, 16, 16
    q, k, v = _inputs(B, T, H, K, V, torch.float64)
    s = _state(B, H, K, V, normalize) if causal else None
    s64 = None if s is None else tuple(x.double() for x in _parts(s)) if normalize else s.double()
    opts = dict(causal=causal, normalize=normalize)
    ref = _run("naive", q, k, v, s64, **opts)
    half = [x.half() for x in (q, k, v)]
    base = _run("naive", *half, s, **opts)
    out = _run("triton", *half, s, segment_chunks=1, **opts)
    assert out["o"].dtype == torch.float16 and all(out[n].dtype == torch.float32 for n in out if n.startswith("final"))
    _assert_half(f"triton fp16 causal={causal} normalize={normalize}", ref, base, out, torch.float16)


# --------------------------------------------------------------------------------------------
# packing, continuation, decoding


@pytest.mark.parametrize("causal,normalize,ns", [(True, True, 0), (True, False, 1), (False, True, 1)])
def test_packing_equals_separate_calls(causal, normalize, ns):
    """Packed sequences (lengths 5, 1, 0, 70, 17; per-sequence initial states) == separate naive
    calls: outputs, final states and every gradient."""
    lens = [5, 1, 0, 70, 17]
    N, H, K, V = len(lens), 1, 16, 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    q, k, v = (x.requires_grad_() for x in _inputs(1, sum(lens), H, K, V))
    state = _leaf(_state(N, H, K, V, normalize)) if causal else None
    opts = dict(causal=causal, normalize=normalize)
    wrt = (q, k, v, *_parts(state))
    outs, fins = [], []
    for n in range(N):
        s, e = cu[n].item(), cu[n + 1].item()
        st_n = None if state is None else tuple(x[n : n + 1] for x in _parts(state))
        o_n, fin_n = linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], output_final_state=True, backend="naive",
                                      initial_state=st_n if normalize or st_n is None else st_n[0], **opts)
        outs.append(o_n)
        fins.append(_parts(fin_n))
    fin_sep = tuple(torch.cat(x) for x in zip(*fins))
    sep = _collect(torch.cat(outs, 1), fin_sep if normalize else fin_sep[0], wrt)
    from lintime.ops.linear.triton import triton_linear_attention

    o, fin = triton_linear_attention(q, k, v, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                     segment_chunks=ns, **opts)
    _assert_all(f"triton packed causal={causal} normalize={normalize} ns={ns}", sep, _collect(o, fin, wrt))


def test_continuation_equals_one_call():
    """Splitting at 37 (mid-chunk), 64 (chunk boundary), 65 and carrying the state gives one call's
    outputs, final state and gradients (through the chain of states)."""
    B, T, H, K, V = 1, 100, 1, 16, 16
    q, k, v = (x.requires_grad_() for x in _inputs(B, T, H, K, V))
    state = _leaf(_state(B, H, K, V, True))
    one = _collect(*linear_attention(q, k, v, initial_state=state, output_final_state=True, backend="naive"),
                   (q, k, v, *state))
    outs, st = [], state
    for s, e in itertools.pairwise([0, 37, 64, 65, T]):
        o, st = linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], initial_state=st, output_final_state=True,
                                 backend="triton")
        outs.append(o)
    _assert_all("triton continued", one, _collect(torch.cat(outs, 1), st, (q, k, v, *state)))


@pytest.mark.parametrize("normalize", [True, False])
def test_prefill_then_decode(normalize):
    """Chunked prefill, then token-by-token decoding (forward-only calls of <= 16 tokens run the
    recurrent kernel), packed sequences included: equal to one naive call."""
    lens = [9, 0, 30]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    H, K, V = 2, 16, 16
    q, k, v = _inputs(1, sum(lens), H, K, V)
    ref, ref_fin = linear_attention(q, k, v, normalize=normalize, output_final_state=True, cu_seqlens=cu,
                                    backend="naive")
    with torch.no_grad():
        P = [6, 0, 20]  # prefill lengths per sequence
        idx = lambda parts: torch.tensor([t for a, b in parts for t in range(a, b)], dtype=torch.long, device=DEV)
        cu_of = lambda ls: torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], device=DEV)
        pre = [(s, s + p) for s, p in zip(cu.tolist(), P)]
        i1 = idx(pre)
        o1, st = linear_attention(q[:, i1], k[:, i1], v[:, i1], normalize=normalize, output_final_state=True,
                                  cu_seqlens=cu_of(P), backend="triton")
        out = torch.zeros_like(ref).index_copy(1, i1, o1)
        # then one token per sequence per call, the shorter ones finishing early (length-0 rows)
        for step in range(max(L - p for L, p in zip(lens, P))):
            pos = [(s + p + step, s + p + step + 1) if p + step < L else (0, 0)
                   for s, p, L in zip(cu.tolist(), P, lens)]
            live = [b - a for a, b in pos]
            it = idx(pos)
            o_t, st = linear_attention(q[:, it], k[:, it], v[:, it], normalize=normalize, initial_state=st,
                                       output_final_state=True, cu_seqlens=cu_of(live), backend="triton")
            out = out.index_copy(1, it, o_t)
    assert_exact(f"prefill+decode normalize={normalize} o", ref, out)
    for a, b in zip(_parts(ref_fin), _parts(st)):
        assert_exact(f"prefill+decode normalize={normalize} state", a, b)


# --------------------------------------------------------------------------------------------
# custom ops, dispatch, fallbacks


def test_custom_op_compiles_and_checks():
    """The forward op passes torch.library.opcheck (schema, fake tensors, autograd registration),
    and a torch.compile'd call (fullgraph) traces through it, gradients included."""
    from lintime.ops.linear.triton.ops import linear_fwd_op

    q, k, v = _inputs(1, 20, 1, 16, 16)
    kv, ks = _state(1, 1, 16, 16, True)
    leaves = tuple(x.requires_grad_() for x in (q, k, v, kv))
    args = (*leaves, ks, None, 0.25, True, True, 0)
    torch.library.opcheck(linear_fwd_op.op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

    def f(q, k, v):
        o, (s, z) = linear_attention(q, k, v, output_final_state=True, backend="triton")
        return o.float().sum() + s.sum() + z.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    g1 = torch.autograd.grad(compiled(*leaves), leaves)
    leaves2 = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    g2 = torch.autograd.grad(f(*leaves2), leaves2)
    for a, b in zip(g2, g1):
        assert_exact("compiled grad", a, b)


def test_eager_function_with_unused_outputs():
    """Eager calls run an autograd.Function that passes ``None`` (no zero tensors) for the gradients
    of unused outputs: a loss on the output alone, on the final state alone, or on one part of it,
    gives the custom op's gradients (the op's autograd materialises the missing ones as zeros)."""
    from lintime.ops.linear.triton.ops import linear_fwd_op, triton_linear_attention

    q0, k0, v0 = _inputs(1, 70, 1, 16, 8)  # (one row and head: the point is which gradients come back)
    for normalize in (True, False):
        state = _state(1, 1, 16, 8, normalize)
        g = torch.Generator().manual_seed(4)
        for use in ("o", "state", "first part"):
            def run(eager):
                q, k, v = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))
                s = _leaf(state)
                if eager:
                    o, fin = triton_linear_attention(q, k, v, normalize=normalize, initial_state=s,
                                                     output_final_state=True, segment_chunks=1)
                    fin = _parts(fin)
                else:
                    h0, z0 = s if normalize else (s, None)
                    o, ht, zt, *_ = linear_fwd_op.op(q, k, v, h0, z0, None, 16**-0.5, True, normalize, 1)
                    fin = (ht, zt) if normalize else (ht,)
                parts = {"o": (o,), "state": fin, "first part": fin[:1]}[use]
                loss = sum((x * w).sum() for x, w in zip(parts, weights))
                return torch.autograd.grad(loss, (q, k, v, *_parts(s)))

            shapes = {"o": [(1, 70, 1, 8)], "state": [(1, 1, 16, 8), (1, 1, 16)], "first part": [(1, 1, 16, 8)]}
            weights = [torch.randn(sh, generator=g) for sh in shapes[use]]
            for i, (a, b) in enumerate(zip(run(False), run(True))):
                assert_exact(f"normalize={normalize} loss on {use}: grad {i}", a, b)


def test_fallbacks_and_device_check(monkeypatch):
    """fp64 inputs and head sizes above 256 take the chunked PyTorch form; CPU tensors without the
    interpreter are refused with a clear error."""
    from lintime.ops.linear.triton import triton_linear_attention

    q, k, v = _inputs(1, 10, 1, 8, 8, torch.float64)
    ref, _ = linear_attention(q, k, v, backend="chunk")
    assert_exact("fp64 fallback", ref, triton_linear_attention(q, k, v)[0])
    q, k, v = _inputs(1, 5, 1, 260, 4)
    ref, _ = linear_attention(q, k, v, backend="chunk")
    assert_exact("K=260 fallback", ref, triton_linear_attention(q, k, v)[0])
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _inputs(1, 5, 1, 8, 8, device="cpu")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        linear_attention(q, k, v, backend="triton")


def test_segment_choice():
    """The segment rule's invariants: one segment per sequence once the walk has a program per SM;
    otherwise a power of two, shorter than the longest sequence, never shorter for a longer one."""
    dev = torch.device("cpu")  # 4 SMs under the interpreter
    assert choose_segment_chunks(4, 4 * 64 * 100, 64 * 100, 1, dev) == 0
    assert choose_segment_chunks(1, 64 * 100, 64 * 100, 4, dev) == 0
    last = 0
    for chunks in (1, 2, 15, 16, 17, 40, 100, 400, 4000):
        ns = choose_segment_chunks(1, 64 * chunks, 64 * chunks, 1, dev)
        assert ns == 0 or (ns & (ns - 1) == 0 and ns < chunks), (chunks, ns)
        assert ns == 0 or ns >= last, (chunks, ns, last)
        last = ns or last
    assert choose_segment_chunks(1, 64 * 4000, 64 * 4000, 1, dev) > 0  # long sequences are cut


# --------------------------------------------------------------------------------------------
# CUDA, real sizes


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal,normalize,ns", [(True, True, None), (True, False, 0), (False, True, None)])
def test_cuda_real_sizes(dtype, causal, normalize, ns):
    """B = 2, T = 1000, H = 4, K = V = 64 with an initial state, against the fp64 naive form:
    fp32 to the exact tolerance, half precision by the rule (base: naive in that dtype)."""
    B, T, H, K, V = 2, 1000, 4, 64, 64
    q, k, v = _inputs(B, T, H, K, V, torch.float64)
    s = _state(B, H, K, V, normalize) if causal else None
    s64 = None if s is None else tuple(x.double() for x in _parts(s)) if normalize else s.double()
    opts = dict(causal=causal, normalize=normalize)
    ref = _run("naive", q, k, v, s64, **opts)
    x = [t.to(dtype) for t in (q, k, v)]
    out = _run("triton", *x, s, segment_chunks=ns, **opts)
    if dtype == torch.float32:
        _assert_all(f"cuda fp32 causal={causal} normalize={normalize}", _run("naive", *x, s, **opts), out)
    else:
        _assert_half(f"cuda {dtype} causal={causal} normalize={normalize}", ref, _run("naive", *x, s, **opts), out,
                     dtype)


@cuda
@needs_cuda
@pytest.mark.parametrize("normalize", [True, False])
def test_cuda_packing_bf16(normalize):
    """Packed bf16 sequences of very different lengths (with a 0 and a 1) == separate naive calls."""
    lens = [1000, 1, 0, 4097, 77]
    H, K, V = 4, 64, 64
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEV)
    q, k, v = _inputs(1, sum(lens), H, K, V, torch.float64)
    s = _state(len(lens), H, K, V, normalize)
    ref = _run("naive", q, k, v, tuple(x.double() for x in _parts(s)) if normalize else s.double(), cu_seqlens=cu,
               normalize=normalize)
    x = [t.bfloat16() for t in (q, k, v)]
    base = _run("naive", *x, s, cu_seqlens=cu, normalize=normalize)
    out = _run("triton", *x, s, cu_seqlens=cu, normalize=normalize)
    _assert_half(f"cuda packed bf16 normalize={normalize}", ref, base, out, torch.bfloat16)


@cuda
@needs_cuda
@pytest.mark.parametrize("normalize", [True, False])
def test_cuda_long_bf16(normalize):
    """T = 131072 in bf16 (automatic segments): finite, within the half rule of the fp64 chunked
    result (the quadratic naive form is out of reach), gradients finite; the fp32 run within the
    exact tolerance of fp64."""
    T, H, K, V = 131072, 2, 64, 64
    q, k, v = _inputs(1, T, H, K, V, torch.float32)
    opts = dict(normalize=normalize, output_final_state=True)
    o64, fin64 = linear_attention(q.double(), k.double(), v.double(), backend="chunk", **opts)
    o32, fin32 = linear_attention(q, k, v, backend="triton", **opts)
    xb = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    ob, finb = linear_attention(*xb, backend="triton", **opts)
    base, _ = linear_attention(*(t.detach().double() for t in xb), backend="chunk", normalize=normalize)
    assert ob.dtype == torch.bfloat16 and torch.isfinite(ob).all()
    bound = HALF_FACTOR * rel_rms(o64, base.bfloat16()) + HALF_FLOOR[torch.bfloat16]
    assert_close(f"bf16 T={T}", o64, ob, bound)
    grads = torch.autograd.grad(ob.float().pow(2).mean(), xb)
    assert all(torch.isfinite(g_).all() for g_ in grads)
    assert_close(f"fp32 T={T}", o64, o32, EXACT_TOL[torch.float32])
    for a, b in zip(_parts(fin64), _parts(fin32)):
        assert_close(f"fp32 T={T} state", a, b, EXACT_TOL[torch.float32])
