"""Triton kernel of the fused linear + cross-entropy (the per-row step of each chunk); see ``ops.py``."""

from lintime.modules.cross_entropy.triton.ops import triton_linear_cross_entropy

__all__ = ["triton_linear_cross_entropy"]
