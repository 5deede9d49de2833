"""gated_normalize (the norm, then ``* silu(gate)``: GLA's head norm and output gate): naive (fp64 definition) <->
chunk (PyTorch composite) <-> Triton (interpreter on CPU, compiled on CUDA), the result and the gradients of x, the
gate, weight and bias, every kind, odd row counts, half inputs by the half rule, the autocast mix; and the GLA layer,
whose fused path must be the plain norm-then-gate function."""

import pytest
import torch
import torch.nn.functional as F

from lintime.modules import gated_normalize, normalize
from tolerances import HALF_FACTOR, HALF_FLOOR, assert_exact, assert_half_rule, rel_rms

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # the interpreter on the CPU, the compiled kernels on CUDA
KINDS = ("layernorm", "rmsnorm", "scalenorm")
NAMES = ("y", "dx", "dz", "dw", "db")


def _params(kind, D, *, weight=True, bias=True, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    if not weight:
        return None, None
    if kind == "scalenorm":
        return (1.0 + 0.3 * torch.randn((), generator=g)).to(device), None
    w = (1.0 + 0.3 * torch.randn(D, generator=g)).to(device)
    b = (0.2 * torch.randn(D, generator=g)).to(device) if kind == "layernorm" and bias else None
    return w, b


def _inputs(shape, seed=1, device=DEV):
    """The rows ``x`` (off-centre, as attention outputs), the gate's pre-activation ``z`` (both signs, past the
    silu's bend) and the result's gradient ``dy``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2 + 0.3
    z = torch.randn(shape, generator=g) * 2
    dy = torch.randn(shape, generator=g)
    return (t.to(device) for t in (x, z, dy))


def _run(x, z, w, b, dy, kind, backend, out_dtype=None):
    x, z = (t.detach().clone().requires_grad_() for t in (x, z))
    w, b = (None if t is None else t.detach().clone().requires_grad_() for t in (w, b))
    y = gated_normalize(x, z, w, b, kind=kind, eps=1e-5, out_dtype=out_dtype, backend=backend)
    y.backward(dy.to(y.dtype))
    return y, x.grad, z.grad, None if w is None else w.grad, None if b is None else b.grad


def _f64(*ts):
    return [None if t is None else t.double() for t in ts]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 64), (37, 60), (3, 5, 192)])
def test_fp32_forms_agree_with_fp64_definition(kind, shape):
    """fp32 chunk and Triton equal the fp64 definition to fp32 exactness: the result and every gradient."""
    x, z, dy = _inputs(shape)
    w, b = _params(kind, shape[-1])
    ref = _run(*_f64(x, z, w, b, dy), kind, "naive")
    for backend in ("chunk", "triton"):
        out = _run(x, z, w, b, dy, kind, backend)
        for name, want, got in zip(NAMES, ref, out):
            if want is not None:
                assert got.dtype == torch.float32, name
                assert_exact(f"{kind} {backend} {name}", want.float(), got)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_without_gain_or_bias(kind):
    x, z, dy = _inputs((13, 40), seed=2)
    ref = _run(*_f64(x, z, None, None, dy), kind, "naive")
    out = _run(x, z, None, None, dy, kind, "triton")
    for name, want, got in zip(NAMES[:3], ref, out):
        assert_exact(f"{kind} no gain {name}", want.float(), got)
    assert out[3] is None and out[4] is None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])
def test_half_inputs_by_the_half_rule(kind, dtype):
    """Half rows, gate and result (a model cast to half): Triton's error against the fp64 definition is bounded
    by the half rule of the naive form run on the same half inputs."""
    x, z, dy = _inputs((31, 96), seed=3)
    w, b = _params(kind, 96)
    ref = _run(*_f64(x, z, w, b, dy), kind, "naive")
    half = [t.to(dtype) for t in (x, z, dy)]
    base = _run(*half[:2], w, b, half[2], kind, "naive")
    out = _run(*half[:2], w, b, half[2], kind, "triton")
    for name, want, bb, got in zip(NAMES, ref, base, out):
        if want is None:
            continue
        if name in ("dw", "db"):  # parameter gradients: fp32, summed in fp32 from half inputs
            got, bb = got.to(dtype), bb.to(dtype)
        assert got.dtype == dtype, name
        assert_half_rule(f"{kind} {dtype} {name}", want, got, bb)


def _mix_check(kind, shape, half, seed):
    """The GLA layer's mix under autocast: fp32 rows, a half gate and result.  Triton against the composite on the
    same dtypes: ``dx``, ``dw``, ``db`` are fp32 (same operations, fp32 exactness); ``y`` and ``dz`` are fp32 values
    rounded once to half (within one half ulp of the largest value, two for the order of the operations)."""
    x, z, dy = _inputs(shape, seed=seed)
    z, dy = z.to(half), dy.to(half)
    w, b = _params(kind, shape[-1])
    ref = _run(x, z, w, b, dy, kind, "chunk", out_dtype=half)
    out = _run(x, z, w, b, dy, kind, "triton" if not CUDA else None, out_dtype=half)
    assert (out[0].dtype, out[1].dtype, out[2].dtype) == (half, torch.float32, half)
    ulp = 2**-10 if half == torch.float16 else 2**-7
    for name, want, got in zip(NAMES, ref, out):
        if want is None:
            continue
        if got.dtype == half:
            atol = 2 * ulp * want.float().abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=atol, msg=name)
        else:
            assert_exact(f"{kind} {name}", want, got)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_autocast_mix_fp32_rows_half_gate(kind):
    _mix_check(kind, (29, 96), torch.float16, seed=4)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("launch", [{}, {"rows_per_tile": 4}], ids=["default", "bm4"])
def test_tiles_wrap_with_a_row_tail(kind, launch, monkeypatch, norm_wrapping_rows):
    """Many tiles per program and a partial last tile at GLA's head width: the result and every gradient (``dw`` /
    ``db`` summed over tiles and programs) equal the fp64 definition to fp32 exactness."""
    from lintime.modules.norm.triton import launch as norm_launch

    monkeypatch.setattr(norm_launch, "LAUNCH", norm_launch.NormLaunch(**launch))
    D = 192
    BM, rows = norm_wrapping_rows(D)
    assert BM > 1  # several rows of D = 192 in a forward tile
    x, z, dy = _inputs((rows, D), seed=10)
    w, b = _params(kind, D)
    ref = _run(*_f64(x, z, w, b, dy), kind, "naive")
    out = _run(x, z, w, b, dy, kind, "triton")
    for name, want, got in zip(NAMES, ref, out):
        if want is not None:
            assert_exact(f"{kind} {launch} {name}", want.float(), got)


def test_equals_normalize_then_silu_gate_and_no_rows():
    """The op is the two-step composite of the public ops; zero rows give an empty result."""
    x, z, _ = _inputs((5, 7, 40), seed=5)
    w, b = _params("layernorm", 40)
    y = gated_normalize(x, z, w, b, kind="layernorm", backend="triton")
    assert_exact("composite", normalize(x, w, b, kind="layernorm", backend="chunk") * F.silu(z), y)
    assert gated_normalize(x[:0], z[:0], kind="rmsnorm", backend="triton").shape == (0, 7, 40)


def test_bad_arguments_raise():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="gate"):
        gated_normalize(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match="kind"):
        gated_normalize(x, x, kind="batchnorm")
    with pytest.raises(ValueError, match="bias"):
        gated_normalize(x, x, torch.ones(8), torch.zeros(8), kind="rmsnorm")


def test_custom_ops_pass_opcheck():
    """Schema, fake tensors, autograd registration and AOT dispatch of ``lintime::gated_normalize_*``."""
    from lintime.modules.norm.triton import ops as norm_ops  # noqa: F401  (registers the ops)

    x, z, dy = _inputs((6, 32), seed=6)
    z = z.half()
    w, b = (t.requires_grad_() for t in _params("layernorm", 32))
    args = (x.requires_grad_(), z.requires_grad_(), w, b, "layernorm", 1e-5, torch.float16)
    torch.library.opcheck(torch.ops.lintime.gated_normalize_fwd, args)
    _, mean, rstd = torch.ops.lintime.gated_normalize_fwd(*(a.detach() if isinstance(a, torch.Tensor) else a
                                                           for a in args))
    torch.library.opcheck(torch.ops.lintime.gated_normalize_bwd,
                          (dy.half(), x.detach(), z.detach(), w.detach(), b.detach(), mean, rstd, "layernorm"))


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_gla_base_sizes_bf16(kind):
    """gla-base's call (rows ``[B*T*H, V = 192]``, an odd token count) under the autocast mix (fp32 and bf16 rows)."""
    _mix_check(kind, (4097, 4, 192), torch.bfloat16, seed=7)
    x, z, dy = _inputs((4097, 4, 192), seed=8)
    x, z, dy = x.bfloat16(), z.bfloat16(), dy.bfloat16()
    w, b = _params(kind, 192)
    ref = _run(*_f64(x, z, w, b, dy), kind, "naive")
    base = _run(x, z, w, b, dy, kind, "chunk")
    out = _run(x, z, w, b, dy, kind, None)
    for name, want, bb, got in zip(NAMES, ref, base, out):
        if want is not None:
            if bb.dtype in HALF_FLOOR:
                assert_half_rule(f"{kind} bf16 {name}", want, got.to(bb.dtype), bb)
            else:  # an fp32 gradient (weight / bias) summed from bf16 rows: the rule with bf16's floor
                e_out, e_base = rel_rms(want, got), rel_rms(want, bb)
                assert e_out <= HALF_FACTOR * e_base + HALF_FLOOR[torch.bfloat16], (name, e_out, e_base)


@pytest.mark.cuda
def test_cuda_compiles_without_graph_breaks():
    x, z, dy = _inputs((257, 192), seed=9)
    w, b = (t.requires_grad_() for t in _params("layernorm", 192))
    x.requires_grad_()
    z = z.bfloat16().requires_grad_()

    def f(x, z, w, b):
        return (gated_normalize(x, z, w, b, out_dtype=torch.bfloat16).float() * dy).sum()

    ref = torch.autograd.grad(f(x, z, w, b), (x, z, w, b))
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(x, z, w, b), (x, z, w, b))
    for name, a, c in zip(("dx", "dz", "dw", "db"), ref, got):
        torch.testing.assert_close(c.float(), a.float(), rtol=0, atol=2**-7 * a.float().abs().max().item(), msg=name)


# --------------------------------------------------------------------------------------------- in the GLA layer


@pytest.mark.parametrize("head_norm", ["layernorm", "rmsnorm"])
def test_gla_layer_fused_gate_is_the_same_function(head_norm, monkeypatch):
    """The GLA layer with its head norm and output gate in one op (sent to the Triton kernels: the interpreter on
    the CPU) gives the plain norm-then-gate layer's output and every gradient, in fp32."""
    import lintime.modules.norm as norm_mod
    from lintime.layers.gla import GatedLinearAttention

    monkeypatch.setattr(norm_mod, "select", lambda op, backend, impls, x: impls[backend or "triton"])
    torch.manual_seed(0)
    layer = GatedLinearAttention(32, 2, head_norm=head_norm, chunk_size=8).to(DEV)
    with torch.no_grad():  # a gain and an offset that are not the identity
        layer.head_norm.weight.mul_(1.5).add_(0.1 * torch.randn_like(layer.head_norm.weight))
        if head_norm == "layernorm":
            layer.head_norm.bias.add_(0.2 * torch.randn_like(layer.head_norm.bias))
    x = torch.randn(2, 11, 32, device=DEV)
    positions = torch.arange(11, device=DEV).expand(2, 11)
    dy = torch.randn(2, 11, 32, device=DEV)

    def run():
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y, _ = layer(xx, positions=positions)
        y.backward(dy)
        return [y.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    assert layer.fused
    fused = run()
    layer.fused = False
    plain = run()
    names = ["y", "dx"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, plain, fused):
        assert_exact(f"{head_norm} {name}", a, b)


def test_set_fused_turns_the_gla_gate_off():
    from lintime.models import CausalLM, get_preset

    model = CausalLM(get_preset("gla-tiny", n_layers=1, d_model=32))
    layers = [m for m in model.modules() if type(m).__name__ == "GatedLinearAttention"]
    assert layers and all(m.fused for m in layers)
    model.set_fused(False)
    assert not any(m.fused for m in layers)
