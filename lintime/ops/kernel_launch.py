"""What every Triton launch needs on the host: whether the device runs the kernels, tile arithmetic in
plain Python, the dtype rule of the matmuls, and multiprocessor counts."""

from __future__ import annotations

import functools
import os

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
