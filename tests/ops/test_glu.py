"""glu_activation (a GLU block's ``act(u) * v``): naive (fp64 definition) <-> chunk (PyTorch composite) <-> Triton
(interpreter on CPU, compiled on CUDA), the output and the gradient of ``h``, silu and gelu, odd sizes, the
half-precision rule; the GLU layer's fused path against its PyTorch form."""

import pytest
import torch

from lintime.ops import gated_activation, glu_activation
from lintime.testing import assert_exact, assert_half_rule

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
ACTS = ("silu", "gelu")


def _inputs(shape, seed=1, device=DEV):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(shape, generator=g) * 2
    dy = torch.randn(*shape[:-1], shape[-1] // 2, generator=g)
    return h.to(device), dy.to(device)


def _run(h, dy, act, backend):
    h = h.detach().clone().requires_grad_()
    y = glu_activation(h, activation=act, backend=backend)
    y.backward(dy.to(y.dtype))
    return y, h.grad


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", [(1, 2), (37, 42), (3, 5, 1030)])
def test_fp32_forms_agree_with_fp64_definition(act, shape):
    """fp32 chunk and Triton equal the fp64 definition to fp32 exactness, output and gradient."""
    h, dy = _inputs(shape)
    ref = _run(h.double(), dy.double(), act, "naive")
    for backend in ("chunk", "triton"):
        out = _run(h, dy, act, backend)
        for name, want, got in zip(("y", "dh"), ref, out):
            assert got.dtype == torch.float32 and got.shape == want.shape, (backend, name)
            assert_exact(f"{backend} {act} {name}", want, got)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])
def test_half_inputs_by_the_half_rule(act, dtype):
    h, dy = _inputs((45, 2 * 100), seed=2)
    ref = _run(h.double(), dy.double(), act, "naive")
    base = _run(h.to(dtype), dy.to(dtype), act, "chunk")
    out = _run(h.to(dtype), dy.to(dtype), act, "triton")
    for name, r, b, o in zip(("y", "dh"), ref, base, out):
        assert o.dtype == dtype
        assert_half_rule(f"{act} {name}", r, o, b)


def test_equals_the_layers_former_math_and_no_rows():
    """On the CPU the automatic backend is the chunk form, bit for bit ``act(u) * v`` of the split; empty inputs."""
    h, dy = _inputs((7, 16), seed=3, device="cpu")
    u, v = h.split(8, -1)
    assert torch.equal(glu_activation(h), torch.nn.functional.silu(u) * v)
    assert torch.equal(glu_activation(h, activation="gelu"), torch.nn.functional.gelu(u) * v)
    for backend in ("chunk", "triton"):
        y, dh = _run(h[:0].to(DEV), dy[:0].to(DEV), "silu", backend)  # the kernels: CUDA, or the CPU interpreter
        assert y.shape == (0, 8) and dh.shape == (0, 16)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="even"):
        glu_activation(torch.randn(3, 5))
    with pytest.raises(ValueError, match="activation"):
        glu_activation(torch.randn(3, 4), activation="relu")
    with pytest.raises(TypeError, match="floating"):
        glu_activation(torch.ones(3, 4, dtype=torch.long))


def test_custom_ops_pass_opcheck():
    """Schema, fake tensors, autograd registration and AOT dispatch of ``lintime::glu_*``."""
    from lintime.ops.glu.triton import ops as glu_ops  # noqa: F401  (registers the ops)

    h, dy = _inputs((6, 32), seed=4)
    torch.library.opcheck(torch.ops.lintime.glu_fwd, (h.requires_grad_(), 1))
    torch.library.opcheck(torch.ops.lintime.glu_bwd, (dy, h.detach(), 0))


@pytest.mark.parametrize("act", ACTS)
def test_glu_layer_fused_path_is_the_same_function(act):
    """The GLU block's PyTorch form (``fused = False``) against its op path: on CUDA the block's own fused dispatch,
    on the CPU (where the automatic backend is the PyTorch form) the block's layers around the op's Triton form
    through the interpreter; output and every parameter gradient, fp32."""
    from lintime.layers.ffn import GLU

    torch.manual_seed(0)
    m = GLU(24, 40, activation_name=act).to(DEV)
    x = torch.randn(3, 11, 24, device=DEV)
    outs = []
    for fused in (False, True):
        m.fused = fused
        m.zero_grad()
        if fused and DEV == "cpu":
            import lintime.ops.glu as glu_mod

            y = m.down(glu_mod.glu_activation(m.up(x), activation=act, backend="triton"))
        else:
            y = m(x)
        y.square().sum().backward()
        outs.append((y.detach(), *(p.grad.clone() for p in m.parameters())))
    for i, (a, b) in enumerate(zip(*outs)):
        assert_exact(f"{act} {i}", a.double(), b)


@pytest.mark.cuda
@pytest.mark.parametrize("act", ACTS)
def test_cuda_gla_base_size_bf16(act):
    """A gla-base-sized call (4099 rows, 2 x 2048 columns) in bf16 against the PyTorch form: within two bf16
    roundings of each other (the kernel rounds once, the composite after each step)."""
    h, dy = _inputs((4099, 4096), seed=5)
    h, dy = h.bfloat16(), dy.bfloat16()
    ref = _run(h, dy, act, "chunk")
    out = _run(h, dy, act, None)
    for name, a, b in zip(("y", "dh"), ref, out):
        torch.testing.assert_close(b.float(), a.float(), rtol=2**-6, atol=2**-6 * a.float().abs().max().item(),
                                   msg=name)


# ------------------------------------------------------------------ gated_activation: act(u) * v of two tensors
def _gated_inputs(shape, seed=11, device=DEV, wide=0, dtype=torch.float32):
    """``(U, V, dy, wide)``: ``u = U[..., wide:]`` and ``v = V[..., :e]`` of ``shape``; with ``wide > 0`` both are
    column slices of wider tensors (row-strided views, as the FLASH gate's ``u`` part of a projection can be)."""
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(*shape[:-1], shape[-1] + wide, generator=g) * 2
    V = torch.randn(*shape[:-1], shape[-1] + wide, generator=g)
    dy = torch.randn(shape, generator=g)
    return U.to(device, dtype), V.to(device, dtype), dy.to(device, dtype), wide


def _run_gated(U, V, dy, wide, act, backend, dtype=None):
    """``y, du, dv`` of ``gated_activation(U[..., wide:], V[..., :e])`` (the views themselves are passed)."""
    dtype = dtype or U.dtype
    U, V = U.detach().to(dtype).requires_grad_(), V.detach().to(dtype).requires_grad_()
    e = U.shape[-1] - wide
    u, v = U[..., wide:], V[..., :e]
    assert wide == 0 or not (u.is_contiguous() or v.is_contiguous())
    y = gated_activation(u, v, activation=act, backend=backend)
    y.backward(dy.to(y.dtype))
    return y, U.grad[..., wide:], V.grad[..., :e]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape, wide", [((1, 1), 0), ((37, 42), 5), ((3, 5, 1030), 0), ((2, 9, 70), 3)])
def test_gated_fp32_forms_agree_with_fp64_definition(act, shape, wide):
    """fp32 chunk and Triton equal the fp64 definition ``act(u) * v`` to fp32 exactness: output and both
    gradients, contiguous inputs and row-strided views."""
    U, V, dy, w = _gated_inputs(shape, wide=wide)
    ref = _run_gated(U, V, dy, w, act, "naive", torch.float64)
    for backend in ("chunk", "triton"):
        out = _run_gated(U, V, dy, w, act, backend)
        for name, want, got in zip(("y", "du", "dv"), ref, out):
            assert got.dtype == torch.float32 and got.shape == want.shape, (backend, name)
            assert_exact(f"{backend} {act} {name}", want, got)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])
def test_gated_half_inputs_by_the_half_rule(act, dtype):
    U, V, dy, w = _gated_inputs((45, 100), seed=12, wide=4)
    ref = _run_gated(U, V, dy, w, act, "naive", torch.float64)
    base = _run_gated(U, V, dy, w, act, "chunk", dtype)
    out = _run_gated(U, V, dy, w, act, "triton", dtype)
    for name, r, b, o in zip(("y", "du", "dv"), ref, base, out):
        assert o.dtype == dtype
        assert_half_rule(f"{act} {name}", r, o, b)


def test_gated_mixed_dtypes_keep_each_gradient_in_its_own():
    """fp16 ``u`` and fp32 ``v``: the output in the promoted dtype (fp32), ``du`` fp16, ``dv`` fp32; the values
    those of the fp32 computation rounded once."""
    g = torch.Generator().manual_seed(13)
    u64, v64, dy64 = (torch.randn(13, 24, generator=g, dtype=torch.float64) for _ in range(3))
    u64 = u64.half().double()
    runs = []
    for ut, vt, backend in ((torch.float64, torch.float64, "naive"), (torch.float16, torch.float32, "triton")):
        u = u64.to(DEV, ut).detach().clone().requires_grad_()
        v = v64.to(DEV, vt).detach().clone().requires_grad_()
        y = gated_activation(u, v, activation="silu", backend=backend)
        y.backward(dy64.to(DEV, y.dtype))
        runs.append((y, u.grad, v.grad))
    ref, out = runs
    assert [t.dtype for t in out] == [torch.float32, torch.float16, torch.float32]
    assert_exact("y", ref[0], out[0])
    assert_exact("dv", ref[2], out[2])
    torch.testing.assert_close(out[1].double(), ref[1], rtol=2**-10, atol=1e-3 * ref[1].abs().max().item())


def test_gated_equals_the_layers_former_math_and_errors():
    """On the CPU the automatic backend is the chunk form, bit for bit ``silu(u) * v``; empty inputs; bad
    arguments raise."""
    U, V, dy, _ = _gated_inputs((7, 16), seed=14, device="cpu")
    assert torch.equal(gated_activation(U, V), torch.nn.functional.silu(U) * V)
    assert torch.equal(gated_activation(U, V, activation="gelu"), torch.nn.functional.gelu(U) * V)
    for backend in ("chunk", "triton"):
        y, du, dv = _run_gated(U[:0].to(DEV), V[:0].to(DEV), dy[:0].to(DEV), 0, "silu", backend)
        assert y.shape == du.shape == dv.shape == (0, 16)
    with pytest.raises(ValueError, match="one shape"):
        gated_activation(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(ValueError, match="activation"):
        gated_activation(torch.randn(3, 4), torch.randn(3, 4), activation="relu")
    with pytest.raises(TypeError, match="floating"):
        gated_activation(torch.randn(3, 4), torch.ones(3, 4, dtype=torch.long))


def test_gated_custom_ops_pass_opcheck():
    """Schema, fake tensors, autograd registration and AOT dispatch of ``lintime::gated_*``."""
    from lintime.ops.glu.triton import ops as glu_ops  # noqa: F401  (registers the ops)

    U, V, dy, _ = _gated_inputs((6, 32), seed=15)
    torch.library.opcheck(torch.ops.lintime.gated_fwd, (U.clone().requires_grad_(), V.clone().requires_grad_(), 0))
    torch.library.opcheck(torch.ops.lintime.gated_bwd, (dy, U, V, 1))


@pytest.mark.cuda
def test_cuda_flash_base_gate_bf16():
    """The flash-base gate (32771 rows of 1536, ``u`` a view of a wider projection) in bf16 against the PyTorch
    form: within two bf16 roundings (the kernel rounds once, the composite after each step)."""
    U, V, dy, w = _gated_inputs((32771, 1536), seed=16, wide=128, dtype=torch.bfloat16)
    ref = _run_gated(U, V, dy, w, "silu", "chunk")
    out = _run_gated(U, V, dy, w, "silu", None)
    for name, a, b in zip(("y", "du", "dv"), ref, out):
        torch.testing.assert_close(b.float(), a.float(), rtol=2**-6, atol=2**-6 * a.float().abs().max().item(),
                                   msg=name)
