"""Triton kernels of the fused normalisation; see ``ops.py``."""

from lintime.modules.norm.triton.ops import triton_add_normalize, triton_gated_normalize, triton_normalize

__all__ = ["triton_add_normalize", "triton_gated_normalize", "triton_normalize"]
