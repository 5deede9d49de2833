"""The layer's output gate ``o * silu(g_pre)`` on its Triton kernels (lintime/ops/vq/triton/gate.py) against the
PyTorch composite: value and both gradients, the gate a strided slice of a wider projection, partial tiles; fp32
by the exact rule, fp16 by the half rule (fp64 reference, the fp16 composite as the base), through the interpreter
on the CPU (on CUDA, the compiled kernels); opcheck."""

import pytest
import torch

from lintime.ops.vq.gate import vq_gate
from tolerances import assert_exact, assert_half_rule

pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _run(backend, o, wide, dtype):
    """``(y, do, dg_pre)`` with ``g_pre`` the last ``E`` columns of ``wide`` (a strided slice)."""
    o = o.to(dtype).detach().requires_grad_()
    wide = wide.to(dtype).detach().requires_grad_()
    E = o.shape[-1]
    y = vq_gate(o, wide[..., -E:], backend=backend)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    do, dwide = torch.autograd.grad((y.double() * w).sum(), (o, wide))
    assert torch.count_nonzero(dwide[..., :-E]) == 0
    return y, do, dwide[..., -E:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_equals_the_composite(dtype):
    g = torch.Generator().manual_seed(0)
    B, T, E = 2, 7, 37
    o = torch.randn(B, T, E, generator=g, dtype=torch.float64).to(DEV)
    wide = (torch.randn(B, T, E + 11, generator=g, dtype=torch.float64) * 2).to(DEV)
    ref = _run("chunk", o, wide, torch.float64)
    out = _run("triton", o, wide, dtype)
    assert out[0].dtype == dtype
    if dtype == torch.float32:
        for name, a, b in zip(("y", "do", "dg"), ref, out):
            assert_exact(name, a, b)
    else:
        base = _run("chunk", o, wide, dtype)
        for name, a, b, c in zip(("y", "do", "dg"), ref, out, base):
            assert_half_rule(name, a, b, c)


def test_automatic_choice_and_checks():
    o = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(vq_gate(o, o), o * torch.nn.functional.silu(o))  # fp64: the composite
    with pytest.raises(ValueError, match="one shape"):
        vq_gate(o, o[:, :3])


def test_opcheck():
    from lintime.ops.vq.triton.gate import vq_gate_op  # noqa: F401  (registers the op)

    g = torch.Generator().manual_seed(2)
    o = torch.randn(5, 20, generator=g).to(DEV).requires_grad_()
    wide = torch.randn(5, 26, generator=g).to(DEV)
    torch.library.opcheck(torch.ops.lintime.vq_gate.default, (o, wide[:, 6:].requires_grad_()),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_value_silu_equals_the_composite_with_a_strided_gradient(dtype):
    """The values' SiLU (vq_value_silu, Triton): value and gradient equal F.silu's, the incoming gradient a strided
    slice of a padded layout (rows of each sequence after two empty blocks, as vq_attention's gradient arrives);
    fp32 exact, fp16 by the half rule."""
    from lintime.ops.vq.gate import vq_value_silu

    g = torch.Generator().manual_seed(3)
    B, T, E, pad = 3, 10, 37, 4
    z = (torch.randn(B, T, E, generator=g, dtype=torch.float64) * 2).to(DEV)
    lay_w = torch.randn(B, pad + T, E, generator=g, dtype=torch.float64).to(DEV)

    def run(backend, dt):
        zz = z.to(dt).requires_grad_()
        y = vq_value_silu(zz, backend=backend)
        buf = torch.cat([y.new_zeros(B, pad, E), y], 1)  # the layout: its gradient to y is a strided slice
        (dz,) = torch.autograd.grad((buf.double() * lay_w).sum(), zz)
        return y, dz

    ref, out = run("chunk", torch.float64), run("triton", dtype)
    assert out[0].dtype == out[1].dtype == dtype
    if dtype == torch.float32:
        for name, a, b in zip(("y", "dz"), ref, out):
            assert_exact(name, a, b)
    else:
        base = run("chunk", dtype)
        for name, a, b, c in zip(("y", "dz"), ref, out, base):
            assert_half_rule(name, a, b, c)


def test_value_silu_opcheck():
    from lintime.ops.vq.triton.gate import vq_silu_op  # noqa: F401  (registers the op)

    z = torch.randn(2, 5, 20, generator=torch.Generator().manual_seed(4)).to(DEV).requires_grad_()
    torch.library.opcheck(torch.ops.lintime.vq_silu.default, (z,),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
