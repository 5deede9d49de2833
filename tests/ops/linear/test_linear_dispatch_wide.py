"""Automatic dispatch of linear_attention keeps heads wider than AUTO_TRITON_MAX_HEAD (64) off the
Triton kernels: on the H200 (2026-11-22) performer-base (K = 256 features, V = 64) and
performer-medium (K = 128, V = 64) failed there with "CUDA error: an illegal memory access"; the
wide-tile kernels had never run on a GPU.  The CUDA case is simulated on CPU: Triton reported
available and the triton implementation replaced by a recorder."""

import pytest
import torch

import lintime.ops.dispatch as dispatch
import lintime.ops.linear as linear_mod
from lintime.ops import linear_attention
from tolerances import EXACT_TOL, assert_close


@pytest.fixture
def fake_cuda_triton(monkeypatch):
    calls = []

    def recorder(q, k, v, **kw):
        calls.append((q.shape[-1], v.shape[-1]))
        return linear_mod.chunk_linear_attention(q, k, v, **kw)

    monkeypatch.setattr(dispatch, "triton_available", lambda device: True)
    monkeypatch.setitem(linear_mod._IMPLS, "triton", recorder)
    return calls


def _qkv(K, V, T=9, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(1, T, H, K, generator=g) + 1e-3 for _ in range(2))
    return q, k, torch.randn(1, T, H, V, generator=g)


@pytest.mark.parametrize("K,V", [(256, 64), (128, 64), (64, 128), (65, 16)])
def test_wide_heads_do_not_take_triton_automatically(fake_cuda_triton, K, V):
    q, k, v = _qkv(K, V)
    h0 = (torch.rand(1, 2, K, V), torch.rand(1, 2, K) + 1)
    o, st = linear_attention(q, k, v, initial_state=h0, output_final_state=True)
    o1, _ = linear_attention(q[:, :1], k[:, :1], v[:, :1], initial_state=st, output_final_state=True)  # decoding
    assert fake_cuda_triton == []
    ref, _ = linear_attention(q, k, v, initial_state=h0, output_final_state=True, backend="chunk")
    assert_close("o", ref, o, EXACT_TOL[torch.float32])
    assert torch.isfinite(o1).all()


def test_narrow_heads_and_explicit_triton_still_take_it(fake_cuda_triton):
    q, k, v = _qkv(64, 64)
    linear_attention(q, k, v)
    q2, k2, v2 = _qkv(256, 64)
    linear_attention(q2, k2, v2, backend="triton")  # an explicit request is honoured
    assert fake_cuda_triton == [(64, 64), (256, 64)]
