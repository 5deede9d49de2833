"""gau_heads with ``split_heads=True`` (the heads as ``nh`` separate ``[B, T, 1, s]`` tensors, FLASH's call): bit for
bit the stacked path on the fused kernels (interpreter and CUDA), the naive and chunk forms' split tuple, the bias's
gradient with absent head gradients, ``torch.compile`` and ``opcheck`` of the split custom ops.  Shared cases and
helpers: gau_heads_cases.py."""

import pytest
import torch

from gau_heads_cases import case_id, cpu_only, cuda, heads_bias, heads_inputs, needs_cuda, run_heads
from lintime.modules import gau_heads
from tolerances import assert_exact

triton = pytest.importorskip("triton")


# (T, e, s, nh, gating, rope_heads, the heads with a gradient): 2 x 37 rows cross three backward heads
# programs (two 16-row blocks each) and two partial-sum column tiles; gating=False is FLASH's v + z call
SPLIT_CASES = [
    (37, 20, 12, 4, False, 1, (0, 1, 2, 3)),
    (37, 5, 12, 6, True, 1, (0, 2, 5)),  # first-to-all, three head gradients (and u's) absent
    (7, 5, 8, 2, False, 2, (1,)),
]


def _split_id(c):
    return f"{case_id(c[:6])}-d{''.join(map(str, c[6]))}"


def _split_inputs(case, dtype, seed=9, device="cpu", with_bias=False):
    """Inputs, the heads' gradients one per head (``None`` unless in ``present``) and their stacked form
    (zeros for the absent ones); ``u``'s gradient is absent in the gated case."""
    T, e, s, nh, gating, R, present = case
    h, g, b, pos, (du, dv, dheads) = heads_inputs(2, T, e, s, nh, gating, dtype, seed=seed, device=device)
    dqs = [dheads[:, :, n : n + 1].contiguous() if n in present else None for n in range(nh)]
    stacked = torch.cat([torch.zeros_like(dheads[:, :, :1]) if d is None else d for d in dqs], 2)
    kw = {"e": e, "s": s, "gating": gating, "rope_heads": R, "bias": heads_bias(h, seed) if with_bias else None}
    return h, g, b, pos, None, dv, dqs, stacked, kw


def _check_split_equals_stacked(case, dtype, device="cpu", with_bias=False):
    """``split_heads=True``: contiguous ``[B, T, 1, s]`` heads equal to the stacked heads' slices, and with the
    heads' gradients as separate tensors (some ``None``) the stacked path's ``dh, dgamma, dbeta`` (and ``dbias``)
    given their concatenation (zeros for the absent ones) -- bit for bit: the same kernels, only the heads'
    addresses differ."""
    h, g, b, pos, du, dv, dqs, stacked, kw = _split_inputs(case, dtype, device=device, with_bias=with_bias)
    ref = run_heads("triton", h, g, b, pos, (du, dv, stacked), **kw)
    out = run_heads("triton", h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    heads, nh = out.pop("heads"), g.shape[0]
    assert isinstance(heads, tuple) and len(heads) == nh
    for n, q in enumerate(heads):
        assert q.shape == (*h.shape[:2], 1, kw["s"]) and q.is_contiguous() and q.dtype == dtype
        assert torch.equal(q, ref["heads"][:, :, n : n + 1]), f"head {n}"
    assert sorted(out) == sorted(k for k in ref if k != "heads")
    for name in out:
        assert torch.equal(out[name], ref[name]), name


# every case with and without the bias in fp32, and once in fp16 (alternating the bias): the split path changes
# only the heads' addresses, in elements, the same for either dtype
_EQUAL_STACKED = [(c, torch.float32, b) for c in SPLIT_CASES for b in (False, True)] + [
    (c, torch.float16, i % 2 == 0) for i, c in enumerate(SPLIT_CASES)]


@cpu_only
@pytest.mark.parametrize("case, dtype, with_bias", _EQUAL_STACKED,
                         ids=[f"{'bias' if b else 'nobias'}-{_split_id(c)}-{str(d)[6:]}" for c, d, b in _EQUAL_STACKED])
def test_triton_split_heads_equal_stacked(case, dtype, with_bias):
    _check_split_equals_stacked(case, dtype, with_bias=with_bias)


@cpu_only
def test_triton_split_heads_bias_matches_naive():
    """FLASH's call (split heads, no gating, a bias, some head gradients absent) against the naive form: every
    output and gradient at the fp32 exact rule -- the bias's gradient from the kernels' partial column sums (two
    row groups of 32 rows, ``u`` / ``v`` and ``z`` columns) folded."""
    h, g, b, pos, du, dv, dqs, _, kw = _split_inputs(SPLIT_CASES[0], torch.float32, seed=14, with_bias=True)
    dqs[2] = None
    ref = run_heads("naive", h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    out = run_heads("triton", h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    for name in ref:
        if name == "heads":
            for n, (x, y) in enumerate(zip(ref[name], out[name])):
                assert_exact(f"head {n}", x, y)
        else:
            assert_exact(f"split bias {name}", ref[name], out[name])


@pytest.mark.parametrize("backend", ["naive", "chunk"])
def test_split_heads_other_backends(backend):
    """The naive and chunk forms give the same tuple (their stacked heads split, contiguous) and, with the heads'
    gradients split (some ``None``), the stacked path's gradients."""
    h, g, b, pos, du, dv, dqs, stacked, kw = _split_inputs(SPLIT_CASES[1], torch.float64)
    ref = run_heads(backend, h, g, b, pos, (du, dv, stacked), **kw)
    out = run_heads(backend, h, g, b, pos, (du, dv, dqs), split_heads=True, **kw)
    heads = out.pop("heads")
    assert len(heads) == g.shape[0] and all(q.is_contiguous() for q in heads)
    assert torch.equal(torch.cat(heads, 2), ref["heads"])
    for name in out:
        assert_exact(f"{backend} split {name}", ref[name], out[name])


@cpu_only
def test_torch_compile_split_heads_fullgraph():
    """``torch.compile(fullgraph=True)`` (aot_eager) traces ``lintime::gau_heads_split_fwd`` / ``_split_bwd``
    without a graph break and gives the eager results bit for bit, some heads without a gradient."""
    h, g, b, pos, du, dv, dqs, _, kw = _split_inputs(SPLIT_CASES[0], torch.float32, seed=10)
    dqs[1] = None

    def f(h, g, b):
        _, v, heads = gau_heads(h, g, b, pos, split_heads=True, backend="triton", **kw)
        return v, *heads

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    res = []
    for fn in (compiled, f):
        leaves = [x.clone().requires_grad_() for x in (h, g, b)]
        outs = fn(*leaves)
        used, dout = zip(*[(o, d) for o, d in zip(outs, (dv, *dqs)) if d is not None])
        res.append([*outs, *torch.autograd.grad(used, leaves, dout)])
    for i, (got, want) in enumerate(zip(*res)):
        assert torch.equal(got, want), i


@cpu_only
def test_opcheck_split_heads():
    """``torch.library.opcheck`` of the split forward (with its autograd rule) and of the split backward with
    absent head gradients."""
    from lintime.modules.heads.triton.heads import gau_heads_split_bwd, gau_heads_split_fwd

    e, s, nh = 5, 8, 3
    h, g, b, pos, (_, dv, dheads) = heads_inputs(1, 10, e, s, nh, False, torch.float32, seed=7)
    bias = heads_bias(h)
    for bb in (None, bias.clone().requires_grad_()):
        args = tuple(x.requires_grad_() for x in (h, g, b)) + (pos, bb, e, s, False, 500.0, 2)
        torch.library.opcheck(gau_heads_split_fwd.op, args)
    dqs = [dheads[:, :, 0:1].contiguous(), None, dheads[:, :, 2:3].contiguous(), None, None, None]
    for bb, need_db in ((None, False), (bias, True), (bias, False)):
        torch.library.opcheck(gau_heads_split_bwd.op, (None, dv, *dqs, h.detach(), g.detach(), pos, bb, e, s, False,
                                                       500.0, 2, True, need_db))


@cuda
@needs_cuda
@pytest.mark.parametrize("case", [(4096, 1536, 128, 4, False, 1, (0, 1, 2, 3)),
                                  (1037, 300, 96, 6, True, 2, (0, 1, 3, 5))], ids=_split_id)
def test_cuda_split_heads_equal_stacked(case):
    """``split_heads`` on the compiled kernels, bf16: FLASH's ``v, z`` call at its real size (e = 1536, s = 128,
    nh = 4, with its bias), and an odd gated first-to-all shape with absent head gradients -- bit for bit the
    stacked path."""
    _check_split_equals_stacked(case, torch.bfloat16, device="cuda", with_bias=not case[4])
