"""The crash guard of GLA's Triton path for heads narrower than a 16-wide tile (``MIN_TILE_DIM`` in
``lintime/ops/gla/triton/ops.py``).

What is known: with ``K = 8`` (gla-tiny at width 64) the kernels gave an illegal memory access and wrong results on
a GPU; the cause is not established, and the interpreter (which does not fault on masked-out addresses) does not
reproduce it.  The guard sends such heads to the chunked PyTorch form (a static ``cu_seqlens`` zero-pads them to 16
instead: ``test_gla_static.py``).  Here: the guard's dispatch (runs on CPU), and a reproducer of the unguarded
configuration on CUDA, in a subprocess because an illegal memory access poisons the CUDA context of the process that
hits it.  The reproducer is expected to fail until the cause is found; once it passes, the guard can go.
"""

import subprocess
import sys

import pytest
import torch

import lintime.ops.gla.triton.ops as ops
from lintime.ops.gla.chunk import chunk_gla


def _inputs(K, V, T=70, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=g)
    gate = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=g))
    return q, k, v, gate


@pytest.mark.parametrize("K, V", [(8, 16), (16, 8), (8, 8)])
def test_narrow_heads_take_the_chunked_form(monkeypatch, K, V):
    """Heads narrower than ``MIN_TILE_DIM`` never reach a kernel: the call returns the chunked form's results."""
    def refuse(*args, **kwargs):
        raise AssertionError("a narrow head reached the Triton kernels")

    monkeypatch.setattr(ops, "gla_fwd_op", refuse)
    monkeypatch.setattr(ops, "gla_recurrent_op", refuse)
    q, k, v, gate = _inputs(K, V)
    h0 = torch.randn(1, 2, K, V)
    o, ht = ops.triton_gla(q, k, v, gate, initial_state=h0, output_final_state=True)
    ref, ref_ht = chunk_gla(q, k, v, gate, scale=K**-0.5, initial_state=h0, output_final_state=True)
    assert torch.equal(o, ref) and torch.equal(ht, ref_ht)


_REPRODUCER = """
import torch
import lintime.ops.gla.triton.ops as ops
from lintime.ops.gla.chunk import chunk_gla

ops.MIN_TILE_DIM = 1  # lift the guard: K = 8 heads reach the kernels
torch.manual_seed(0)
B, T, H, K, V = 2, 512, 8, 8, 8  # gla-tiny at width 64: 8 heads of 8
dev, dt = "cuda", torch.bfloat16
q, k, v = (torch.randn(B, T, H, d, device=dev, dtype=dt, requires_grad=True) for d in (K, K, V))
g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, device=dev)).to(dt).requires_grad_()
o, _ = ops.triton_gla(q, k, v, g)
o.float().square().sum().backward()
torch.cuda.synchronize()
grads = [x.grad.clone() for x in (q, k, v, g)]
leaves = [x.detach().float().requires_grad_() for x in (q, k, v, g)]
ref, _ = chunk_gla(*leaves, scale=K**-0.5)
ref.square().sum().backward()
for name, a, b in zip(("o", "dq", "dk", "dv", "dg"), [o, *grads], [ref, *(x.grad for x in leaves)]):
    err = ((a.float() - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err < 5e-2, f"{name}: relative error {err:.3g}"  # bf16 against fp32: wrong results are O(1)
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.xfail(strict=False, reason="known: K = 8 heads gave an illegal memory access and wrong results on a GPU "
                                        "(gla-tiny at width 64); cause not established, the interpreter does not "
                                        "reproduce it; guarded by MIN_TILE_DIM. On H200s it passed at fc49513 and "
                                        "failed (illegal memory access) at 58b67b7 and d23e4dc: intermittent; the guard stays")
def test_narrow_heads_unguarded_reproducer():
    """The unguarded ``K = V = 8`` forward and backward on CUDA, in a fresh process, against the chunked form in fp32."""
    r = subprocess.run([sys.executable, "-c", _REPRODUCER], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, (r.stdout + r.stderr)[-4000:]
