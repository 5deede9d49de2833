"""Chunked linear + cross-entropy: the loss *and its gradients* computed chunk of rows by chunk of
rows inside the forward, so the ``[N, V]`` logits never exist at once (Liger-Kernel's fused linear
cross-entropy).

Notation: ``x [N, d]`` the rows (tokens), ``W [V, d]`` the output projection, ``b [V]``, ``y [N]``
the targets, ``C`` rows per chunk, ``eps`` the label smoothing.  Per chunk ``c`` of rows::

    z    = x_c W^T + b                                   [C, V] in x's dtype (fp32 GEMM accumulation)
    lse  = logsumexp(z)                                  per row, fp32 (fp64 for fp64 inputs)
    l    = lse - (1 - eps) z_y - eps mean_j z_j          0 on ignored rows
    g    = s (softmax(z) - (1 - eps) onehot(y) - eps / V), written over z; s = the row's gradient scale
    dx_c = g W,   dW += g^T x_c,   db += sum_rows g      dW, db summed in fp32

With ``s = 1 / n_valid`` (mean) or ``1`` (sum) the op's backward only multiplies the stored
gradients by the loss's incoming gradient.  ``reduction='none'`` cannot work that way (every row's
loss has its own incoming gradient and ``dW`` mixes rows): its forward computes the losses only and
its backward runs the chunks again with ``s`` = the incoming per-row gradient.

The per-row step (``l`` and ``g`` from ``z``) is a parameter of :func:`chunked_forward`:
:func:`torch_rows` here, the Triton kernel in :mod:`lintime.modules.cross_entropy.triton`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor

from lintime.ops.utils.launching import launcher_op
from lintime.ops.utils import acc_dtype  # the dtype of losses and gradient sums: fp32, or fp64 for fp64 inputs

# Logits bytes per chunk (in the compute dtype): 4096 rows of bf16 at V = 32000 -- GEMMs of
# [4096, d] x [d, V] are large enough to run at full rate while the [C, V] logits stay a bounded buffer; on CUDA
# dW's fp32 sum is accumulated in place by their epilogue.  Other chunk sizes were not timed.
CHUNK_BYTES = 2**28


def default_chunk_size(V: int, dtype: torch.dtype) -> int:
    """Rows per chunk: the largest power of two whose ``[C, V]`` logits fit :data:`CHUNK_BYTES`."""
    rows = CHUNK_BYTES // max(1, V * dtype.itemsize)
    return 1 << max(0, rows.bit_length() - 1)


def torch_rows(z: Tensor, y: Tensor, scale: Tensor, out: Tensor, ignore_index: int, label_smoothing: float,
               want_grad: bool) -> None:
    """Per-row step in PyTorch: ``out [n]`` <- the rows' losses; with ``want_grad`` the logits
    ``z [n, V]`` are overwritten by ``scale * dloss/dz`` (``scale``: ``[]`` or ``[n]``)."""
    eps = label_smoothing
    zf = z.to(out.dtype)  # [n, V]
    valid = y != ignore_index
    ys = torch.where(valid, y, 0)[:, None]  # [n, 1]
    lse = torch.logsumexp(zf, -1)
    loss = lse - zf.gather(1, ys)[:, 0]
    if eps:
        loss = (1.0 - eps) * loss + eps * (lse - zf.mean(-1))
    out.copy_(torch.where(valid, loss, 0.0))
    if want_grad:
        g = torch.exp(zf - lse[:, None])
        if eps:
            g.sub_(eps / z.shape[1])
        g.scatter_add_(1, ys, g.new_full(ys.shape, -(1.0 - eps)))
        g.mul_(torch.where(valid, scale, 0.0)[:, None])
        z.copy_(g)


def chunked_forward(rows: Callable, x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                    scale: Tensor, ignore_index: int, label_smoothing: float, chunk_size: int,
                    want_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The chunk loop (module docstring).  Returns ``loss [N]`` (per row, fp32 / fp64) and, with
    ``want_grad``, ``dx [N, d]`` (x's dtype), ``dW [V, d]`` and ``db [V]`` (fp32 / fp64; ``db`` empty
    without a bias), each already multiplied by the rows' ``scale``; empty tensors otherwise."""
    N, d = x.shape
    V = weight.shape[0]
    acc = acc_dtype(x)
    w = weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    loss = x.new_empty(N, dtype=acc)
    C = max(1, min(chunk_size, N))
    z_buf = x.new_empty(C, V)
    # CUDA, fp32 sums of low-precision products: dW written by the products' fp32 epilogue, the first chunk's
    # product into it, the next ones accumulated in place (no zero fill; an addmm into a new tensor copied the
    # [V, d] sum once a chunk)
    epilogue = x.is_cuda and acc != x.dtype
    if want_grad:
        dx = torch.empty_like(x)
        dw = (torch.empty if epilogue else torch.zeros)(V, d, dtype=acc, device=x.device)
        db = torch.zeros(V, dtype=acc, device=x.device) if bias is not None else x.new_empty(0, dtype=acc)
    else:
        dx, dw, db = x.new_empty(0), x.new_empty(0, dtype=acc), x.new_empty(0, dtype=acc)
    for s in range(0, N, C):
        e = min(s + C, N)
        x_c, z = x[s:e], z_buf[: e - s]
        if b is None:
            torch.mm(x_c, w.t(), out=z)
        else:
            torch.addmm(b, x_c, w.t(), out=z)
        rows(z, target[s:e], scale if scale.dim() == 0 else scale[s:e], loss[s:e], ignore_index,
             label_smoothing, want_grad)
        if want_grad:  # z now holds the scaled gradient of the chunk's logits
            torch.mm(z, w, out=dx[s:e])
            if acc == x.dtype:
                dw.addmm_(z.t(), x_c)
            elif epilogue:  # the product accumulated into the fp32 sum in the GEMM's epilogue: no [V, d] add pass
                if s == 0:
                    torch.mm(z.t(), x_c, out_dtype=acc, out=dw)
                else:
                    torch.addmm(dw, z.t(), x_c, out_dtype=acc, out=dw)
            else:
                dw += z.t() @ x_c  # the product in x's dtype, the sum over chunks in fp32
            if bias is not None:
                db += z.sum(0, dtype=acc)
    return loss, dx, dw, db


def _fwd_fake(x, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_size, want_grad):
    N, d = x.shape
    V = weight.shape[0]
    acc = acc_dtype(x)
    grads = want_grad and reduction != "none"
    return (
        x.new_empty(N, dtype=acc) if reduction == "none" else x.new_empty((), dtype=acc),
        x.new_empty(N, d) if grads else x.new_empty(0),
        x.new_empty(V, d, dtype=acc) if grads else x.new_empty(0, dtype=acc),
        x.new_empty(V, dtype=acc) if grads and bias is not None else x.new_empty(0, dtype=acc),
    )


def _bwd_fake(x, weight, bias, target, grad, ignore_index, label_smoothing, chunk_size):
    acc = acc_dtype(x)
    return (torch.empty_like(x), x.new_empty(weight.shape, dtype=acc),
            x.new_empty(weight.shape[0] if bias is not None else 0, dtype=acc))


def _setup(ctx, inputs, output):
    x, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_size, _ = inputs
    _, dx, dw, db = output
    ctx.mark_non_differentiable(dx, dw, db)
    ctx.set_materialize_grads(False)
    ctx.args = (reduction, ignore_index, label_smoothing, chunk_size)
    ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
    ctx.save_for_backward(*((x, weight, bias, target) if reduction == "none" else (dx, dw, db)))


def make_op(name: str, rows: Callable) -> Callable:
    """Register the custom ops ``lintime::<name>_fwd`` (loss and, for mean / sum, the gradients) and
    ``lintime::<name>_bwd`` (gradients of ``reduction='none'``) over the per-row step ``rows``, with
    fake shapes and the autograd rule, so ``torch.compile`` traces them; eager calls take the chunk loop
    without the op dispatch (:func:`lintime.ops.utils.launching.launcher_op`).  Returns
    ``fn(x, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_size) -> loss``."""

    def fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, ignore_index: int,
            reduction: str, label_smoothing: float, chunk_size: int,
            want_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        acc = acc_dtype(x)
        if reduction == "mean":
            n_valid = (target != ignore_index).sum().to(acc)
            scale = 1.0 / n_valid
        else:
            scale = torch.ones((), dtype=acc, device=x.device)
        loss, dx, dw, db = chunked_forward(rows, x, weight, bias, target, scale, ignore_index, label_smoothing,
                                           chunk_size, want_grad and reduction != "none")
        if reduction == "mean":
            loss = loss.sum() / n_valid
        elif reduction == "sum":
            loss = loss.sum()
        return loss, dx, dw, db

    def bwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, grad: Tensor, ignore_index: int,
            label_smoothing: float, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
        _, dx, dw, db = chunked_forward(rows, x, weight, bias, target, grad.to(acc_dtype(x)), ignore_index,
                                        label_smoothing, chunk_size, True)
        return dx, dw, db

    bwd_op = launcher_op(f"{name}_bwd", fake=_bwd_fake)(bwd)

    def backward(ctx, g_loss, *_):
        reduction, ignore_index, label_smoothing, chunk_size = ctx.args
        w_dtype, b_dtype = ctx.dtypes
        if g_loss is None:
            return (None,) * 9
        if reduction == "none":
            x, weight, bias, target = ctx.saved_tensors
            dx, dw, db = bwd_op.for_ctx(ctx)(x, weight, bias, target, g_loss, ignore_index, label_smoothing,
                                             chunk_size)
        else:
            dx, dw, db = ctx.saved_tensors
            dx, dw, db = dx * g_loss, dw * g_loss, db * g_loss  # dx keeps x's dtype (0-dim g_loss)
        return (dx, dw.to(w_dtype), None if b_dtype is None else db.to(b_dtype)) + (None,) * 6

    fwd_op = launcher_op(f"{name}_fwd", fake=_fwd_fake, backward=backward, setup_context=_setup)(fwd)

    def loss_fn(x, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_size):
        want_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, weight, bias))
        return fwd_op(x, weight, bias, target, ignore_index, reduction, label_smoothing, chunk_size, want_grad)[0]

    return loss_fn


_chunk_loss = make_op("linear_cross_entropy_chunk", torch_rows)


def chunk_linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, chunk_size=None):
    """Same arguments and result as :func:`lintime.modules.cross_entropy.linear_cross_entropy` on the
    flat ``x [N, d]``, ``target [N]``, computed by the chunk loop in PyTorch."""
    C = default_chunk_size(weight.shape[0], x.dtype) if chunk_size is None else chunk_size
    return _chunk_loss(x, weight, bias, target, ignore_index, reduction, float(label_smoothing), int(C))
