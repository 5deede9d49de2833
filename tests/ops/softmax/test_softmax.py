"""softmax_attention: dense textbook form vs SDPA, causal / non-causal, packing, gradients."""

import pytest
import torch

from lintime.ops import softmax_attention
from tolerances import assert_exact, assert_half_rule


def _inputs(B, T, H, K, V, dtype):
    g = torch.Generator().manual_seed(T * 7 + K)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("T", [1, 2, 63, 257])
def test_sdpa_matches_naive_with_grads(dtype, causal, T):
    q, k, v = (x.requires_grad_() for x in _inputs(2, T, 3, 60, 24, dtype))
    do = torch.randn(2, T, 3, 24, dtype=dtype)
    outs = {}
    for backend in ("naive", "chunk"):
        o = softmax_attention(q, k, v, causal=causal, backend=backend)
        grads = torch.autograd.grad(o, (q, k, v), do)
        outs[backend] = (o, *grads)
    for name, a, b in zip(("o", "dq", "dk", "dv"), outs["naive"], outs["chunk"]):
        assert_exact(f"softmax {name}", a, b)


@pytest.mark.parametrize("causal", [True, False])
def test_packing_equals_separate_calls(causal):
    lens = [5, 1, 40, 17]
    q, k, v = _inputs(1, sum(lens), 2, 16, 8, torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    for backend in ("naive", "chunk"):
        o = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu, backend=backend)
        for n in range(len(lens)):
            s, e = cu[n].item(), cu[n + 1].item()
            ref = softmax_attention(q[:, s:e], k[:, s:e], v[:, s:e], causal=causal, backend="naive")
            assert_exact(f"softmax packed seq {n} ({backend})", ref, o[:, s:e])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rule(dtype):
    q, k, v = _inputs(1, 96, 2, 32, 32, torch.float64)
    ref = softmax_attention(q, k, v, backend="naive")
    base = softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype), backend="naive")
    out = softmax_attention(q.to(dtype), k.to(dtype), v.to(dtype), backend="chunk")
    assert out.dtype == dtype
    assert_half_rule("softmax sdpa", ref, out, base)


def test_bad_inputs_fail_clearly():
    q, k, v = _inputs(2, 8, 1, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="batch size must be 1"):
        softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="not implemented"):
        softmax_attention(q, k, v, backend="recurrent")
    with pytest.raises(ValueError, match=r"\[B, T, H\]"):
        softmax_attention(q, k[:, :4], v)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_packed_half_precision_on_cuda_uses_one_varlen_call(dtype, causal):
    """The packed CUDA path (one varlen FlashAttention call) meets the half rule against the
    fp64 per-sequence reference, forward and every gradient, with empty and 1-token sequences."""
    from lintime.ops.softmax import chunk as sdpa

    if sdpa._varlen_fn() is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    lens = [300, 0, 1, 517, 64, 141]
    q, k, v = _inputs(1, sum(lens), 4, 64, 64, torch.float64)
    do = torch.randn_like(v)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def run(dt, backend, dev):
        xs = [x.to(dev, dt).requires_grad_() for x in (q, k, v)]
        o = softmax_attention(*xs, causal=causal, cu_seqlens=cu.to(dev), backend=backend)
        return (o, *torch.autograd.grad(o, xs, do.to(dev, dt)))

    assert sdpa._varlen_ok(q.cuda().to(dtype), k.cuda().to(dtype), v.cuda().to(dtype))
    ref = run(torch.float64, "naive", "cpu")
    base = run(dtype, "naive", "cuda")
    out = run(dtype, "chunk", "cuda")
    for name, r, b, o in zip(("o", "dq", "dk", "dv"), ref, base, out):
        assert_half_rule(f"softmax varlen {name}", r, o.cpu(), b.cpu())


def test_packed_path_on_cpu_is_per_sequence():
    """Without CUDA half precision the varlen FlashAttention path is never taken."""
    from lintime.ops.softmax import chunk as sdpa

    q, k, v = _inputs(1, 8, 1, 8, 8, torch.float32)
    assert not sdpa._varlen_ok(q, k, v)
    assert not sdpa._varlen_ok(q.bfloat16(), k.bfloat16(), v.bfloat16())


@pytest.mark.parametrize("causal", [True, False])
def test_rows_of_one_length_are_one_batched_call(causal, monkeypatch):
    """Packed sequences of one common length go to SDPA as an [N, L] batch (one call, the kernel HF's
    models get) and equal the per-sequence result, forward and gradients; unequal lengths do not."""
    from lintime.ops.softmax import chunk as sdpa

    calls = []
    real = sdpa._sdpa
    monkeypatch.setattr(sdpa, "_sdpa", lambda q, *a: calls.append(tuple(q.shape)) or real(q, *a))
    q, k, v = (x.requires_grad_() for x in _inputs(1, 3 * 37, 2, 16, 8, torch.float64))
    cu = torch.tensor([0, 37, 74, 111])
    o = softmax_attention(q, k, v, causal=causal, cu_seqlens=cu, backend="chunk")
    assert calls == [(3, 37, 2, 16)]
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref = torch.cat([softmax_attention(q[:, s:s + 37], k[:, s:s + 37], v[:, s:s + 37], causal=causal,
                                       backend="naive") for s in (0, 37, 74)], dim=1)
    assert_exact("equal rows o", ref, o)
    for name, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(ref, (q, k, v), do), grads):
        assert_exact(f"equal rows {name}", a, b)
    calls.clear()
    softmax_attention(q, k, v, causal=causal, cu_seqlens=torch.tensor([0, 36, 74, 111]), backend="chunk")
    assert calls == [(1, 36, 2, 16), (1, 38, 2, 16), (1, 37, 2, 16)]
