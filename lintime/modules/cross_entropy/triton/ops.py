"""Host side of the fused linear + cross-entropy's Triton path: the launcher of the per-row kernel,
the ``lintime::linear_cross_entropy_triton_*`` custom ops (the chunk loop of
:mod:`lintime.modules.cross_entropy.chunk` with the kernel as its per-row step) and the backend entry
:func:`triton_linear_cross_entropy`.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
from torch import Tensor

from lintime.modules.cross_entropy.chunk import default_chunk_size, make_op
from lintime.modules.cross_entropy.triton.kernels import ce_rows_kernel

_OP = "linear_cross_entropy"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Launch:
    """Launch configuration of :func:`ce_rows_kernel`."""

    # Columns per block and warps per row: two sweeps of 8192-column blocks (the second mostly from L2) beat a whole
    # row kept in registers (Liger-Kernel's launch) and narrower or wider blocks
    block_v: int = 8192
    num_warps: int = 16


LAUNCH = Launch()


def triton_rows(z: Tensor, y: Tensor, scale: Tensor, out: Tensor, ignore_index: int, label_smoothing: float,
                want_grad: bool, launch: Launch = LAUNCH) -> None:
    """The per-row step of :func:`lintime.modules.cross_entropy.chunk.torch_rows` by the kernel (same
    arguments; ``launch`` overrides the block size for tests)."""
    n, V = z.shape
    if n == 0:
        return
    BV = min(launch.block_v, triton.next_power_of_2(V))
    ce_rows_kernel[(n,)](
        z, y, out, scale, z.stride(0), 0 if scale.dim() == 0 else scale.stride(0), V, ignore_index, float(label_smoothing),
        BV=BV, SMOOTH=label_smoothing > 0, WANT_GRAD=want_grad, ONE_BLOCK=BV >= V,
        num_warps=launch.num_warps,
    )


_triton_loss = make_op("linear_cross_entropy_triton", triton_rows)


def check_device(x: Tensor) -> None:
    """CUDA tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, tests)."""
    if x.device.type == "cuda" or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return
    raise ValueError(f"{_OP}: backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for Triton's CPU "
                     f"interpreter), got a tensor on {x.device}")


def triton_linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                                label_smoothing=0.0, chunk_size=None):
    """Same arguments and result as :func:`lintime.modules.cross_entropy.linear_cross_entropy` on the
    flat ``x [N, d]``, ``target [N]``: the chunk loop with the Triton kernel as its per-row step
    (``x`` in fp16, bf16 or fp32)."""
    check_device(x)
    if x.dtype not in DTYPES:
        raise TypeError(f"{_OP}: backend 'triton' takes fp16, bf16 or fp32 inputs, got {x.dtype}")
    C = default_chunk_size(weight.shape[0], x.dtype) if chunk_size is None else chunk_size
    return _triton_loss(x, weight, bias, target, ignore_index, reduction, float(label_smoothing), int(C))
