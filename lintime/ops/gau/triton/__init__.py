"""GAU attention on the GPU (forward and backward), see :mod:`.gau`: slabs of materialised scores with cuBLAS
GEMMs (:mod:`.slab`, the default for unpacked calls with wide values) or fused FlashAttention-style kernels
(:mod:`.kernels`); the launch configuration is :class:`.launch.GauLaunch`.
"""

from lintime.ops.gau.triton.gau import triton_gau_attention

__all__ = ["triton_gau_attention"]
