"""normalize: naive (fp64 / fp32 definitions) <-> chunk (PyTorch composite) <-> Triton (interpreter on
CPU, compiled on CUDA), forward and the gradients of x, weight and bias, every kind, odd sizes, the
autocast output dtype; the layers reach it."""

import pytest
import torch

from lintime.modules import normalize
from tolerances import assert_exact, assert_half_rule

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
KINDS = ("layernorm", "rmsnorm", "scalenorm")


def _params(kind, D, dtype=torch.float32, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "scalenorm":
        w = (1.0 + 0.3 * torch.randn((), generator=g)).to(dtype)
        return w.to(device).requires_grad_(), None
    w = (1.0 + 0.3 * torch.randn(D, generator=g)).to(device, dtype).requires_grad_()
    b = (0.2 * torch.randn(D, generator=g)).to(device, dtype).requires_grad_() if kind == "layernorm" else None
    return w, b


def _run(x, w, b, dy, kind, backend, out_dtype=None):
    xs = x.detach().clone().requires_grad_()
    ws = w.detach().clone().requires_grad_()
    bs = None if b is None else b.detach().clone().requires_grad_()
    y = normalize(xs, ws, bs, kind=kind, eps=1e-5, out_dtype=out_dtype, backend=backend)
    y.backward(dy.to(y.dtype))
    return y, xs.grad, ws.grad, None if bs is None else bs.grad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 64), (37, 60), (3, 5, 200)])
def test_fp32_forms_agree_with_fp64_definition(kind, shape):
    """fp32 chunk and Triton equal the fp64 definition to fp32 exactness, forward and every gradient."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(DEV)
    dy = torch.randn(shape, generator=g).to(DEV)
    w, b = _params(kind, shape[-1])
    ref = _run(x.double(), w.double(), None if b is None else b.double(), dy.double(), kind, "naive")
    for backend in ("chunk", "triton"):
        out = _run(x, w, b, dy, kind, backend)
        for name, r, o in zip(("y", "dx", "dw", "db"), ref, out):
            if r is not None:
                assert o.dtype == torch.float32
                assert_exact(f"{kind} {backend} {name}", r.float(), o)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_by_the_half_rule(kind, dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(29, 96, generator=g).to(DEV)
    dy = torch.randn(29, 96, generator=g).to(DEV)
    w, b = _params(kind, 96)
    ref = _run(x.double(), w.double(), None if b is None else b.double(), dy.double(), kind, "naive")
    base = _run(x.to(dtype), w, b, dy.to(dtype), kind, "naive")
    out = _run(x.to(dtype), w, b, dy.to(dtype), kind, "triton")
    for name, r, bb, o in zip(("y", "dx", "dw", "db"), ref, base, out):
        if r is not None and name in ("y", "dx"):
            assert o.dtype == dtype
            assert_half_rule(f"{kind} {dtype} {name}", r, o, bb)
        elif r is not None:  # parameter gradients: fp32, summed in fp32 from half inputs
            assert_half_rule(f"{kind} {dtype} {name}", r, o.to(dtype), bb.to(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_out_dtype_is_the_rounded_fp32_result(kind):
    """An fp32 residual stream normalised straight to bf16 equals the fp32 result rounded (what the
    next autocast GEMM would have done), and the gradient arrives back in fp32."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(41, 128, generator=g).to(DEV)
    dy = torch.randn(41, 128, generator=g).to(DEV)
    w, b = _params(kind, 128)
    y32, dx32, dw32, db32 = _run(x, w, b, dy.bfloat16().float(), kind, "chunk")
    for backend in ("chunk", "triton"):
        y, dx, dw, db = _run(x, w, b, dy.bfloat16(), kind, backend, out_dtype=torch.bfloat16)
        assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
        torch.testing.assert_close(y.float(), y32.bfloat16().float(), rtol=0, atol=2 * 2**-8 * y32.abs().max().item())
        assert_exact(f"{kind} {backend} dx", dx32, dx)
        assert_exact(f"{kind} {backend} dw", dw32, dw)


LAUNCHES = {"default": {}, "bm4": {"rows_per_tile": 4},
            "one-row": {"rows_per_tile": 1, "elems_per_warp": 256, "programs_per_sm": 8}}


@pytest.mark.parametrize("launch", LAUNCHES.values(), ids=LAUNCHES.keys())
def test_tiles_wrap_with_a_row_tail(launch, monkeypatch, norm_wrapping_rows):
    """Many tiles per program and a partial last tile, layernorm with gain and bias: Triton equals the fp64
    definition to fp32 exactness, forward and every gradient (``dw`` / ``db`` summed over tiles and programs)."""
    from lintime.modules.norm.triton import launch as norm_launch

    monkeypatch.setattr(norm_launch, "LAUNCH", norm_launch.NormLaunch(**launch))
    D = 60
    BM, N = norm_wrapping_rows(D)
    assert BM > 1 or launch.get("rows_per_tile") == 1  # the default puts several rows of D = 60 in a tile
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(N, D, generator=g) * 3 + 0.5).to(DEV)
    dy = torch.randn(N, D, generator=g).to(DEV)
    w, b = _params("layernorm", D)
    ref = _run(x.double(), w.double(), b.double(), dy.double(), "layernorm", "naive")
    out = _run(x, w, b, dy, "layernorm", "triton")
    for name, r, o in zip(("y", "dx", "dw", "db"), ref, out):
        assert_exact(f"BM {BM} N {N} {name}", r.float(), o)


def test_launch_rejects_tiles_that_are_not_powers_of_two():
    from lintime.modules.norm.triton.launch import NormLaunch

    with pytest.raises(ValueError, match="rows_per_tile"):
        NormLaunch(rows_per_tile=3)
    with pytest.raises(ValueError, match="tile_elems"):
        NormLaunch(tile_elems=3000)


def test_no_weight_and_empty_rows():
    x = torch.randn(0, 32, device=DEV)
    assert normalize(x, kind="rmsnorm", backend="triton").shape == (0, 32)
    x = torch.randn(7, 32, device=DEV, requires_grad=True)
    y = normalize(x, kind="layernorm", backend="triton")
    ref = normalize(x.double(), kind="layernorm", backend="naive")
    assert_exact("no weight", ref.float(), y)


def test_bad_arguments_raise():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="kind"):
        normalize(x, kind="batchnorm")
    with pytest.raises(ValueError, match="weight"):
        normalize(x, torch.ones(7), kind="rmsnorm")
    with pytest.raises(ValueError, match="bias"):
        normalize(x, torch.ones(8), torch.zeros(8), kind="rmsnorm")
    with pytest.raises(ValueError, match="scalenorm weight"):
        normalize(x, torch.ones(8), kind="scalenorm")


@pytest.mark.parametrize("kind", KINDS)
def test_layers_use_the_op_and_keep_their_results(kind):
    """The norm layers call normalize (the backend they pick is the dispatch's) and give the composite's
    result and gradients."""
    from lintime.layers.norms import build_norm

    torch.manual_seed(4)
    layer = build_norm(kind, 48).to(DEV)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 9, 48, device=DEV, requires_grad=True)
    y = layer(x)
    params = list(layer.parameters())
    ref = normalize(x.double(), *(p.double() for p in params), kind=kind, backend="naive")
    assert y.dtype == x.dtype
    assert_exact(f"{kind} layer", ref.float(), y)
    g = torch.autograd.grad(y.sum(), [x, *params])
    g_ref = torch.autograd.grad(ref.sum(), [x, *params])
    for a, r in zip(g, g_ref):
        assert_exact(f"{kind} layer grad", r.float(), a)


@pytest.mark.cuda
def test_cuda_autocast_layer_emits_bf16():
    from lintime.layers.norms import build_norm

    layer = build_norm("layernorm", 768).cuda()
    x = torch.randn(4096, 768, device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    ref = normalize(x, layer.weight, layer.bias, kind="layernorm", backend="chunk")
    torch.testing.assert_close(y.float(), ref.bfloat16().float(), rtol=0, atol=2**-7 * ref.abs().max().item())
