"""Host side of the fused linear + cross-entropy's Triton path: the launcher of the per-row kernel,
the ``lintime::linear_cross_entropy_triton_*`` custom ops (the chunk loop of
:mod:`lintime.modules.cross_entropy.chunk` with the kernel as its per-row step) and the backend entry
:func:`triton_linear_cross_entropy`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lintime.modules.cross_entropy.chunk import default_chunk_size, make_op
from lintime.modules.cross_entropy.triton.kernels import ce_rows_kernel
from lintime.modules.cross_entropy.triton.launch import CrossEntropyLaunch, default_launch
from lintime.ops.utils.launching import check_device, next_pow2

_OP = "linear_cross_entropy"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_rows(z: Tensor, y: Tensor, scale: Tensor, out: Tensor, ignore_index: int, label_smoothing: float,
                want_grad: bool, launch: CrossEntropyLaunch | None = None) -> None:
    """The per-row step of :func:`lintime.modules.cross_entropy.chunk.torch_rows` by the kernel (same
    arguments; ``launch``: :func:`default_launch`'s unless given, for tests and sweeps)."""
    n, V = z.shape
    if n == 0:
        return
    launch = launch or default_launch()
    BV = min(launch.block_v, next_pow2(V))
    ce_rows_kernel[(n,)](
        z, y, out, scale, z.stride(0), 0 if scale.dim() == 0 else scale.stride(0), V, ignore_index, float(label_smoothing),
        BV=BV, SMOOTH=label_smoothing > 0, WANT_GRAD=want_grad, ONE_BLOCK=BV >= V,
        num_warps=launch.num_warps,
    )


_triton_loss = make_op("linear_cross_entropy_triton", triton_rows)


def triton_linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                                label_smoothing=0.0, chunk_size=None):
    """Same arguments and result as :func:`lintime.modules.cross_entropy.linear_cross_entropy` on the
    flat ``x [N, d]``, ``target [N]``: the chunk loop with the Triton kernel as its per-row step
    (``x`` in fp16, bf16 or fp32)."""
    check_device(_OP, x)
    if x.dtype not in DTYPES:
        raise TypeError(f"{_OP}: backend 'triton' takes fp16, bf16 or fp32 inputs, got {x.dtype}")
    C = default_chunk_size(weight.shape[0], x.dtype) if chunk_size is None else chunk_size
    return _triton_loss(x, weight, bias, target, ignore_index, reduction, float(label_smoothing), int(C))
