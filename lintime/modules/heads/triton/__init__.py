"""Fused Triton kernels of the GAU / FLASH heads (forward and backward), see :mod:`.heads`."""

from lintime.modules.heads.triton.heads import triton_gau_heads

__all__ = ["triton_gau_heads"]
