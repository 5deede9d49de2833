"""The Triton per-block sums (lintime/ops/vq/triton/sums.py) against the one-hot sums of the seed's Code 2
(:func:`lintime.ops.vq.state.block_sums`, fp64) and PyTorch's scatter-adds: counts, sums and the values' gradient,
with empty slots, several heads and partial tiles; fp32 by the exact rule, fp16 values summed in fp32 (exact rule
against the fp64 sums of the same fp16 values), through the interpreter on the CPU; opcheck."""

import pytest
import torch

from lintime.ops.vq.state import block_sums, scatter_sums
from lintime.testing import assert_exact

pytest.importorskip("triton")
from lintime.ops.vq.triton.sums import triton_scatter_sums, vq_sums_op  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(dtype, seed=0, G=3, L=7, H=2, V=37, S=5):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, S, (G, L, H), generator=g)
    valid = torch.rand(G, L, generator=g) > 0.3
    v = torch.randn(G, L, H, V, generator=g, dtype=torch.float64) * valid[..., None, None]
    return codes.to(DEV), v.to(dtype).to(DEV), valid.to(DEV), S


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sums_and_gradient_equal_the_one_hot_sums(dtype):
    codes, v, valid, S = _case(dtype)
    leaf = v.detach().clone().requires_grad_()
    cnt, sumv = triton_scatter_sums(codes, leaf, valid, S)
    assert cnt.dtype == sumv.dtype == torch.float32
    c64, s64 = block_sums(codes, v.double(), valid, S)
    assert_exact("count", c64, cnt)
    assert_exact("sum", s64, sumv)
    c_sc, s_sc = scatter_sums(codes, v, valid, S)
    assert torch.equal(c_sc, cnt)
    assert_exact("sum vs scatter_sums", s_sc.double(), sumv)
    w = torch.randn(sumv.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEV)
    (d,) = torch.autograd.grad((sumv.double() * w).sum(), leaf)
    assert d.dtype == dtype
    # d v[slot] = w[its block, head, code] for a filled slot, 0 for an empty one
    G, L, H = codes.shape
    want = torch.zeros_like(v, dtype=torch.float64)
    for b in range(G):
        for t in range(L):
            if valid[b, t]:
                for h in range(H):
                    want[b, t, h] = w[b, h, codes[b, t, h]]
    assert_exact("d v", want.to(dtype).double(), d.double())


def test_empty_slots_add_nothing():
    """Values in empty slots are ignored (PyTorch's scatter-adds assume zeros there)."""
    codes, v, valid, S = _case(torch.float32, seed=2)
    noisy = v + 5.0 * (~valid)[..., None, None]
    cnt, sumv = triton_scatter_sums(codes, noisy, valid, S)
    c64, s64 = block_sums(codes, v.double(), valid, S)
    assert_exact("count", c64, cnt)
    assert_exact("sum", s64, sumv)


def test_opcheck():
    codes, v, valid, S = _case(torch.float32, seed=3, G=2, L=4, H=1, V=20)
    G = codes.shape[0] * codes.shape[2] * S
    rows = ((torch.arange(2, device=DEV).view(2, 1, 1)) * S + codes).reshape(-1)
    ok = valid[..., None].expand(codes.shape).reshape(-1).to(torch.int8)
    torch.library.opcheck(torch.ops.lintime.vq_sums.default,
                          (rows, v.reshape(-1, 20).requires_grad_(), ok, G),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_code_sums_forms_agree(dtype):
    """The layer's EMA statistics: the scatter-add kernel (bf16 keys read as they are) == index_add in fp32 of the
    same values, and == the one-hot definition (fp64)."""
    from lintime.ops.vq.sums import code_sums

    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 9, (53,), generator=g).to(DEV)
    x = torch.randn(53, 21, generator=g).to(dtype).to(DEV)
    n_t, s_t = code_sums(rows, x, 9, backend="triton")
    n_c, s_c = code_sums(rows, x, 9, backend="chunk")
    onehot = torch.nn.functional.one_hot(rows, 9).double()  # [M, 9]
    assert n_t.dtype == s_t.dtype == torch.float32
    assert torch.equal(n_t, n_c) and torch.equal(n_t.double(), onehot.sum(0))
    assert_exact("sums vs index_add", s_c, s_t)
    assert_exact("sums vs one-hot", onehot.T @ x.double(), s_t)
