"""Triton kernels of the fused gated linear unit activation and the two-tensor gate; see ``ops.py``."""

from lintime.modules.glu.triton.ops import triton_glu, triton_gated

__all__ = ["triton_glu", "triton_gated"]
