"""linear_cross_entropy: chain of trust naive (the plain ``F.cross_entropy`` on full logits) ->
chunk (the chunk loop in PyTorch) -> triton (the chunk loop with the fused per-row kernel), for
the loss and the gradients of x, weight and bias; ignored rows, odd N and V, chunks that do not
divide N, every reduction, label smoothing, half precision by the dtype rule of tests/tolerances.py.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); it uses no ``tl.dot``
(the GEMMs are PyTorch's), so bf16 is tested there too.  The tests marked ``cuda`` repeat the
checks at real sizes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py, so this file runs alone

import lintime.modules as modules
import lintime.modules.cross_entropy as ce_mod
from lintime.modules.cross_entropy import linear_cross_entropy
from lintime.modules.cross_entropy.chunk import default_chunk_size, torch_rows
from tolerances import HALF_FACTOR, HALF_FLOOR, assert_exact, rel_rms

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
try:
    import triton  # noqa: F401

    TRITON = ["triton"]
except ImportError:
    TRITON = []
FUSED = ["chunk", *TRITON]


def _inputs(N, d, V, *, bias=True, dtype=torch.float32, device=DEV, seed=0, n_ignored=3, lead=()):
    """x [*lead, N, d], weight [V, d], bias [V] scaled so the logits have O(1) spread, targets with
    ``n_ignored`` rows set to -100 (fp64 masters; returned in ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, N, d, generator=g, dtype=torch.float64)
    w = torch.randn(V, d, generator=g, dtype=torch.float64) * d**-0.5 * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    y = torch.randint(0, V, (*lead, N), generator=g)
    flat = y.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[:n_ignored]] = -100
    cast = [t.to(device, dtype) if t is not None else None for t in (x, w, b)]
    return (*cast, y.to(device))


def _run(backend, x, w, b, y, *, reduction="mean", grad_out=None, **kw):
    """Loss and the gradients of (x, w, b) for ``backend``; ``reduction='none'`` is weighted by
    ``grad_out`` so every row's incoming gradient differs."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    loss = linear_cross_entropy(leaves[0], leaves[1], y, bias=leaves[2], reduction=reduction, backend=backend, **kw)
    (loss * grad_out.to(loss.device)).sum().backward() if reduction == "none" else loss.backward()
    return [loss.detach()] + [t.grad for t in leaves if t is not None]


NAMES = ["loss", "dx", "dweight", "dbias"]


def assert_half_rule(name, ref64, out, base, dtype):
    """tests/tolerances.py's half-precision rule for a computation in ``dtype`` whose result may be
    fp32 (the loss, the weight gradient of a fp32 weight): ``err(out) <= 2 err(base) + floor``."""
    e_out, e_base = rel_rms(ref64, out), rel_rms(ref64, base)
    bound = HALF_FACTOR * e_base + HALF_FLOOR[dtype]
    assert e_out <= bound, f"{name}: error {e_out:.3e} exceeds 2 x plain {dtype} error {e_base:.3e} + floor = {bound:.3e}"


def _assert_exact_all(tag, ref, out):
    for name, r, o in zip(NAMES, ref, out):
        assert o.dtype == r.dtype, f"{tag} {name}: dtype {o.dtype} != {r.dtype}"
        assert_exact(f"{tag} {name}", r, o)


def _fp32_cases():
    """Every (backend, reduction, bias, label smoothing) of the chunk form; the Triton backend's every reduction with
    each label smoothing (what its row kernel sees: the scale and the smoothing), the bias alternating (it enters the
    logits' GEMM, before the row kernel)."""
    for backend in FUSED:
        for r, reduction in enumerate(["mean", "sum", "none"]):
            for bias in (True, False):
                for s, label_smoothing in enumerate((0.0, 0.1)):
                    if backend != "triton" or bias == ((r + s) % 2 == 0):
                        yield pytest.param(backend, reduction, bias, label_smoothing,
                                           id=f"{label_smoothing}-{bias}-{reduction}-{backend}")


@pytest.mark.parametrize("backend, reduction, bias, label_smoothing", list(_fp32_cases()))
def test_fp32_equals_the_plain_loss(backend, reduction, bias, label_smoothing):
    """V = 1000, N = 37 rows in chunks of 8 (the last one short), 3 ignored rows."""
    x, w, b, y = _inputs(37, 24, 1000, bias=bias)
    g = torch.randn(37, dtype=torch.float32)
    kw = dict(reduction=reduction, grad_out=g, label_smoothing=label_smoothing)
    ref = _run("naive", x, w, b, y, **kw)
    for C in (8, None):  # None: the default (one chunk here)
        _assert_exact_all(f"{backend} C={C}", ref, _run(backend, x, w, b, y, chunk_size=C, **kw))


@pytest.mark.parametrize("C", [1, 5, 36, 37, 64])
def test_triton_equals_chunk_at_every_chunk_size(C):
    if not TRITON:
        pytest.skip("needs triton")
    x, w, b, y = _inputs(37, 16, 257, n_ignored=5)
    _assert_exact_all(f"C={C}", _run("chunk", x, w, b, y, chunk_size=C), _run("triton", x, w, b, y, chunk_size=C))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("block_v", [128, 1024])
def test_kernel_row_step_over_several_blocks(dtype, label_smoothing, block_v):
    """The kernel's online softmax across column blocks (128 wide, V = 1000: 8 blocks, the last
    partial), and its one-block form (1024 >= V: the row read once, kept in registers for the
    gradient), against the PyTorch row step, loss and in-place gradient, per-row and scalar scales."""
    if not TRITON:
        pytest.skip("needs triton")
    from lintime.modules.cross_entropy.triton.launch import CrossEntropyLaunch
    from lintime.modules.cross_entropy.triton.ops import triton_rows

    n, V = 7, 1000  # the blocks are the point, not the rows (each row is a program the interpreter runs)
    z = (torch.randn(n, V, dtype=torch.float64) * 3).to(DEV, dtype)
    y = torch.randint(0, V, (n,), device=DEV)
    y[[2, 5]] = -7
    for scale in (torch.tensor(0.25, device=DEV), torch.rand(n, device=DEV)):
        z_ref, z_out = z.clone(), z.clone()
        l_ref, l_out = torch.empty(n, device=DEV), torch.empty(n, device=DEV)
        torch_rows(z_ref, y, scale, l_ref, -7, label_smoothing, True)
        triton_rows(z_out, y, scale, l_out, -7, label_smoothing, True,
                    CrossEntropyLaunch(block_v=block_v, num_warps=4))
        assert_exact("loss", l_ref, l_out)
        assert (z_out[[2, 5]] == 0).all() and (l_out[[2, 5]] == 0).all()
        if dtype == torch.float32:
            assert_exact("grad", z_ref, z_out)
        else:  # both round the same fp32 gradient to the half dtype: at most one ulp apart
            assert ((z_ref.float() - z_out.float()).abs() <= z_ref.float().abs() * 2.0**-7 + 1e-30).all()


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_precision_by_the_dtype_rule(backend, dtype, reduction):
    """Against the fp64 plain loss: error <= 2 x the plain loss run in the same dtype + floor."""
    x, w, b, y = _inputs(45, 32, 777, dtype=dtype, seed=3)
    g = torch.randn(45, dtype=torch.float64)
    ref = _run("naive", *(t.double() for t in (x, w, b)), y, reduction=reduction, grad_out=g)
    base = _run("naive", x, w, b, y, reduction=reduction, grad_out=g.float())
    out = _run(backend, x, w, b, y, reduction=reduction, grad_out=g.float(), chunk_size=16)
    for name, r, bs, o in zip(NAMES, ref, base, out):
        assert o.dtype == bs.dtype, name
        assert_half_rule(f"{backend} {dtype} {name}", r, o, bs, dtype)


def test_fp64_and_mixed_weight_dtype():
    """fp64 runs the chunk loop in fp64 (also automatically); a fp32 weight with bf16 rows computes in
    bf16 and returns the weight's gradient in fp32."""
    x, w, b, y = _inputs(21, 8, 300, dtype=torch.float64)
    _assert_exact_all("fp64", _run("naive", x, w, b, y), _run(None, x, w, b, y, chunk_size=4))
    xb, w32, b32 = x.bfloat16(), w.float(), b.float()
    for backend in FUSED:
        out = _run(backend, xb, w32, b32, y, chunk_size=4)
        assert [t.dtype for t in out] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]
        base = _run("naive", xb, w32.bfloat16(), b32.bfloat16(), y)
        ref = _run("naive", xb.double(), w, b, y)
        for name, r, bs, o in zip(NAMES, ref, base, out):
            assert_half_rule(f"{backend} mixed {name}", r, o, bs, torch.bfloat16)


@pytest.mark.parametrize("backend", FUSED)
def test_leading_dims_int32_targets_and_frozen_weight(backend):
    x, w, b, y = _inputs(7, 12, 101, lead=(3,))  # x [3, 7, 12], y [3, 7]
    ref = linear_cross_entropy(x, w, y, bias=b, reduction="none", backend="naive")
    out = linear_cross_entropy(x, w, y.int(), bias=b, reduction="none", backend=backend, chunk_size=4)
    assert out.shape == (3, 7)
    assert_exact("none", ref, out)
    xr = x.clone().requires_grad_()
    linear_cross_entropy(xr, w, y, bias=b, backend="naive").backward()
    xo = x.clone().requires_grad_()
    linear_cross_entropy(xo, w, y, bias=b, backend=backend, chunk_size=4).backward()
    assert_exact("dx (weight frozen)", xr.grad, xo.grad)


@pytest.mark.parametrize("backend", FUSED)
def test_no_grad_and_all_rows_ignored(backend):
    x, w, b, y = _inputs(9, 8, 50, n_ignored=0)
    with torch.no_grad():
        out = linear_cross_entropy(x.requires_grad_(), w, y, bias=b, backend=backend, chunk_size=4)
    assert not out.requires_grad
    assert_exact("no_grad loss", linear_cross_entropy(x.detach(), w, y, bias=b, backend="naive"), out)
    y_ign = torch.full_like(y, -100)
    loss, dx, dw, db = _run(backend, x.detach(), w, b, y_ign, reduction="sum", chunk_size=4)
    assert loss.item() == 0 and not dx.any() and not dw.any() and not db.any()
    ref = linear_cross_entropy(x.detach(), w, y_ign, backend="naive")
    got = linear_cross_entropy(x.detach(), w, y_ign, backend=backend)
    assert torch.isnan(ref) and torch.isnan(got)  # mean over no rows, as PyTorch


def test_compiles_without_graph_breaks():
    """The custom ops trace under ``torch.compile(fullgraph=True)`` (aot_eager: no C++ toolchain)."""
    x, w, b, y = _inputs(13, 8, 70)
    for backend in FUSED:
        fn = torch.compile(lambda x, w, b, y: linear_cross_entropy(x, w, y, bias=b, backend=backend, chunk_size=4),
                           backend="aot_eager", fullgraph=True)
        xr = x.clone().requires_grad_()
        loss = fn(xr, w, b, y)
        loss.backward()
        ref = _run("naive", x, w, b, y)
        assert_exact(f"{backend} compiled loss", ref[0], loss.detach())
        assert_exact(f"{backend} compiled dx", ref[1], xr.grad)


@pytest.mark.parametrize("backend", FUSED)
def test_none_backward_with_a_broadcast_gradient(backend):
    """``loss.sum().backward()`` hands the per-row backward a stride-0 (expanded) gradient."""
    x, w, b, y = _inputs(11, 8, 90)
    ref = _run("naive", x, w, b, y, reduction="mean")  # mean's gradient x n_valid = sum's
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    linear_cross_entropy(leaves[0], leaves[1], y, bias=leaves[2], reduction="none", backend=backend,
                         chunk_size=4).sum().backward()
    n_valid = (y != -100).sum()
    for name, r, t in zip(NAMES[1:], ref[1:], leaves):
        assert_exact(name, r * n_valid, t.grad)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_custom_ops_pass_opcheck(backend, reduction):
    """Schema, fake tensors, autograd registration and AOT dispatch of ``lintime::linear_cross_entropy_*``."""
    x, w, b, y = (t.requires_grad_() if t.is_floating_point() else t for t in _inputs(9, 8, 20))
    fwd = getattr(torch.ops.lintime, f"linear_cross_entropy_{backend}_fwd")
    torch.library.opcheck(fwd, (x, w, b, y, -100, reduction, 0.1, 4, reduction != "none"))
    bwd = getattr(torch.ops.lintime, f"linear_cross_entropy_{backend}_bwd")
    torch.library.opcheck(bwd, (x.detach(), w.detach(), None, y, torch.randn(9, device=x.device), -100, 0.0, 4))


def test_dispatch(impl_calls):
    x, w, b, y = _inputs(5, 4, 10, device="cpu")
    calls = impl_calls(ce_mod, "chunk")
    linear_cross_entropy(x, w, y)
    linear_cross_entropy(x.double(), w, y)
    assert len(calls) == 2
    assert modules.linear_cross_entropy is linear_cross_entropy
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(x, w, y, backend="recurrent")


def test_default_chunk_size_bounds_the_logits_buffer():
    assert default_chunk_size(32000, torch.bfloat16) == 4096
    assert default_chunk_size(32000, torch.float32) == 2048
    assert default_chunk_size(10**9, torch.float32) == 1


@pytest.mark.parametrize("bad, err", [
    (dict(reduction="avg"), ValueError),
    (dict(label_smoothing=1.5), ValueError),
    (dict(chunk_size=0), ValueError),
    (dict(ignore_index=1.0), TypeError),
    (dict(target=torch.zeros(5)), TypeError),
    (dict(target=torch.zeros(4, dtype=torch.long)), ValueError),
    (dict(weight=torch.zeros(10, 3)), ValueError),
    (dict(bias=torch.zeros(9)), ValueError),
])
def test_argument_checks(bad, err):
    x, w, b, y = _inputs(5, 4, 10, device="cpu")
    args = dict(x=x, weight=w, target=y, bias=b) | bad
    with pytest.raises(err):
        linear_cross_entropy(args.pop("x"), args.pop("weight"), args.pop("target"), **args)


@cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_real_sizes(dtype):
    """N = 4103 rows (two default chunks of bf16 at V = 32000, the second short), d = 256."""
    x, w, b, y = _inputs(4103, 256, 32000, dtype=dtype, n_ignored=50)
    for backend in FUSED:
        out = _run(backend, x, w, b, y)
        if dtype == torch.float32:
            _assert_exact_all(f"cuda {backend}", _run("naive", x, w, b, y), out)
        else:
            ref = _run("naive", *(t.double() for t in (x, w, b)), y)
            base = _run("naive", x, w, b, y)
            for name, r, bs, o in zip(NAMES, ref, base, out):
                assert_half_rule(f"cuda {backend} {name}", r, o, bs, dtype)
