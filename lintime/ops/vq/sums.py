"""Per-row counts and sums of vectors by an integer row index (the layer's EMA codebook statistics, seed Section
3.4.1): PyTorch ``index_add`` in fp32, or on CUDA the Triton scatter-add kernel of :mod:`.triton.sums` (the vectors
read in their own dtype, counts in the same pass)."""

from __future__ import annotations

import torch

from lintime.ops.dispatch import triton_available


def code_sums(rows: torch.Tensor, x: torch.Tensor, n_rows: int, *, backend: str | None = None):
    """``(count [n_rows], sum [n_rows, D])`` fp32 (fp64 for fp64 ``x``): how many of ``rows`` ``[M]`` (int64 in
    ``[0, n_rows)``) name each row and the sum of their vectors ``x`` ``[M, D]``.  No gradient.  ``backend``:
    ``None`` (``"triton"`` for CUDA tensors in fp16 / bf16 / fp32 when Triton is installed, else ``"chunk"``),
    ``"chunk"`` (two ``index_add``) or ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``).  The order of a
    sum's terms is not fixed on CUDA (atomic adds) in either form."""
    if backend is None:
        fast = x.dtype in (torch.float16, torch.bfloat16, torch.float32) and triton_available(x.device)
        backend = "triton" if fast else "chunk"
    with torch.no_grad():
        if backend == "triton":
            from lintime.ops.vq.triton.sums import vq_sums_op

            ok = torch.ones(rows.numel(), dtype=torch.int8, device=rows.device)
            return vq_sums_op(rows.contiguous(), x.contiguous(), ok, n_rows)
        if backend != "chunk":
            raise ValueError(f"code_sums: backend must be None, 'chunk' or 'triton', got {backend!r}")
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        n = torch.zeros(n_rows, dtype=dt, device=x.device).index_add_(
            0, rows, torch.ones(rows.shape, dtype=dt, device=x.device))
        s = torch.zeros(n_rows, x.shape[-1], dtype=dt, device=x.device).index_add_(0, rows, x.to(dt))
        return n, s
