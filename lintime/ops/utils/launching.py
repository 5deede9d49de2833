"""What every Triton launch shares on the host, in one module (it imports without Triton).

* the device and the arithmetic: :func:`interpreting`, :func:`check_device`, :func:`supported`, :func:`cdiv`,
  :func:`next_pow2`, :func:`block`, :func:`dot_config` (the matmuls' dtype rule), :func:`sm_count`, :func:`flat`;
* a family's launch settings: :class:`LaunchConfig`, the base of every ``<Family>Launch`` dataclass, and how it
  crosses a custom op as an ``int[]``;
* host int tables to the device in one copy: :func:`to_device` (a call's sequence bounds:
  :func:`lintime.ops.utils.sequence_bounds`);
* registering a launcher as a custom op: :func:`launcher_op` -- the one way (``docs/design/kernels.md``, shared
  pieces) -- and the small helpers of custom ops' signatures (:func:`grad_as`, :func:`none_if_empty`,
  :func:`empty_f32`).

A launcher registered as ``lintime::<name>`` gets a fake (shape) implementation and, for a forward,
an autograd rule, so ``torch.compile`` traces one opaque node per call.  Eager calls skip the op
dispatch: its Python layers cost more host time than the launchers themselves.  :func:`launcher_op`
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

import dataclasses
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_HEAD_DIM = 256  # K and V supported by the kernels


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(op: str, x: torch.Tensor) -> None:
    """The Triton backend runs CUDA tensors, or CPU tensors under the interpreter (tests)."""
    if x.device.type == "cuda" or (x.device.type == "cpu" and interpreting()):
        return
    raise ValueError(
        f"{op}: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for Triton's CPU "
        f"interpreter), got a tensor on {x.device}"
    )


def supported(*dims: int, dtype: torch.dtype) -> bool:
    """Head sizes and dtypes the kernels handle (others fall back to the chunked PyTorch form)."""
    return dtype in (torch.float16, torch.bfloat16, torch.float32) and all(1 <= d <= MAX_HEAD_DIM for d in dims)


def cdiv(a: int, b: int) -> int:
    """Ceil division of host ints (launch arithmetic).  Plain Python: ``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions in Triton 3.9, slow to call from the host."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), in plain Python."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def block(d: int) -> int:
    """Tile width for a head dimension: a power of two >= 16 (``tl.dot``'s minimum)."""
    return max(16, next_pow2(d))


@functools.cache
def dot_config(dtype: torch.dtype):
    """``(SDT, PREC)`` for inputs of ``dtype``.

    Matmuls of two input tiles run in the input dtype with fp32 accumulation.  ``SDT`` is the dtype
    the fp32 state is cast to when it meets an input tile in a matmul: bf16 for bf16 inputs (the
    state keeps its range), fp32 for fp16 inputs (fp16's range is too small for a long sum) and
    fp32 inputs.  ``PREC`` is the precision of fp32 matmuls: ``"ieee"`` for fp32 inputs (fp32
    users get fp32 arithmetic), ``"tf32"`` for the state matmuls of fp16 inputs (10-bit mantissa
    like fp16, with fp32's range).
    """
    import triton.language as tl  # only Triton launches call this: the module imports without Triton

    if dtype == torch.bfloat16:
        return tl.bfloat16, "tf32"
    if dtype == torch.float16:
        return tl.float32, "tf32"
    return tl.float32, "ieee"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (4 under the interpreter, so small tests exercise both forms)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` -> contiguous ``[B * T, H, D]`` (a view when already contiguous)."""
    return x.contiguous().view(-1, *x.shape[2:])


@dataclass(frozen=True)
class LaunchConfig:
    """A family's block sizes and launch settings: int and bool fields, every one with a default.

    Custom ops (``torch.library``) take no dataclasses, so a config crosses ``lintime::<op>_fwd`` / ``_bwd`` as
    an ``int[]``: :meth:`to_ints` writes the fields in declaration order and :meth:`from_ints` reads them back
    in the same order -- the only two places that know the order (a field added anywhere stays consistent)."""

    def to_ints(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def from_ints(cls, xs) -> LaunchConfig:
        """The config of :meth:`to_ints`'s list (cached per list: part of a call's host time)."""
        return _from_ints(cls, tuple(int(x) for x in xs))

    @classmethod
    def of(cls, cfg) -> LaunchConfig:
        """``cfg`` as given (the eager paths pass the object) or from a custom op's int list."""
        return cfg if isinstance(cfg, cls) else cls.from_ints(cfg)


@functools.lru_cache(maxsize=64)
def _from_ints(cls, xs: tuple) -> LaunchConfig:
    return cls(*(type(f.default)(x) for f, x in zip(dataclasses.fields(cls), xs, strict=True)))


def to_device(device, *xs: torch.Tensor) -> list[torch.Tensor]:
    """Int tables to ``device`` as int32, in one host-to-device copy (pageable memory: pinning a
    fresh buffer per call costs more than the copy)."""
    sizes = [x.numel() for x in xs]
    flat = torch.cat([x.reshape(-1).to(torch.int32) for x in xs]) if xs else torch.zeros(0, dtype=torch.int32)
    return list(torch.split(flat.to(device), sizes))


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
