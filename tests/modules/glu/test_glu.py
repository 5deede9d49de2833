"""glu_activation (a GLU block's ``act(u) * v``): naive (fp64 definition) <-> chunk (PyTorch composite) <-> Triton
(interpreter on CPU, compiled on CUDA), the output and the gradient of ``h``, silu and gelu, odd sizes, the
half-precision rule; the GLU layer's fused path against its PyTorch form.  gated_activation (two tensors), with and
without a bias: the same chain, every gradient (the bias's too), the custom ops, the argument checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from lintime.modules import gated_activation, glu_activation
from tolerances import assert_close, assert_exact, assert_half_rule

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# a row wider than several of the launch's column tiles, the last one partial: three of the GPU's 512-wide tiles,
# five of the interpreter's 16-wide ones (no more: each is a program under the interpreter)
WIDE = 1030 if CUDA else 70
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
@pytest.mark.parametrize("shape", [(1, 2), (37, 42), (3, 5, WIDE)])
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
    from lintime.modules.glu.triton import ops as glu_ops  # noqa: F401  (registers the ops)

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
            import lintime.modules.glu as glu_mod

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


def _run_gated(U, V, dy, wide, act, backend, dtype=None, bias=None):
    """``y, du, dv`` of ``gated_activation(U[..., wide:], V[..., :e])`` (the views themselves are passed), then
    ``dbias`` (in ``bias``'s dtype) when a ``bias`` is given."""
    dtype = dtype or U.dtype
    U, V = U.detach().to(dtype).requires_grad_(), V.detach().to(dtype).requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    e = U.shape[-1] - wide
    u, v = U[..., wide:], V[..., :e]
    assert wide == 0 or not (u.is_contiguous() or v.is_contiguous())
    y = gated_activation(u, v, activation=act, bias=b, backend=backend)
    y.backward(dy.to(y.dtype))
    return (y, U.grad[..., wide:], V.grad[..., :e]) + (() if b is None else (b.grad,))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape, wide", [((1, 1), 0), ((37, 42), 5), ((3, 5, WIDE), 0), ((2, 9, 70), 3)])
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
    from lintime.modules.glu.triton import ops as glu_ops  # noqa: F401  (registers the ops)

    U, V, dy, _ = _gated_inputs((6, 32), seed=15)
    torch.library.opcheck(torch.ops.lintime.gated_fwd,
                          (U.clone().requires_grad_(), V.clone().requires_grad_(), 0, None))
    torch.library.opcheck(torch.ops.lintime.gated_bwd, (dy, U, V, 1, None))
    torch.library.opcheck(torch.ops.lintime.gated_bwd, (dy, U, V, 1))  # bias defaults to None


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


# ------------------------------------------------------------------ gated_activation with a bias: act(u + b) * v
# (rows, width), strided: 77 and 100 rows are several of the interpreter's backward programs with a bias (2 row tiles
# of 16 each) with a partial last one, 45 and 37 columns end on a partial tile
BIAS_CASES = [((1, 1), 0), ((77, 45), 5), ((2, 50, 37), 3), ((3, 5, WIDE), 0)]


def _gate_bias(e, seed, device=DEV):
    return torch.randn(e, generator=torch.Generator().manual_seed(seed)).to(device)


@pytest.mark.skipif(CUDA, reason="the CUDA launch's 256-row programs: test_cuda_flash_base_gate_bias")
def test_gated_bias_cases_cross_the_interpreter_tiles():
    """The bias cases reach what the kernel's bias path handles apart under the launch they run with: several
    partial-sum rows (programs of ``bn rb`` rows) with a partial last one, several row tiles in a program, a partial
    column tile."""
    from lintime.modules.glu.triton.launch import default_launch

    cfg = default_launch(torch.device(DEV))
    rows = [math.prod(shape[:-1]) for shape, _ in BIAS_CASES]
    assert cfg.rb > 1
    assert any(n > 2 * cfg.bn * cfg.rb and n % (cfg.bn * cfg.rb) for n in rows)
    assert any(shape[-1] > cfg.be and shape[-1] % cfg.be for shape, _ in BIAS_CASES)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape, wide", BIAS_CASES)
def test_gated_bias_fp32_forms_agree_with_fp64_definition(act, shape, wide):
    """``act(u + b) * v``: fp32 naive, chunk and Triton equal the fp64 definition to fp32 exactness, the output and
    the gradients of ``u``, ``v`` and ``b``; contiguous inputs and row-strided views."""
    U, V, dy, w = _gated_inputs(shape, seed=21, wide=wide)
    b = _gate_bias(shape[-1], seed=22)
    ref = _run_gated(U, V, dy, w, act, "naive", torch.float64, bias=b.double())
    for backend in ("naive", "chunk", "triton"):
        out = _run_gated(U, V, dy, w, act, backend, bias=b)
        for name, want, got in zip(("y", "du", "dv", "dbias"), ref, out):
            assert got.dtype == torch.float32 and got.shape == want.shape, (backend, name)
            assert_exact(f"{backend} {act} {name}", want, got)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])
def test_gated_bias_half_inputs_with_an_fp32_bias(act, dtype):
    """Half ``u``, ``v`` and an fp32 bias (autocast: fp32 parameters, half activations).  The output, ``du`` and
    ``dv`` of naive and Triton by the half rule, the chunk form the base.  ``dbias`` is fp32, and naive and the
    kernel sum the unrounded fp32 ``du``: both equal the fp64 definition of the half inputs (the bias rounded to
    half) to fp32 exactness, which a sum of ``du`` rounded to half first misses by far.  The chunk form rounds ``du``
    and its sum to half (a biased projection under autocast did): within two half roundings of it."""
    U, V, dy, w = _gated_inputs((77, 45), seed=23, wide=4)
    b = _gate_bias(45, seed=24)
    ref = _run_gated(U, V, dy, w, act, "naive", torch.float64, bias=b.double())
    ref_rounded = _run_gated(U.to(dtype), V.to(dtype), dy.to(dtype), w, act, "naive", torch.float64,
                             bias=b.to(dtype).double())
    base = _run_gated(U, V, dy, w, act, "chunk", dtype, bias=b)
    for backend in ("naive", "triton"):
        out = _run_gated(U, V, dy, w, act, backend, dtype, bias=b)
        for name, r, bs, o in zip(("y", "du", "dv"), ref, base, out):
            assert o.dtype == dtype
            assert_half_rule(f"{backend} {act} {name}", r, o, bs)
        assert out[3].dtype == torch.float32
        assert_exact(f"{backend} {act} dbias", ref_rounded[3], out[3])
    rounded_sum = ref_rounded[1].to(dtype).double().sum(0)  # what summing du after its rounding gives
    with pytest.raises(AssertionError):
        assert_exact("dbias from half du", ref_rounded[3], rounded_sum)
    assert base[3].dtype == torch.float32
    assert_close(f"chunk {act} dbias", ref_rounded[3], base[3], torch.finfo(dtype).eps)


def test_gated_bias_keeps_its_own_dtype():
    """fp16 ``u``, fp32 ``v``, an fp64 bias (rounded to fp16 in the forward): the output fp32, ``du`` fp16, ``dv``
    fp32, ``dbias`` fp64 holding the fp32 sum; values those of the fp32 computation."""
    g = torch.Generator().manual_seed(28)
    u64, v64, dy64 = (torch.randn(41, 24, generator=g, dtype=torch.float64) for _ in range(3))
    b64 = torch.randn(24, generator=g, dtype=torch.float64)
    u64 = u64.half().double()
    runs = []
    for ut, vt, bias, backend in ((torch.float64, torch.float64, b64.half().double(), "naive"),
                                  (torch.float16, torch.float32, b64, "triton")):
        u = u64.to(DEV, ut).detach().clone().requires_grad_()
        v = v64.to(DEV, vt).detach().clone().requires_grad_()
        b = bias.to(DEV).detach().clone().requires_grad_()
        y = gated_activation(u, v, activation="gelu", bias=b, backend=backend)
        y.backward(dy64.to(DEV, y.dtype))
        runs.append((y, u.grad, v.grad, b.grad))
    ref, out = runs
    assert [t.dtype for t in out] == [torch.float32, torch.float16, torch.float32, torch.float64]
    for i, name in ((0, "y"), (2, "dv"), (3, "dbias")):
        assert_exact(name, ref[i], out[i].float())


@pytest.mark.parametrize("act", ACTS)
def test_gated_bias_gradient_is_the_row_sum_of_the_preactivation_gradient(act):
    """``dbias`` is the gradient of ``u + b`` summed over every row (all leading dims): the Triton ``dbias`` against
    its own ``du`` summed in fp64, and that ``du`` against autograd of PyTorch's own activation of ``u + b`` in fp64
    (none of the op's forms)."""
    U, V, dy, w = _gated_inputs((3, 29, 45), seed=26)
    b = _gate_bias(45, seed=27)
    _, du, _, db = _run_gated(U, V, dy, w, act, "triton", bias=b)
    assert_exact(f"{act} dbias = du summed", du.double().sum((0, 1)), db)
    pre = (U.double() + b.double()).requires_grad_()
    ({"silu": F.silu, "gelu": F.gelu}[act](pre) * V.double()).backward(dy.double())
    assert_exact(f"{act} du", pre.grad, du)
    assert_exact(f"{act} dbias", pre.grad.sum((0, 1)), db)


@pytest.mark.parametrize("backend", ["naive", "chunk", "triton"])
def test_gated_bias_none_zero_and_no_rows(backend):
    """``bias=None`` is the call without a bias, and a zero bias changes nothing: the output and the gradients of
    ``u``, ``v`` equal the unbiased call's (in the kernel bit for bit: the bias path, ``rb`` row tiles a program,
    computes each element as the plain one; PyTorch's forms may round ``act`` of the strided ``u`` and of the
    contiguous ``u + 0`` apart), its gradient the row sums of ``du``.  No rows: a zero bias gradient."""
    U, V, dy, w = _gated_inputs((77, 45), seed=25, wide=3)
    u, v = U[..., w:], V[..., :45]
    assert torch.equal(gated_activation(u, v, backend=backend), gated_activation(u, v, bias=None, backend=backend))
    plain = _run_gated(U, V, dy, w, "silu", backend)
    zero = _run_gated(U, V, dy, w, "silu", backend, bias=torch.zeros(45, device=DEV))
    for name, a, b in zip(("y", "du", "dv"), plain, zero):
        assert_exact(name, a.double(), b)
        if backend == "triton":
            assert torch.equal(a, b), name
    assert_exact("dbias", plain[1].double().sum(0), zero[3])
    y, du, dv, db = _run_gated(*_gated_inputs((0, 45), seed=29), "silu", backend, bias=_gate_bias(45, seed=29))
    assert y.shape == du.shape == dv.shape == (0, 45)
    assert torch.equal(db, torch.zeros(45, device=DEV))


def test_gated_bias_gradient_alone_or_frozen():
    """Only the bias needs a gradient: the one it gets with ``u`` and ``v`` needing theirs.  A frozen bias: none,
    and ``u``, ``v`` get theirs."""
    U, V, dy, _ = _gated_inputs((37, 20), seed=30)
    b = _gate_bias(20, seed=31)
    _, du, dv, db = _run_gated(U, V, dy, 0, "silu", "triton", bias=b)
    alone = b.clone().requires_grad_()
    gated_activation(U, V, bias=alone, backend="triton").backward(dy)
    assert torch.equal(alone.grad, db)
    u, v = U.clone().requires_grad_(), V.clone().requires_grad_()
    gated_activation(u, v, bias=b, backend="triton").backward(dy)
    assert b.grad is None and torch.equal(u.grad, du) and torch.equal(v.grad, dv)


def test_gated_bias_custom_ops_pass_opcheck():
    """``lintime::gated_fwd`` / ``gated_bwd`` with a bias: schema, fake tensors, autograd registration (the bias's
    gradient too) and AOT dispatch; fp32 and half ``u`` with an fp32 bias, several partial-sum rows."""
    from lintime.modules.glu.triton import ops as glu_ops  # noqa: F401  (registers the ops)

    U, V, dy, _ = _gated_inputs((37, 20), seed=32)
    b = _gate_bias(20, seed=33)
    for u in (U, U.half()):
        args = (u.clone().requires_grad_(), V.clone().requires_grad_(), 0, b.clone().requires_grad_())
        torch.library.opcheck(torch.ops.lintime.gated_fwd, args)
        torch.library.opcheck(torch.ops.lintime.gated_bwd, (dy.to(args[0].dtype), u, V, 1, b))


def test_gated_bias_bad_arguments_raise():
    u, v = torch.randn(3, 4), torch.randn(3, 4)
    for bad in (torch.randn(5), torch.randn(1, 4), torch.randn(())):
        with pytest.raises(ValueError, match="bias must have shape"):
            gated_activation(u, v, bias=bad)
    with pytest.raises(TypeError, match="bias must be a floating tensor"):
        gated_activation(u, v, bias=torch.ones(4, dtype=torch.long))
    with pytest.raises(TypeError, match="bias must be a floating tensor"):
        gated_activation(u, v, bias=[0.0] * 4)
    meta = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match="bias must be on u's device"):
        gated_activation(u, v, bias=meta)
    from lintime.modules.glu.triton import triton_gated  # the backend's own check, for callers past the public op

    with pytest.raises(ValueError, match="one device"):
        triton_gated(u.to(DEV), v.to(DEV), bias=meta)


@pytest.mark.cuda
def test_cuda_flash_base_gate_bias_bf16():
    """The flash-base gate with its bias (32771 rows of 1536: 129 partial-sum rows of the GPU launch's 256-row
    programs, the last partial) in bf16 with an fp32 bias: ``y``, ``du``, ``dv`` within two bf16 roundings of the PyTorch form,
    ``dbias`` the fp64 definition of the bf16 inputs to fp32 exactness."""
    U, V, dy, w = _gated_inputs((32771, 1536), seed=34, wide=128, dtype=torch.bfloat16)
    b = _gate_bias(1536, seed=35)
    ref = _run_gated(U, V, dy, w, "silu", "chunk", bias=b)
    out = _run_gated(U, V, dy, w, "silu", None, bias=b)
    for name, a, c in zip(("y", "du", "dv"), ref, out):
        torch.testing.assert_close(c.float(), a.float(), rtol=2**-6, atol=2**-6 * a.float().abs().max().item(),
                                   msg=name)
    exact = _run_gated(U, V, dy, w, "silu", "naive", torch.float64, bias=b.bfloat16().double())
    assert_exact("dbias", exact[3], out[3])
