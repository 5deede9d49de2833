"""The Transformer-VQ layer's SiLUs: the output gate ``o * silu(g_pre)`` (seed Eq. 11, ``g = phi_g(x W_G)`` with
SiLU, App. C; Eq. 14, the gated output before ``W_O``), one function, the PyTorch composite or one Triton kernel each
way; and the values' ``silu(x W_V)`` (Eq. 10), whose backward reads the op's strided gradient in place."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.ops.dispatch import register_triton, select


def torch_vq_gate(o: torch.Tensor, g_pre: torch.Tensor) -> torch.Tensor:
    return o * F.silu(g_pre)


_IMPLS = {"chunk": torch_vq_gate}


def _load_triton():
    from lintime.ops.vq.triton.gate import triton_vq_gate

    return triton_vq_gate


register_triton(_IMPLS, _load_triton)


def vq_gate(o: torch.Tensor, g_pre: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``o * silu(g_pre)`` for ``o``, ``g_pre`` ``[..., E]`` (``g_pre`` may be a slice of a wider projection: unit
    stride in its last dimension is enough).

    ``backend``: ``None`` (automatic: ``"triton"`` for CUDA tensors of one dtype in fp16 / bf16 / fp32 when Triton
    is installed and ``torch.compile`` is not tracing, else ``"chunk"``), ``"chunk"`` (the PyTorch composite) or
    ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``; the SiLU and the product in fp32, rounded once).
    Returns ``[..., E]`` in ``o``'s dtype; gradients to both inputs."""
    if o.shape != g_pre.shape:
        raise ValueError(f"vq_gate: o and g_pre need one shape, got {tuple(o.shape)} and {tuple(g_pre.shape)}")
    if backend is None and (o.dtype != g_pre.dtype or o.dtype not in (torch.float16, torch.bfloat16, torch.float32)
                            or torch.compiler.is_compiling()):
        backend = "chunk"
    return select("vq_gate", backend, _IMPLS, o.reshape(1, -1))(o, g_pre)


_SILU_IMPLS = {"chunk": torch.nn.functional.silu}


def _load_triton_silu():
    from lintime.ops.vq.triton.gate import triton_vq_silu

    return triton_vq_silu


register_triton(_SILU_IMPLS, _load_triton_silu)


def vq_value_silu(v_pre: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(v_pre)`` for ``v_pre [B, ..., E]`` (seed Eq. 10).  Its gradient comes back from ``vq_attention`` as a
    strided slice of the op's block layout (two empty blocks before each row); PyTorch's SiLU backward takes its
    non-vectorised path on such a tensor (a visible share of vq-base's training step), the Triton
    backward reads the rows where they lie.

    ``backend``: ``None`` (automatic: ``"triton"`` for CUDA tensors in fp16 / bf16 / fp32 that need a gradient when
    Triton is installed and ``torch.compile`` is not tracing, else ``"chunk"``), ``"chunk"`` (``F.silu``) or
    ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``)."""
    if backend is None and (not v_pre.requires_grad or v_pre.dtype not in (torch.float16, torch.bfloat16, torch.float32)
                            or v_pre.dim() < 2 or torch.compiler.is_compiling()):
        backend = "chunk"
    return select("vq_value_silu", backend, _SILU_IMPLS, v_pre.reshape(1, -1))(v_pre)
