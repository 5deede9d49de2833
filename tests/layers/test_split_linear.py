"""split_linear: one dense layer as two products (the GAU / FLASH ``dense(x)``) equals ``F.linear`` split in two,
forward and every gradient (fp64 gradcheck), with and without bias, either part unused; under autocast the
products run in the autocast dtype and the gradients come back in the parameters' / input's dtypes."""

import pytest
import torch
import torch.nn.functional as F

from lintime.layers._split_linear import split_linear
from tolerances import assert_exact


@pytest.mark.parametrize("bias", [True, False])
def test_equals_f_linear_split_and_gradcheck(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    y1, y2 = split_linear(x, w, b, 4)
    ref = F.linear(x, w, b)
    assert y1.shape == (2, 5, 4) and y2.shape == (2, 5, 7) and y1.is_contiguous() and y2.is_contiguous()
    assert_exact("y", ref, torch.cat([y1, y2], -1))
    assert torch.autograd.gradcheck(lambda *a: split_linear(*a, 4), (x, w, b))


@pytest.mark.parametrize("bias", [True, False])
def test_three_parts_equal_f_linear_split_and_gradcheck(bias):
    """Sizes as a sequence (the Transformer-VQ layer's k, v, g): F.linear split in three, forward and every
    gradient (fp64 gradcheck), each part contiguous."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(12, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    ys = split_linear(x, w, b, (2, 6, 4))
    assert [y.shape[-1] for y in ys] == [2, 6, 4] and all(y.is_contiguous() for y in ys)
    assert_exact("y", F.linear(x, w, b), torch.cat(ys, -1))
    assert torch.autograd.gradcheck(lambda *a: split_linear(*a, (2, 6, 4)), (x, w, b))


@pytest.mark.parametrize("bias", [True, False])
def test_multi_linear_equals_each_f_linear_and_gradcheck(bias):
    """Two weights of one input (the Transformer-VQ layer's W_Q and [W_K; W_V; W_G]): each output equals its
    F.linear (split), forward and every gradient (fp64 gradcheck; dx sums every part)."""
    from lintime.layers._split_linear import multi_linear

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b2 = torch.randn(7, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    ys = multi_linear(x, [(w1, None, None), (w2, b2, (3, 4))])
    assert [y.shape[-1] for y in ys] == [4, 3, 4] and all(y.is_contiguous() for y in ys)
    assert_exact("y", torch.cat([F.linear(x, w1), F.linear(x, w2, b2)], -1), torch.cat(ys, -1))
    params = (x, w1, w2) if b2 is None else (x, w1, w2, b2)
    fn = (lambda x, w1, w2, b2=None: multi_linear(x, [(w1, None, None), (w2, b2, (3, 4))]))
    assert torch.autograd.gradcheck(fn, params)


def test_one_part_unused_and_frozen_weight():
    """Only the second part reaches the loss: its gradients are F.linear's; a frozen weight gets none."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 6, generator=g, requires_grad=True)
    lin = torch.nn.Linear(6, 9)
    _, y2 = split_linear(x, lin.weight, lin.bias, 3)
    y2.square().sum().backward()
    got = (x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone())
    x.grad = None
    lin.zero_grad()
    F.linear(x, lin.weight, lin.bias)[:, 3:].square().sum().backward()
    for name, a, b in zip(("dx", "dw", "db"), (x.grad, lin.weight.grad, lin.bias.grad), got):
        assert_exact(name, a.double(), b)
    lin.weight.requires_grad_(False)
    x.grad = None
    split_linear(x, lin.weight, lin.bias, 3)[0].sum().backward()
    assert lin.weight.grad is not None and x.grad is not None  # the earlier grad stays, x gets its own


def test_autocast_dtypes_and_values():
    """Under CPU bf16 autocast: bf16 parts equal to F.linear's under autocast; fp32 gradients for fp32 x and
    parameters, within two bf16 roundings of F.linear's (dx is two products added)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 32, generator=g, requires_grad=True)
    lin = torch.nn.Linear(32, 24)
    dy = torch.randn(16, 24, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = split_linear(x, lin.weight, lin.bias, 10)
        ref = lin(x)
    assert y1.dtype == y2.dtype == torch.bfloat16
    assert torch.equal(torch.cat([y1, y2], -1), ref)
    grads = []
    for y in (torch.cat([y1, y2], -1), ref):
        x.grad = None
        lin.zero_grad()
        y.float().mul(dy).sum().backward(retain_graph=True)
        grads.append((x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()))
    for name, a, b in zip(("dx", "dw", "db"), *grads):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item(), msg=name)


def test_bad_split_raises():
    with pytest.raises(ValueError, match="n must be"):
        split_linear(torch.randn(2, 3), torch.randn(4, 3), None, 4)
    for sizes in ((1, 2), (4,), (2, 0, 2), (3, 2)):
        with pytest.raises(ValueError, match="sizes must be"):
            split_linear(torch.randn(2, 3), torch.randn(4, 3), None, sizes)


@pytest.mark.parametrize("bias", [True, False])
def test_dense_equals_f_linear_and_gradcheck(bias):
    """dense (the bias gradient as a GEMV) is F.linear: values and every gradient (fp64 gradcheck); under CPU bf16
    autocast its output equals F.linear's bit for bit."""
    from lintime.layers._split_linear import dense

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    assert_exact("y", F.linear(x, w, b), dense(x, w, b))
    assert torch.autograd.gradcheck(dense, (x, w, b))
    lin = torch.nn.Linear(6, 5, bias=bias)
    xf = torch.randn(7, 6, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(dense(xf, lin.weight, lin.bias), lin(xf))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autocast_weight_grad_in_fp32():
    """CUDA bf16 autocast, fp32 parameters: the weight gradient of each part comes from the product's fp32 output
    (no rounding to bf16), so it matches the fp64 product of the same bf16 operands to fp32 accumulation accuracy --
    closer than F.linear's bf16-rounded one; dx and db agree with F.linear's within bf16's rule."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(4096, 256, generator=g, device="cuda", requires_grad=True)
    lin = torch.nn.Linear(256, 704).cuda()
    dy = torch.randn(4096, 704, generator=g, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ys = split_linear(x, lin.weight, lin.bias, (192, 512))
        ref = lin(x)
    grads = []
    for y in (torch.cat(ys, -1), ref):
        x.grad = None
        lin.zero_grad()
        y.float().mul(dy).sum().backward(retain_graph=True)
        grads.append((x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()))
    exact = dy.bfloat16().double().t() @ x.detach().bfloat16().double()  # the bf16 operands' product, fp64
    err = lambda a: ((a.double() - exact).abs().max() / exact.abs().max()).item()  # noqa: E731
    assert err(grads[0][1]) <= 1e-5 < err(grads[1][1])
    for name, a, b in zip(("dx", "db"), (grads[0][0], grads[0][2]), (grads[1][0], grads[1][2])):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item(), msg=name)


def test_without_gradients_compiles_in_one_graph_and_equals_the_products():
    """With nothing to differentiate (a validation forward: no_grad, or no input requiring one) the layers run their
    products without the autograd Function: compiled as one graph (fullgraph) for every count of weights and biases --
    a Function's forward inlined by torch.compile there lost its ``ctx`` for a weight with its bias -- and equal to
    F.linear's values, eager and compiled."""
    from lintime.layers._split_linear import dense, multi_linear

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 6, generator=g)
    w1, w2 = torch.randn(5, 6, generator=g, requires_grad=True), torch.randn(7, 6, generator=g, requires_grad=True)
    b1, b2 = torch.randn(5, generator=g, requires_grad=True), torch.randn(7, generator=g, requires_grad=True)
    cases = {
        "dense": (lambda x: dense(x, w1, None), lambda x: [F.linear(x, w1)]),
        "dense with bias": (lambda x: dense(x, w1, b1), lambda x: [F.linear(x, w1, b1)]),
        "split with bias": (lambda x: split_linear(x, w2, b2, 3), lambda x: F.linear(x, w2, b2).split([3, 4], -1)),
        "multi": (lambda x: multi_linear(x, [(w1, b1, None), (w2, b2, (3, 4))]),
                  lambda x: [F.linear(x, w1, b1), *F.linear(x, w2, b2).split([3, 4], -1)]),
    }
    for name, (fn, ref) in cases.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            want = ref(x)
            for form, out in (("eager", fn(x)), ("compiled", compiled(x))):
                out = [out] if isinstance(out, torch.Tensor) else out
                assert len(out) == len(want), (name, form)
                for i, (a, b) in enumerate(zip(want, out)):
                    assert_exact(f"{name} {form} output {i}", a, b)
    # with gradients the Function still runs (its backward: dx summed over the parts)
    assert "_Linear" in type(dense(x, w1, b1).grad_fn).__name__
