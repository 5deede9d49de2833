"""Fused Triton kernels of Transformer-VQ attention (forward and backward), see :mod:`.vq`: the kernels
(:mod:`.kernels`), the custom ops and the entry (:mod:`.vq`) and the launch configuration (:class:`.launch.VQLaunch`).
"""

from lintime.ops.vq.triton.vq import triton_vq_attention

__all__ = ["triton_vq_attention"]
