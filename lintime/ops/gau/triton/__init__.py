"""GAU attention on the GPU (forward and backward), see :mod:`.gau`: slabs of materialised scores with cuBLAS
GEMMs (:mod:`.slab`, the default for unpacked calls with wide values) or fused FlashAttention-style kernels.

The relu^2 region kernels in :mod:`.kernels` are shared with mixed chunk attention, whose
quadratic part is the same computation with chunks as regions.
"""

from lintime.ops.gau.triton.gau import triton_gau_attention

__all__ = ["triton_gau_attention"]
