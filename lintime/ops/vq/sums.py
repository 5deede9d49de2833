"""Per-row counts and sums of vectors by an integer row index (the layer's EMA codebook statistics, seed Section
3.4.1): PyTorch ``index_add`` in fp32.  (A Triton scatter-add kernel for these sums broke the CUDA-graph capture
of vq-base's training step, cause not found; it is not used.)"""

from __future__ import annotations

import torch


def code_sums(rows: torch.Tensor, x: torch.Tensor, n_rows: int):
    """``(count [n_rows], sum [n_rows, D])`` fp32 (fp64 for fp64 ``x``): how many of ``rows`` ``[M]`` (int64 in
    ``[0, n_rows)``) name each row and the sum of their vectors ``x`` ``[M, D]``, by two ``index_add`` (the order
    of a sum's terms is not fixed on CUDA).  No gradient."""
    with torch.no_grad():
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        n = torch.zeros(n_rows, dtype=dt, device=x.device).index_add_(
            0, rows, torch.ones(rows.shape, dtype=dt, device=x.device))
        s = torch.zeros(n_rows, x.shape[-1], dtype=dt, device=x.device).index_add_(0, rows, x.to(dt))
        return n, s
