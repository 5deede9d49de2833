"""Triton launchers as ``torch.library`` custom ops that eager calls do not pay for.

A launcher registered as ``lintime::<name>`` gets a fake (shape) implementation and, for a forward,
an autograd rule, so ``torch.compile`` traces one opaque node per call.  Eager calls skip the op
dispatch: its Python layers cost more host time than the launchers themselves
(``docs/design/kernels.md``, shared pieces).  :func:`launcher_op`
does both::

    @launcher_op("gla_bwd", fake=_bwd_fake)
    def gla_bwd_op(q: Tensor, ...) -> tuple[Tensor, ...]: ...

    def _backward(ctx, do, dht, *_):
        dq, ... = gla_bwd_op.for_ctx(ctx)(q, ...)    # the launcher in eager calls, the op when traced

    @launcher_op("gla_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup, outputs=2)
    def gla_fwd_op(q: Tensor, ...) -> tuple[Tensor, ...]: ...

    o, ht = gla_fwd_op(q, k, v, ...)                 # compiled, eager with autograd, or eager without
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def custom_op(name: str, fake: Callable, *, backward: Callable | None = None,
              setup_context: Callable | None = None) -> Callable:
    """Decorator: register ``fn`` as the ``torch.library.custom_op`` ``lintime::<name>`` with its
    fake (shape) implementation and, when given, its autograd rule; returns the op (every call goes
    through the dispatcher -- :func:`launcher_op` for ops whose eager calls should not).  The op
    never mutates its inputs."""

    def wrap(fn: Callable):
        op = torch.library.custom_op(f"lintime::{name}", fn, mutates_args=())
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        return op

    return wrap


class LauncherOp:
    """A launcher ``fn`` and its custom op ``lintime::<name>`` (see :func:`launcher_op`).

    ``op(*args)`` runs, by context:

    * while ``torch.compile`` traces (``torch.compiler.is_compiling()``): the custom op;
    * eagerly with autograd (grad mode on, a tensor argument that requires grad, ``backward``
      given): an ``autograd.Function`` with the op's ``setup_context`` and ``backward``, which
      receives ``None`` for the gradients of unused outputs (no zero tensors are made);
    * eagerly otherwise: ``fn`` itself.

    With ``outputs = n`` every path returns only the first ``n`` results of ``fn`` (the others are
    saved for the backward).  Positional arguments only, in the op's schema order.
    """

    def __init__(self, name: str, fn: Callable, *, fake: Callable, backward: Callable | None = None,
                 setup_context: Callable | None = None, outputs: int | None = None):
        self.name, self.fn, self.outputs = name, fn, outputs
        self.op = custom_op(name, fake, backward=backward, setup_context=setup_context)(fn)
        self._function = None if backward is None else _eager_function(name, fn, backward, setup_context, outputs)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            out = self.op(*args)
        elif self._function is not None and torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        ):
            return self._function.apply(*args)
        else:
            out = self.fn(*args)
        return out if self.outputs is None else out[: self.outputs]

    def for_ctx(self, ctx) -> Callable:
        """What a backward rule calls: ``fn`` when ``ctx`` is an eager call's, else the op (traced
        by ``torch.compile`` and ``torch.library.opcheck``)."""
        return self.fn if getattr(ctx, "lintime_eager", False) else self.op


def launcher_op(name: str, *, fake: Callable, backward: Callable | None = None,
                setup_context: Callable | None = None, outputs: int | None = None) -> Callable:
    """Decorator: ``fn`` -> :class:`LauncherOp` (``fn`` needs the type annotations of a
    ``torch.library.custom_op``; ``backward`` / ``setup_context`` as for ``register_autograd``)."""
    return lambda fn: LauncherOp(name, fn, fake=fake, backward=backward, setup_context=setup_context,
                                 outputs=outputs)


def _eager_function(name: str, fn: Callable, backward: Callable, setup_context: Callable,
                    outputs: int | None):
    """The ``autograd.Function`` of a :class:`LauncherOp`'s eager calls."""

    def forward(ctx, *args):
        ctx.set_materialize_grads(False)
        ctx.lintime_eager = True
        out = fn(*args)
        setup_context(ctx, args, out)
        if outputs is None:
            ctx.unused = ()
            return out
        ctx.unused = (None,) * (len(out) - outputs)  # gradients of the results the caller does not get
        return out[:outputs]

    def eager_backward(ctx, *grads):
        return backward(ctx, *grads, *ctx.unused)

    return type(f"Eager_{name}", (torch.autograd.Function,), {
        "forward": staticmethod(forward), "backward": staticmethod(eager_backward),
    })


def grad_as(grad: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """An output's incoming gradient in that output's ``dtype``, the one the backward kernels are built for.  Eager
    autograd delivers it so already (a no-op there); a backward graph that ``torch.compile`` traced under autocast
    may not (pytorch/pytorch#179804), and a kernel's ``tl.dot`` of two dtypes does not compile."""
    return grad if grad is None or grad.dtype == dtype else grad.to(dtype)


def none_if_empty(x: torch.Tensor | None) -> torch.Tensor | None:
    """Custom ops cannot return ``None``: absent outputs travel as empty tensors."""
    return None if x is None or x.numel() == 0 else x


def empty_f32(x: torch.Tensor) -> torch.Tensor:
    """An empty fp32 tensor on ``x``'s device: an absent output or argument of a custom op."""
    return x.new_empty(0, dtype=torch.float32)
