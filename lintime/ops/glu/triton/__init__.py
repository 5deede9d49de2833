"""Triton kernels of the fused gated linear unit activation; see ``ops.py``."""

from lintime.ops.glu.triton.ops import triton_glu

__all__ = ["triton_glu"]
