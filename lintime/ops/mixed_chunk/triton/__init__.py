"""Fused Triton kernels of mixed chunk attention (forward and backward), see :mod:`.mixed_chunk`: the kernels (the
state walks :mod:`.walk`, the products :mod:`.kernels`), their launchers (:mod:`.launchers`), the host-side plan
(:mod:`.plan`) and the launch configuration (:class:`.launch.MixedChunkLaunch`).
"""

from lintime.ops.mixed_chunk.triton.mixed_chunk import triton_mixed_chunk_attention

__all__ = ["triton_mixed_chunk_attention"]
