"""Fused Triton kernels of gated linear attention (forward, backward, decoding); see ``ops.py``."""

from lintime.ops.gla.triton.ops import triton_gla

__all__ = ["triton_gla"]
