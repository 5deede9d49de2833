"""Fused Triton kernels of GAU attention (forward and backward), see :mod:`.gau`.

The relu^2 region kernels in :mod:`.kernels` are shared with mixed chunk attention, whose
quadratic part is the same computation with chunks as regions.
"""

from lintime.ops.gau.triton.gau import triton_gau_attention

__all__ = ["triton_gau_attention"]
