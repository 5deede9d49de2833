"""lintime.ops.utils.launching.launcher_op on a toy launcher (PyTorch only): eager calls run the launcher
(with autograd: an autograd.Function, None for unused outputs' gradients), traced calls the custom op,
and a backward rule calls the backward launcher eagerly and the backward op when traced."""

import torch
from torch import Tensor

from lintime.ops.utils.launching import launcher_op

CALLS: list[str] = []


def _bwd_fake(x, dy):
    return torch.empty_like(x)


@launcher_op("test_toy_bwd", fake=_bwd_fake)
def toy_bwd(x: Tensor, dy: Tensor) -> Tensor:
    CALLS.append("bwd")
    return 2 * dy


def _setup(ctx, inputs, output):
    (x,) = inputs
    ctx.save_for_backward(x)


def _backward(ctx, dy, dsum):
    (x,) = ctx.saved_tensors
    dy = torch.zeros_like(x) if dy is None else dy
    dx = toy_bwd.for_ctx(ctx)(x, dy.contiguous())
    if dsum is not None:
        dx = dx + dsum
    return dx


def _fwd_fake(x):
    return torch.empty_like(x), x.new_empty(())


@launcher_op("test_toy_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup, outputs=1)
def toy_fwd(x: Tensor) -> tuple[Tensor, Tensor]:
    """``2 x`` (returned) and ``x.sum()`` (a saved-for-backward result the caller does not get)."""
    CALLS.append("fwd")
    return 2 * x, x.sum()


def test_eager_calls_skip_the_op():
    x = torch.randn(5, requires_grad=True)
    CALLS.clear()
    (y,) = toy_fwd(x)
    assert type(y.grad_fn).__name__.startswith("Eager_test_toy_fwd")  # the Function, not the op's autograd
    y.sum().backward()
    assert CALLS == ["fwd", "bwd"]
    assert torch.equal(x.grad, torch.full((5,), 2.0))
    with torch.no_grad():
        (y,) = toy_fwd(x)
    assert y.grad_fn is None and torch.equal(y, 2 * x)


def test_traced_calls_use_the_ops():
    torch.library.opcheck(toy_fwd.op, (torch.randn(4, requires_grad=True),))

    def f(x):
        return toy_fwd(x)[0].sum()

    x = torch.randn(6, requires_grad=True)
    (g,) = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(x), (x,))
    assert torch.equal(g, torch.full((6,), 2.0))
