"""linear_attention: chain of trust naive <-> chunk <-> recurrent (forward, final state and every
gradient, initial state included), packing, continuation at any split, half precision, a
T = 131072 bf16 run, and the error paths."""

import importlib
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from lintime.ops import linear_attention
from lintime.ops.dispatch import select
from lintime.ops.linear import _IMPLS
from tolerances import (
    EXACT_TOL,
    HALF_FACTOR,
    HALF_FLOOR,
    assert_close,
    assert_exact,
    assert_half_rule,
    rel_rms,
)

BACKENDS = ("naive", "chunk", "recurrent")


def _inputs(B, T, H, K, V, dtype=torch.float64, seed=0):
    """Positive q, k (``elu + 1``, the layer's feature map) so the normaliser is > 0."""
    g = torch.Generator().manual_seed(seed * 1000 + T * 7 + K)
    q = F.elu(torch.randn(B, T, H, K, generator=g, dtype=torch.float64)) + 1
    k = F.elu(torch.randn(B, T, H, K, generator=g, dtype=torch.float64)) + 1
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _state(N, H, K, V, normalize, dtype=torch.float64, seed=1):
    """A plausible state: the sums of a few earlier (positive-key) tokens."""
    _q, k, v = _inputs(N, 5, H, K, V, torch.float64, seed=seed)
    kv = torch.einsum("nthk,nthv->nhkv", k, v).to(dtype)
    return (kv, k.sum(1).to(dtype)) if normalize else kv


def _parts(state):
    """The state's tensors as a tuple (``()`` for ``None``)."""
    if state is None:
        return ()
    return tuple(state) if isinstance(state, tuple) else (state,)


def _leaf(state, dtype=None):
    """A fresh leaf copy of ``state`` (optionally cast) that records its gradient."""
    if state is None:
        return None
    parts = tuple(x.to(dtype or x.dtype).clone().requires_grad_() for x in _parts(state))
    return parts if isinstance(state, tuple) else parts[0]


def _collect(o, fin, wrt):
    """``{o, final*, d*}``: the output, the final state's parts and the gradients w.r.t. ``wrt``
    (q, k, v, then the initial state's parts) of a fixed random projection of o and every part
    of the final state -- so the final state's backward is exercised too."""
    g = torch.Generator().manual_seed(2)
    loss = 0.0
    for x in (o, *_parts(fin)):
        loss = loss + (x.double() * torch.randn(x.shape, generator=g, dtype=torch.float64)).sum()
    grads = torch.autograd.grad(loss, wrt)
    out = {"o": o, **{f"final{i}": x for i, x in enumerate(_parts(fin))}}
    out.update(zip(("dq", "dk", "dv", "ds0", "ds1"), grads))
    return out


def _run(backend, q, k, v, state, **opts):
    o, fin = linear_attention(q, k, v, initial_state=state, output_final_state=True, backend=backend, **opts)
    return _collect(o, fin, (q, k, v, *_parts(state)))


def _assert_all(tag, ref, out, zero=()):
    """Every entry agrees to the exact tolerance.  Names in ``zero`` are zero in exact
    arithmetic (dq when o does not depend on q): both sides must be rounding noise, measured
    against dk (same units)."""
    assert ref.keys() == out.keys(), (tag, ref.keys(), out.keys())
    for name in ref:
        if name in zero:
            unit = ref["dk"].double().pow(2).mean().sqrt()
            for side, x in (("ref", ref[name]), ("out", out[name])):
                assert_close(f"{tag} {name} {side} == 0", torch.zeros_like(x), x / unit, EXACT_TOL[x.dtype])
        else:
            assert_exact(f"{tag} {name}", ref[name], out[name])


# --------------------------------------------------------------------------------------------
# chain of trust


CASES = [  # (T, chunk_size, scale): odd lengths, T not a multiple of C, the default C and scale
    (1, 64, None),
    (2, 64, 0.5),
    (63, 64, None),
    (257, 16, 0.3),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("T,C,scale", CASES)
def test_chain_of_trust(dtype, causal, normalize, T, C, scale):
    B, H, K, V = 2, 2, 60, 12
    q, k, v = (x.requires_grad_() for x in _inputs(B, T, H, K, V, dtype))
    state = _leaf(_state(B, H, K, V, normalize, dtype)) if causal else None
    opts = {"causal": causal, "normalize": normalize, "scale": scale, "chunk_size": C}
    res = {b: _run(b, q, k, v, state, **opts) for b in BACKENDS}
    assert res["chunk"]["o"].dtype == dtype
    assert len([n for n in res["naive"] if n.startswith("final")]) == (2 if normalize else 1)
    tag = f"{dtype} causal={causal} normalize={normalize} T={T}"
    # a single token seen non-causally with normalisation gives o = v whatever q is
    zero = ("dq",) if (T == 1 and normalize and not causal) else ()
    _assert_all(f"{tag} naive~chunk", res["naive"], res["chunk"], zero)
    _assert_all(f"{tag} chunk~recurrent", res["chunk"], res["recurrent"], zero)


def test_automatic_backend_choice():
    q, k, v = _inputs(1, 5, 1, 4, 4)
    assert select("linear_attention", None, _IMPLS, q[:, :1]) is _IMPLS["recurrent"]
    assert select("linear_attention", None, _IMPLS, q) is _IMPLS["chunk"]
    o, _ = linear_attention(q, k, v)
    ref, _ = linear_attention(q, k, v, backend="naive")
    assert_exact("auto backend", ref, o)


def test_chunk_size_beyond_T_is_capped():
    """A chunk size far beyond T costs nothing extra (no 10^6 x 10^6 block) and changes nothing."""
    q, k, v = _inputs(2, 20, 2, 8, 6)
    ref, _ = linear_attention(q, k, v, backend="naive")
    o, _ = linear_attention(q, k, v, chunk_size=10**6, backend="chunk")
    assert_exact("chunk_size 1e6", ref, o)


def test_non_causal_state_is_the_whole_sequence_sum():
    """A non-causal call's final state is the sum over its sequence: the causal final state."""
    q, k, v = _inputs(2, 30, 2, 8, 6)
    for normalize in (True, False):
        _, fin_c = linear_attention(q, k, v, normalize=normalize, output_final_state=True, backend="naive")
        for backend in BACKENDS:
            _, fin = linear_attention(q, k, v, causal=False, normalize=normalize, output_final_state=True,
                                      backend=backend)
            for a, b in zip(_parts(fin_c), _parts(fin)):
                assert_exact(f"non-causal state {backend}", a, b)


# --------------------------------------------------------------------------------------------
# packing


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_packing_equals_separate_calls(causal, normalize):
    lens = [5, 1, 0, 40, 17]  # a length-1 and an empty sequence; C = 16 splits 40 and 17 mid-chunk
    N, H, K, V = len(lens), 2, 8, 6
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v = (x.requires_grad_() for x in _inputs(1, sum(lens), H, K, V))
    state = _leaf(_state(N, H, K, V, normalize)) if causal else None
    opts = {"causal": causal, "normalize": normalize, "chunk_size": 16}

    wrt = (q, k, v, *_parts(state))
    outs, fins = [], []
    for n in range(N):  # separate calls (naive), one per sequence
        s, e = cu[n].item(), cu[n + 1].item()
        st_n = None if state is None else tuple(x[n : n + 1] for x in _parts(state))
        o_n, fin_n = linear_attention(
            q[:, s:e], k[:, s:e], v[:, s:e], initial_state=st_n if normalize or st_n is None else st_n[0],
            output_final_state=True, backend="naive", **opts,
        )
        outs.append(o_n)
        fins.append(_parts(fin_n))
    fin_sep = tuple(torch.cat(x) for x in zip(*fins))
    sep = _collect(torch.cat(outs, 1), fin_sep if normalize else fin_sep[0], wrt)
    for backend in BACKENDS:
        o, fin = linear_attention(q, k, v, initial_state=state, output_final_state=True, cu_seqlens=cu,
                                  backend=backend, **opts)
        _assert_all(f"packed {backend} causal={causal} normalize={normalize}", sep, _collect(o, fin, wrt))


# --------------------------------------------------------------------------------------------
# continuation


def _continue(backend, q, k, v, state, splits, **opts):
    """Run ``[0, T)`` as consecutive calls cut at ``splits``, passing the state along."""
    T = q.shape[1]
    cuts = [0, *splits, T]
    outs = []
    for s, e in itertools.pairwise(cuts):
        o, state = linear_attention(q[:, s:e], k[:, s:e], v[:, s:e], initial_state=state,
                                    output_final_state=True, backend=backend, **opts)
        outs.append(o)
    return torch.cat(outs, 1), state


def _continued_run(backend, q, k, v, state, splits, **opts):
    o, fin = _continue(backend, q, k, v, state, splits, **opts)
    return _collect(o, fin, (q, k, v, *_parts(state)))


# split points around C = 16: mid-chunk, on a chunk boundary, one token before/after it,
# a single-token first segment, a single-token last segment; plus seeded random cuts
SPLITS = [
    [37],
    [1, 16, 17, 50, 99],
    [15, 33, 64, 70],
    sorted((torch.randperm(99, generator=torch.Generator().manual_seed(7))[:6] + 1).tolist()),
]


@pytest.mark.parametrize("backend", ["chunk", "recurrent", "naive"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("splits", SPLITS)
def test_continuation_equals_one_call(backend, normalize, splits):
    B, T, H, K, V = 2, 100, 2, 8, 6
    q, k, v = (x.requires_grad_() for x in _inputs(B, T, H, K, V))
    state = _leaf(_state(B, H, K, V, normalize))
    opts = {"normalize": normalize, "chunk_size": 16}
    one = _continued_run(backend, q, k, v, state, [], **opts)
    cut = _continued_run(backend, q, k, v, state, splits, **opts)
    _assert_all(f"continued {backend} normalize={normalize} splits={splits}", one, cut)


def test_prefill_then_decode_token_by_token():
    """Chunked prefill, then one token per call with the automatic backend (recurrent at T == 1)."""
    B, T, P, H, K, V = 2, 40, 23, 2, 8, 6
    q, k, v = _inputs(B, T, H, K, V)
    full, fin = linear_attention(q, k, v, output_final_state=True, backend="naive")
    o, state = linear_attention(q[:, :P], k[:, :P], v[:, :P], output_final_state=True)
    outs = [o]
    for t in range(P, T):
        o, state = linear_attention(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                                    initial_state=state, output_final_state=True)
        outs.append(o)
    assert_exact("prefill+decode o", full, torch.cat(outs, 1))
    for i, (a, b) in enumerate(zip(fin, state)):
        assert_exact(f"prefill+decode state[{i}]", a, b)


@given(
    B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 2), K=st.integers(1, 7), V=st.integers(1, 7),
    C=st.integers(1, 20), causal=st.booleans(), normalize=st.booleans(),
    scale=st.sampled_from([None, 0.25, 2.0]), split=st.floats(0.0, 1.0), pack=st.booleans(),
)
def test_random_shapes_splits_options(B, T, H, K, V, C, causal, normalize, scale, split, pack):
    """chunk and recurrent vs naive (forward, final state, gradients), and (causal) the chunked
    form continued from a random split point, on random small shapes; ``pack`` packs the batch
    into one row with cu_seqlens."""
    q, k, v = _inputs(B, T, H, K, V, seed=T + 31 * K + 7 * C)
    cu = None
    if pack:
        cu = torch.arange(B + 1) * T
        q, k, v = (x.reshape(1, B * T, H, x.shape[-1]) for x in (q, k, v))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    state = _leaf(_state(B, H, K, V, normalize)) if causal else None
    opts = {"causal": causal, "normalize": normalize, "scale": scale, "chunk_size": C, "cu_seqlens": cu}
    # normalised o does not depend on q when K == 1 (q cancels) or for one token seen
    # non-causally without a state (o = v)
    zero = ("dq",) if normalize and (K == 1 or (T == 1 and not causal)) else ()
    ref = _run("naive", q, k, v, state, **opts)
    _assert_all("hypothesis chunk", ref, _run("chunk", q, k, v, state, **opts), zero)
    _assert_all("hypothesis recurrent", ref, _run("recurrent", q, k, v, state, **opts), zero)
    if causal and not pack:
        cut = _continued_run("chunk", q, k, v, state, [round(split * T)], **opts)
        one = _continued_run("naive", q, k, v, state, [], **opts)
        _assert_all("hypothesis continued", one, cut, zero)


# --------------------------------------------------------------------------------------------
# half precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_half_precision_rule(dtype, causal, normalize):
    """Chunked form in half precision vs the fp64 naive form: output, final state and every
    gradient within 2x the naive same-dtype error (+ floor).  States stay fp32."""
    B, T, H, K, V = 1, 200, 2, 32, 32
    q, k, v = _inputs(B, T, H, K, V)
    s = _state(B, H, K, V, normalize) if causal else None
    opts = {"causal": causal, "normalize": normalize, "chunk_size": 64}

    def run(backend, dt):
        x = tuple(t.to(dt).requires_grad_() for t in (q, k, v))
        return _run(backend, *x, _leaf(s, torch.float64 if dt == torch.float64 else torch.float32), **opts)

    ref = run("naive", torch.float64)
    base = run("naive", dtype)
    out = run("chunk", dtype)
    for name in ref:
        if name.startswith(("final", "ds")):
            # the final state and the initial-state gradients are fp32 by contract; their only
            # error source is the half inputs, so the same rule applies with the input's floor
            assert out[name].dtype == torch.float32, name
            bound = HALF_FACTOR * rel_rms(ref[name], base[name]) + HALF_FLOOR[dtype]
            assert_close(f"chunk {dtype} {name}", ref[name], out[name], bound)
        else:  # o, dq, dk, dv
            assert out[name].dtype == dtype, name
            assert_half_rule(f"chunk {name}", ref[name], out[name], base[name])


@pytest.mark.parametrize("normalize", [True, False])
def test_bf16_long_sequence(normalize):
    """T = 131072 in bf16 through the chunked form: finite, within the half rule of the fp64
    result (the base being the exact result of the bf16-rounded inputs, rounded to bf16, since
    the quadratic naive form is out of reach at this length), and the fp32 run within the fp32
    exact tolerance of fp64 -- the fp32 chunk states do not drift over 2048 chunks."""
    T, H, K, V = 131072, 1, 8, 8
    q, k, v = _inputs(1, T, H, K, V, dtype=torch.float32)
    opts = {"normalize": normalize, "backend": "chunk"}
    o64, fin64 = linear_attention(q.double(), k.double(), v.double(), output_final_state=True, **opts)
    o32, fin32 = linear_attention(q, k, v, output_final_state=True, **opts)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ob, finb = linear_attention(qb, kb, vb, output_final_state=True, **opts)
    base, _ = linear_attention(qb.double(), kb.double(), vb.double(), **opts)
    assert ob.dtype == torch.bfloat16 and torch.isfinite(ob).all()
    assert all(x.dtype == torch.float32 and torch.isfinite(x).all() for x in _parts(finb))
    assert_half_rule(f"bf16 T={T}", o64, ob, base.bfloat16())
    assert_close(f"fp32 T={T}", o64, o32, EXACT_TOL[torch.float32])
    for a, b in zip(_parts(fin64), _parts(fin32)):
        assert_close(f"fp32 T={T} state", a, b, EXACT_TOL[torch.float32])


class _TensorProbe(TorchDispatchMode):
    """Records the largest tensor any op produces and the elements produced in all."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
                self.total += x.numel()
        return out


def _probe(backend, T, causal, K, V, C, B=1, H=1):
    q, k, v = (x.requires_grad_() for x in _inputs(B, T, H, K, V, torch.float32))
    s = _leaf(_state(B, H, K, V, True, torch.float32)) if causal else None
    with _TensorProbe() as probe:
        o, fin = linear_attention(q, k, v, causal=causal, chunk_size=C, initial_state=s,
                                  output_final_state=True, backend=backend)
        torch.autograd.grad((o.sum() + fin[0].sum() + fin[1].sum()), (q, k, v, *_parts(s)))
    return probe


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_memory_is_linear_in_T(causal):
    """Forward + backward of the chunked form: no tensor larger than the [C, C] score blocks, the
    chunked inputs or the per-chunk states (``T * max(C, K, V + 1)``, ``T / C * K * (V + 1)``
    elements with B = H = 1), far below ``T * T`` (the probe does catch the quadratic naive
    form); and the elements produced in all grow linearly with T (a per-chunk full-size
    gradient in the state scan would make them quadratic)."""
    # many small chunks so that a quadratic term would show: 128 chunks of 4 tokens, a 8 x 9 state
    # (the pre-fix scan produced 3.1x the elements at 2x the length; linear gives 2.0x)
    T, C, K, V = 512, 4, 8, 8
    bound = max(T * max(C, K, V + 1), (T // C) * K * (V + 1))
    small = _probe("chunk", T // 2, causal, K=K, V=V, C=C)
    chunk = _probe("chunk", T, causal, K=K, V=V, C=C)
    naive = _probe("naive", T, causal, K=K, V=V, C=C)
    assert chunk.largest <= bound < naive.largest, (chunk.largest, bound, naive.largest)
    assert chunk.total <= 2.05 * small.total, (small.total, chunk.total)


# --------------------------------------------------------------------------------------------
# error paths


def test_bad_inputs_fail_clearly(monkeypatch):
    q, k, v = _inputs(2, 8, 2, 4, 3, torch.float32)
    kv, ks = _state(2, 2, 4, 3, True, torch.float32)
    la = linear_attention
    with pytest.raises(ValueError, match="batch size must be 1"):
        la(q, k, v, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(TypeError, match="integer"):
        la(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="end at T"):
        la(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        la(q, k[:, :4], v)
    with pytest.raises(ValueError, match="4 dims"):
        la(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="same feature size"):
        la(q, k[..., :3], v)
    with pytest.raises(TypeError, match="share a dtype"):
        la(q, k.double(), v)
    with pytest.raises(ValueError, match="causal=True"):
        la(q, k, v, causal=False, initial_state=(kv, ks))
    with pytest.raises(TypeError, match="tuple"):
        la(q, k, v, initial_state=kv)
    with pytest.raises(TypeError, match="tensor kv"):
        la(q, k, v, normalize=False, initial_state=(kv, ks))
    with pytest.raises(ValueError, match="shape"):
        la(q, k, v, initial_state=(kv[:1], ks))
    with pytest.raises(ValueError, match="shape"):
        la(q, k, v, initial_state=(kv, ks[..., :2]))
    with pytest.raises(ValueError, match="shape"):  # N must be the number of packed sequences
        la(q[:1], k[:1], v[:1], initial_state=(kv, ks), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(TypeError, match="floating"):
        la(q, k, v, initial_state=(kv, ks.long()))
    with pytest.raises(ValueError, match="chunk_size"):
        la(q, k, v, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size"):
        la(q, k, v, chunk_size=16.0)
    with pytest.raises(ValueError, match="scale"):
        la(q, k, v, scale=0.0)
    with pytest.raises(ValueError, match="scale"):
        la(q, k, v, scale=float("nan"))
    with pytest.raises(TypeError, match="scale"):
        la(q, k, v, scale="0.5")
    with pytest.raises(TypeError, match="causal"):
        la(q, k, v, causal=1)
    with pytest.raises(TypeError, match="normalize"):
        la(q, k, v, normalize="yes")
    with pytest.raises(TypeError, match="output_final_state"):
        la(q, k, v, output_final_state=None)
    with pytest.raises(ValueError, match="unknown backend"):
        la(q, k, v, backend="cuda")
    # a CPU tensor without the interpreter; the kernel module is imported first, while the
    # interpreter is on, so it is not built for a GPU that later tests in this process lack
    importlib.import_module("lintime.ops.linear.triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        la(q, k, v, backend="triton")
