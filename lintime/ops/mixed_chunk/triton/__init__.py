"""Fused Triton kernels of mixed chunk attention (forward and backward), see :mod:`.mixed_chunk`.

The in-chunk relu^2 part runs on the region kernels of :mod:`lintime.ops.gau.triton.kernels`
(chunks as regions); :mod:`.kernels` holds the chunk-level linear state pass.
"""

from lintime.ops.mixed_chunk.triton.mixed_chunk import triton_mixed_chunk_attention

__all__ = ["triton_mixed_chunk_attention"]
