"""The crash guard of linear attention's automatic dispatch (``AUTO_TRITON_MAX_HEAD`` in
``lintime/ops/linear/__init__.py``).

What is known: heads wider than 64 (performer-base: K = 256 features, V = 64; performer-medium: K = 128, V = 64)
failed on a GPU with "CUDA error: an illegal memory access" in ``bench model``; their wide-tile kernels (8 warps,
1 stage, split dk / dv walks) pass the interpreter tests, which do not fault on masked-out addresses; the cause is
not established.  Automatic dispatch therefore keeps such heads on the PyTorch forms, and ``backend="triton"``
still runs the kernels.  Here: the guard's dispatch (the CUDA case simulated on CPU: Triton reported available and
the triton implementation replaced by a recorder), and a reproducer of the unguarded configuration on CUDA, in a
subprocess because an illegal memory access poisons the CUDA context of the process that hits it; it is expected to
fail until the cause is found, and once it passes the guard can go."""

import subprocess
import sys

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


_REPRODUCER = """
import sys
import torch
from lintime.ops import linear_attention

torch.manual_seed(0)
K = int(sys.argv[1])
B, T, H, V = 2, 2048, 12, 64  # performer-base / -medium heads: K = 256 / 128 features, V = 64
dev, dt = "cuda", torch.bfloat16
q, k = ((torch.rand(B, T, H, K, device=dev) + 1e-3).to(dt).requires_grad_() for _ in range(2))
v = torch.randn(B, T, H, V, device=dev, dtype=dt, requires_grad=True)
o, _ = linear_attention(q, k, v, backend="triton")  # explicit: past the automatic guard
o.float().square().sum().backward()
torch.cuda.synchronize()
grads = [x.grad.clone() for x in (q, k, v)]
leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
ref, _ = linear_attention(*leaves, backend="chunk")
ref.square().sum().backward()
for name, a, b in zip(("o", "dq", "dk", "dv"), [o, *grads], [ref, *(x.grad for x in leaves)]):
    err = ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err < 5e-2, f"{name}: relative error {err:.3g}"  # bf16 against fp32: wrong results are O(1)
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.xfail(strict=False, reason="known: K = 256 / 128 heads (performer-base / -medium) gave an illegal "
                                        "memory access on a GPU; cause not established, the interpreter does not "
                                        "reproduce it; guarded by AUTO_TRITON_MAX_HEAD. On H200s it passed "
                                        "at fc49513 and failed (illegal memory access) at 58b67b7 and d23e4dc: intermittent; the guard stays")
@pytest.mark.parametrize("K", [256, 128])
def test_wide_heads_unguarded_reproducer(K):
    """The unguarded wide heads' forward and backward on CUDA, in a fresh process, against the chunked form in fp32."""
    r = subprocess.run([sys.executable, "-c", _REPRODUCER, str(K)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout + r.stderr)[-4000:]
