"""Fused Triton kernels of linear attention (forward, backward, decoding); see ``ops.py``."""

from lintime.ops.linear.triton.ops import triton_linear_attention

__all__ = ["triton_linear_attention"]
