"""mixed_chunk_decode_step_: FLASH's one-token decoding step, in place, against the op chain it replaces --
``gau_heads`` then the recurrent form of ``mixed_chunk_attention`` from the same state -- token by token over
sequences that cross several chunk boundaries (rows at different fills, one completing its chunk on the first
step), for every ``linear_norm``, with and without the bias, two scales: the outputs, and every field of the state
after each run.  The fused kernels run on the CPU through the Triton interpreter (fp32 exact, fp16 by the
half-precision rule; 16-slot blocks and 16-column programs, so the shapes below span several of each, partial
ones included).  A FLASH model decoding through ``StaticDecoder`` with the fused step gives the eager path's
greedy tokens, and its state is the same object after every step.  On CUDA (marked): FLASH-base's shapes in bf16,
and one step captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lintime.layers.flash import FLASH, FLASHState
from lintime.models import CausalLM, get_preset
from lintime.modules import gau_heads
from lintime.ops import MixedChunkState, mixed_chunk_attention, mixed_chunk_decode_step_
from lintime.ops.utils import mark_checked
from tolerances import HALF_FACTOR, HALF_FLOOR, assert_close, assert_exact, assert_half_rule, rel_rms

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
# the interpreter tests build CPU tensors; on a CUDA machine the CUDA tests below cover the compiled kernels
cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests: the CUDA tests below cover the compiled kernels")
FIELDS = ("kv", "count", "k_quad", "k_lin", "v", "fill")


def _problem(N, T, S, E, C, fills, chunks, seed=0):
    """fp64 inputs of ``T`` steps: the projections ``h [N, T, 2E + S]``, heads' ``gamma, beta``, positions
    continuing each row's state, a bias, and a state with ``chunks[n]`` completed chunks and ``fills[n]``
    buffered tokens (zero beyond, as the ops leave it)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    h = rnd(N, T, 2 * E + S)
    gamma, beta = 1.0 + rnd(4, S, std=0.3), rnd(4, S, std=0.3)
    offsets = torch.tensor([c * C + f for c, f in zip(chunks, fills)])
    positions = offsets[:, None] + torch.arange(T)
    keep = (torch.arange(C)[None, :] < torch.tensor(fills)[:, None])[:, :, None, None]
    state = MixedChunkState(
        kv=rnd(N, 1, S, E, std=3.0), count=torch.tensor(chunks) * C,
        k_quad=rnd(N, C, 1, S) * keep, k_lin=rnd(N, C, 1, S, std=0.5) * keep, v=rnd(N, C, 1, E) * keep,
        fill=torch.tensor(fills),
    )
    return h, gamma, beta, positions, rnd(1, 2 * C - 1, std=0.5), state


def _cast(state, dtype, device=None):
    """``state`` with its buffers in ``dtype`` and ``kv`` in the accumulation dtype, on ``device`` (default: its own)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    device = state.kv.device if device is None else device
    want = {"kv": acc, "k_quad": dtype, "k_lin": dtype, "v": dtype, "count": torch.long, "fill": torch.long}
    return MixedChunkState(**{f: getattr(state, f).to(device, want[f]) for f in FIELDS})


def _reference(h, gamma, beta, positions, state, dtype, **kw):
    """The op chain of the layer's eager step in ``dtype``: heads, the recurrent form from ``state``, the gate."""
    E, S = state.v.shape[-1], state.k_quad.shape[-1]
    h = h.to(dtype)
    u, v, heads = gau_heads(h, gamma.to(dtype), beta.to(dtype), positions, e=E, s=S, backend="naive")
    qq, kq, ql, kl = (heads[:, :, i : i + 1] for i in range(4))
    o, final = mixed_chunk_attention(qq, kq, ql, kl, v[:, :, None], initial_state=_cast(state, dtype),
                                     output_final_state=True, chunk_size=state.chunk_size, backend="recurrent",
                                     **kw)
    return u * o[:, :, 0], final


def _steps(h, gamma, beta, positions, state, dtype, backend, device="cpu", **kw):
    """The in-place step token by token; the outputs ``[N, T, E]`` and the state (the same tensors throughout)."""
    state = _cast(state, dtype, device)
    ptrs = [getattr(state, f).data_ptr() for f in FIELDS]
    args = (h.to(device, dtype), gamma.to(device, dtype), beta.to(device, dtype), positions.to(device))
    outs = [mixed_chunk_decode_step_(args[0][:, t], args[1], args[2], args[3][:, t], state, backend=backend, **kw)
            for t in range(h.shape[1])]
    assert [getattr(state, f).data_ptr() for f in FIELDS] == ptrs
    return torch.stack(outs, 1), state


# (dtype, linear_norm, scale, bias, backend, steps): the long runs cross three chunk boundaries (row 0 at steps
# 1 and 17, row 1 at step 12); the short ones one (row 0 at step 1), then read the linear sum it made
CASES = [
    (torch.float32, "tokens", None, True, "triton", 18),
    (torch.float32, "chunk", 0.3, False, "triton", 3),
    (torch.float32, "none", None, True, "triton", 3),
    (torch.float16, "tokens", 0.3, True, "triton", 3),
    (torch.float32, "tokens", None, True, "recurrent", 18),
]


@pytest.mark.parametrize("dtype,linear_norm,scale,bias,backend,T", CASES)
@cpu_only
def test_decode_step_equals_heads_then_recurrent_form(dtype, linear_norm, scale, bias, backend, T):
    # C = 16: two 8-slot blocks under the interpreter; E = 24: two 16-column programs, one partial; S = 16
    N, S, E, C = 2, 16, 24, 16
    h, gamma, beta, positions, rb, state = _problem(N, T, S, E, C, fills=[14, 3], chunks=[1, 0])
    kw = dict(rel_bias=_bias(rb, bias, dtype), scale=scale, linear_norm=linear_norm)
    ref, ref_state = _reference(h, gamma, beta, positions, state, dtype, **kw)
    out, out_state = _steps(h, gamma, beta, positions, state, dtype, backend, **kw)
    assert out.dtype == dtype
    for f in ("count", "fill"):
        assert torch.equal(getattr(ref_state, f), getattr(out_state, f)), f
    # slots beyond fill hold no token: zero, as the recurrent form leaves them
    free = torch.arange(C)[None, :] >= out_state.fill[:, None]
    assert not out_state.k_quad[free].any() and not out_state.k_lin[free].any() and not out_state.v[free].any()
    if dtype == torch.float32:
        assert_exact("u * a", ref, out)
        for f in ("kv", "k_quad", "k_lin", "v"):
            assert_exact(f, getattr(ref_state, f), getattr(out_state, f))
        return
    ref64, ref64_state = _reference(h, gamma, beta, positions, state, torch.float64,
                                    **{**kw, "rel_bias": _bias(rb, bias, torch.float64)})
    assert_half_rule("u * a", ref64, out, ref)
    for f in ("k_quad", "k_lin", "v"):
        assert_half_rule(f, getattr(ref64_state, f), getattr(out_state, f), getattr(ref_state, f))
    assert_close("kv", ref_state.kv, out_state.kv, 1e-6)  # fp32 sums of the same fp16 products


def _bias(rb, on, dtype):
    return rb.to(dtype) if on else None


@cpu_only
def test_decode_step_rejects_what_it_cannot_update_in_place():
    h, gamma, beta, positions, rb, state = _problem(2, 1, 8, 16, 16, fills=[1, 2], chunks=[0, 0])
    st = _cast(state, torch.float32)
    args = (h[:, 0].float(), gamma.float(), beta.float(), positions[:, 0])
    with pytest.raises(ValueError, match="contiguous"):
        st.v = st.v.transpose(0, 1).contiguous().transpose(0, 1)
        mixed_chunk_decode_step_(*args, st, backend="triton")
    st = _cast(state, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        mixed_chunk_decode_step_(args[0].double(), *args[1:], st)
    with pytest.raises(ValueError, match=r"\[1, 2C - 1\]"):
        mixed_chunk_decode_step_(*args, st, rel_bias=rb[:, :-1].float())
    with pytest.raises(ValueError, match="fill"):
        st.fill = torch.tensor([16, 0])
        mixed_chunk_decode_step_(*args, st)


# ------------------------------------------------------------------ a model through StaticDecoder


def _tiny_flash():
    cfg = get_preset("flash-tiny", vocab_size=64)
    cfg = dataclasses.replace(cfg, d_model=16, n_layers=2, mixer=dataclasses.replace(cfg.mixer, s=16, chunk_size=4))
    torch.manual_seed(0)
    return CausalLM(cfg).eval()


@cpu_only
def test_static_decoding_through_the_fused_step_gives_the_eager_tokens(eager_and_static_decode):
    m = _tiny_flash()
    ids = torch.tensor([[3, 14, 15, 9, 26], [5, 35, 8, 9, 7]])
    steps = 7  # positions 5..11: both rows complete a chunk twice (C = 4)
    with torch.no_grad():
        eager, eager_logits, fused, fused_logits, dec = eager_and_static_decode(m, ids, steps)
    assert all(isinstance(s, FLASHState) for s in dec.state.layers)
    assert torch.equal(eager, fused)
    assert_exact("logits", eager_logits, fused_logits)
    assert dec.state.offset.tolist() == [ids.shape[1] + steps] * 2


@cpu_only
def test_static_decoding_under_autocast_takes_the_fused_step(eager_and_static_decode):
    """fp32 weights under fp16 autocast (how `lintime bench model` decodes): the state's buffers are fp16, the step
    runs the fused op in fp16 (every layer, every step) and gives the eager autocast tokens and logits."""
    m = _tiny_flash()
    ids = torch.tensor([[3, 14, 15, 9, 26], [5, 35, 8, 9, 7]])
    steps = 7
    calls = []
    real = FLASH._decode_step_
    FLASH._decode_step_ = lambda self, *a: calls.append(1) or real(self, *a)  # only the static path calls it
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            eager, eager_logits, fused, fused_logits, dec = eager_and_static_decode(m, ids, steps)
    finally:
        FLASH._decode_step_ = real
    assert dec.state.layers[0].mc.v.dtype == torch.float16
    assert len(calls) == steps * len(m.backbone.blocks)
    assert torch.equal(eager, fused)
    assert_exact("logits", eager_logits.float(), fused_logits.float())


@cpu_only
def test_layer_step_in_place_equals_its_eager_step():
    """scaling='ns' (the scaled bias) and linear_norm='chunk' through the layer; the layer keeps its own path
    for eager states, on the CPU without backend='triton', and with gradients."""
    torch.manual_seed(0)
    layer = FLASH(16, expansion_dim=16, key_dim=8, chunk_size=4, scaling="ns", linear_norm="chunk")
    x = torch.randn(2, 6, 16)
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        eager, st = [], layer.init_state(2, "cpu", torch.float32)
        for t in range(6):
            y, st = layer(x[:, t : t + 1], st, positions=pos[:, t : t + 1])
            eager.append(y)
        static = layer.init_state(2, "cpu", torch.float32).with_capacity(6)
        _, new = layer(x[:, :1], static, positions=pos[:, :1])  # CPU, backend None: a new state
        assert new is not static and not layer.init_state(2, "cpu", torch.float32).static
        static = layer.init_state(2, "cpu", torch.float32).with_capacity(6)
        layer.backend = "triton"
        fused = []
        for t in range(6):
            y, new = layer(x[:, t : t + 1], static, positions=pos[:, t : t + 1])
            assert new is static
            fused.append(y)
    assert_exact("y", torch.cat(eager, 1), torch.cat(fused, 1))
    for f in ("kv", "k_quad", "k_lin", "v"):
        assert_exact(f, getattr(st.mc, f), getattr(static.mc, f))
    assert torch.equal(st.mc.fill, static.mc.fill) and torch.equal(st.mc.count, static.mc.count)
    _, new = layer(x[:, :1], static, positions=pos[:, :1])  # gradients on: never in place
    assert new is not static


# ------------------------------------------------------------------ CUDA


@pytest.mark.cuda
def test_decode_step_cuda_flash_base_shapes_bf16():
    N, T, S, E, C = 2, 12, 128, 1536, 256
    h, gamma, beta, positions, rb, state = _problem(N, T, S, E, C, fills=[250, 3], chunks=[3, 0])
    kw = dict(scale=1.0 / C, linear_norm="tokens")
    dt = torch.bfloat16
    out, out_state = _steps(h, gamma, beta, positions, state, dt, "triton", device="cuda",
                            rel_bias=rb.to("cuda", dt), **kw)
    hc, gc, bc, pc = h.cuda(), gamma.cuda(), beta.cuda(), positions.cuda()
    base, base_state = _reference(hc, gc, bc, pc, _cast(state, torch.float64, "cuda"), dt,
                                  rel_bias=rb.to("cuda", dt), **kw)
    ref, ref_state = _reference(hc, gc, bc, pc, _cast(state, torch.float64, "cuda"), torch.float64,
                                rel_bias=rb.cuda(), **kw)
    assert_half_rule("u * a", ref, out, base)
    # kv is an fp32 sum of bf16 products in both forms: the half rule with the floor of the products' dtype
    e_out, e_base = rel_rms(ref_state.kv, out_state.kv), rel_rms(ref_state.kv, base_state.kv)
    assert e_out <= HALF_FACTOR * e_base + HALF_FLOOR[dt], (e_out, e_base)
    for f in ("count", "fill"):
        assert torch.equal(getattr(base_state, f), getattr(out_state, f)), f


@pytest.mark.cuda
def test_decode_step_cuda_graph_replay_equals_eager_steps():
    N, S, E, C = 3, 128, 512, 16
    h, gamma, beta, positions, rb, state = _problem(N, 2 * C, S, E, C, fills=[0, 7, 15], chunks=[0, 1, 2])
    dt = torch.bfloat16
    args = [x.to("cuda", dt) for x in (h, gamma, beta)] + [positions.cuda()]
    kw = dict(rel_bias=rb.to("cuda", dt), linear_norm="tokens")
    eager = _cast(state, dt, "cuda")
    want = [mixed_chunk_decode_step_(args[0][:, t], args[1], args[2], args[3][:, t], eager, **kw)
            for t in range(2 * C)]
    graphed = _cast(state, dt, "cuda")
    x, p = args[0][:, 0].clone(), args[3][:, 0].clone()
    mixed_chunk_decode_step_(x, args[1], args[2], p, _cast(state, dt, "cuda"), **kw)  # compile outside capture
    mark_checked(graphed.fill, graphed.count)  # the value check is a host read: not inside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = mixed_chunk_decode_step_(x, args[1], args[2], p, graphed, **kw)
    for t in range(2 * C):
        x.copy_(args[0][:, t])
        p.copy_(args[3][:, t])
        graph.replay()
        assert torch.equal(y, want[t]), t
    for f in FIELDS:
        assert torch.equal(getattr(graphed, f), getattr(eager, f)), f
