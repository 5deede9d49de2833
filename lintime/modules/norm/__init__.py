"""Normalisation over the last dimension (LayerNorm, RMSNorm, ScaleNorm) in one pass per direction, alone
(:func:`normalize`) or with the pre-norm block's residual add before it (:func:`add_normalize`).

On CUDA the Triton kernels read each row once and write the normalised row directly in the dtype the
next GEMM runs in (``out_dtype``: bf16 under autocast), so a pre-norm block spends one read of the
fp32 residual stream and one bf16 write per norm instead of the composite's eight passes and a cast;
the backward is one pass too (``dx`` and the per-feature partial sums of ``dweight`` / ``dbias``).
Statistics are always fp32 (fp64 for fp64 inputs).  :func:`add_normalize` also reads the branch output,
writes the new residual stream, and adds the stream's gradient in its backward pass: the separate add
passes of ``x = x + y`` (forward, and the gradient sum and cast backward) disappear; its ``branch_bias`` adds the
branch's own bias in the same pass (a projection run without it), its gradient the column sums the backward pass
already walks (no GEMV over the branch's gradient).
:func:`gated_normalize` multiplies the normalised row by ``silu(gate)`` in the same pass (GLA's head norm and
output gate), and splits the gradient between the gate and the norm in the backward's.
"""

from __future__ import annotations

import torch

from lintime.ops.dispatch import register_triton, select
from lintime.modules.norm.chunk import torch_add_normalize, torch_gated_normalize, torch_normalize
from lintime.modules.norm.naive import naive_add_normalize, naive_gated_normalize, naive_normalize

_IMPLS = {"naive": naive_normalize, "chunk": torch_normalize}
_ADD_IMPLS = {"naive": naive_add_normalize, "chunk": torch_add_normalize}
_GATED_IMPLS = {"naive": naive_gated_normalize, "chunk": torch_gated_normalize}


def _load_triton():  # the fused kernels, picked automatically for CUDA tensors when Triton is installed
    from lintime.modules.norm.triton import triton_normalize

    return triton_normalize


def _load_triton_add():
    from lintime.modules.norm.triton import triton_add_normalize

    return triton_add_normalize


def _load_triton_gated():
    from lintime.modules.norm.triton import triton_gated_normalize

    return triton_gated_normalize


register_triton(_IMPLS, _load_triton)
register_triton(_ADD_IMPLS, _load_triton_add)
register_triton(_GATED_IMPLS, _load_triton_gated)

_OP = "normalize"
KINDS = ("layernorm", "rmsnorm", "scalenorm")


def _check(op: str, x, weight, bias, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"{op}: kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"{op}: x must be a floating tensor [..., D]")
    D = x.shape[-1]
    want_w = () if kind == "scalenorm" else (D,)
    if weight is not None and tuple(weight.shape) != want_w:
        raise ValueError(f"{op}: {kind} weight must have shape {want_w}, got {tuple(weight.shape)}")
    if bias is not None:
        if kind != "layernorm":
            raise ValueError(f"{op}: only layernorm takes a bias")
        if tuple(bias.shape) != (D,):
            raise ValueError(f"{op}: bias must have shape ({D},), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")


def _check_pair(op: str, x: torch.Tensor, name: str, t) -> None:
    """The second row tensor of a fused call (``branch``, ``gate``): floating, ``x``'s shape and device."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != x.shape:
        raise ValueError(f"{op}: {name} must be a floating tensor of x's shape {tuple(x.shape)}, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.device != x.device:
        raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")


def _check_branch_bias(op: str, x: torch.Tensor, t) -> None:
    """``branch_bias``: a floating ``[D]`` tensor on ``x``'s device (any floating dtype)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or tuple(t.shape) != (x.shape[-1],):
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: branch_bias must be a floating tensor of shape ({x.shape[-1]},), got {got}")
    if t.device != x.device:
        raise ValueError(f"{op}: branch_bias is on {t.device}, x on {x.device}")


def _traced_backend(backend: str | None) -> str | None:
    """The automatic backend of the two-input fused ops while ``torch.compile`` traces: their PyTorch form, which
    inductor fuses itself (the Triton custom ops' joint graph failed inductor's functional-graph check on CUDA with
    torch 2.11)."""
    return "chunk" if backend is None and torch.compiler.is_compiling() else backend


def _impls(impls: dict, backend: str | None, *dtypes: torch.dtype) -> dict:
    if backend is None and torch.float64 in dtypes:
        return {name: fn for name, fn in impls.items() if name != "triton"}  # the kernels have no fp64
    return impls


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    kind: str = "layernorm",
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Normalise ``x`` over its last dimension ``D`` (FLASH seed Code 5; RMSNorm):

    * ``layernorm``: ``(x - mean) / sqrt(var + eps) * weight + bias``;
    * ``rmsnorm``: ``x / sqrt(mean(x^2) + eps) * weight`` (``weight [D]``);
    * ``scalenorm``: the same with a scalar gain (``weight []``).

    Args:
        x: ``[..., D]`` fp32, fp16, bf16 (or fp64: the PyTorch forms only).
        weight: ``[D]`` (``[]`` for ``scalenorm``) or ``None`` (no gain).
        bias: ``[D]`` or ``None`` (``layernorm`` only).
        eps: added to the variance / mean square.
        out_dtype: the result's dtype (default ``x.dtype``); a layer under autocast asks for the
            autocast dtype, which equals rounding the fp32 result, as the next autocast GEMM would.
        backend: ``None`` (automatic: ``triton`` for CUDA tensors), ``"naive"``, ``"chunk"`` or
            ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``).
    Returns:
        ``[..., D]`` in ``out_dtype``; gradients flow to ``x``, ``weight`` and ``bias``.
    """
    _check(_OP, x, weight, bias, kind)
    D = x.shape[-1]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    impls = _impls(_IMPLS, backend, x.dtype, out_dtype)
    x2 = x.reshape(-1, D)
    impl = select(_OP, backend, impls, x2[None])
    y = impl(x2, weight, bias, kind=kind, eps=float(eps), out_dtype=out_dtype)
    return y.view(x.shape)


def add_normalize(
    x: torch.Tensor,
    branch: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    branch_bias: torch.Tensor | None = None,
    kind: str = "layernorm",
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-norm block's residual add and the norm after it: ``s = x + branch``, ``(s, normalize(s))``; with
    ``branch_bias``, ``s = x + (branch + branch_bias)``: the branch's own bias (a projection run without it) added
    in the same pass, its gradient the column sums the backward pass already walks.

    Args:
        x: ``[..., D]`` the residual stream (fp32 under autocast).
        branch: ``[..., D]`` the sub-layer output added to it (the autocast dtype under autocast).
        branch_bias: ``None`` or ``[D]``, any floating dtype, on ``x``'s device (the FLASH / GAU output
            projection's fp32 bias).  The rule: ``branch_bias`` is rounded to ``branch``'s dtype, then
            ``x + (branch + branch_bias)`` is computed in fp32 (fp64 if ``x`` or ``branch`` is fp64) and rounded
            once to the sum's dtype.  Its gradient is the column sums of ``branch``'s gradient, accumulated in
            fp32 (fp64) from the values before they are rounded to ``branch``'s dtype, rounded once to
            ``branch_bias``'s dtype.
        weight, bias, kind, eps, backend: as for :func:`normalize`.
        out_dtype: the normalised result's dtype (default: the sum's).
    Returns:
        ``s [..., D]`` in ``torch.promote_types(x.dtype, branch.dtype)`` (what ``x + branch`` gives;
        ``branch_bias``'s dtype does not enter) and ``normalize(s) [..., D]`` in ``out_dtype``.  Gradients flow to
        ``x`` and ``branch`` (each in its own dtype: the sum of ``s``'s gradient and the norm's), ``branch_bias``,
        ``weight`` and ``bias``.
    """
    op = "add_normalize"
    _check(op, x, weight, bias, kind)
    _check_pair(op, x, "branch", branch)
    if branch_bias is not None:
        _check_branch_bias(op, x, branch_bias)
    D = x.shape[-1]
    s_dtype = torch.promote_types(x.dtype, branch.dtype)
    out_dtype = s_dtype if out_dtype is None else out_dtype
    backend = _traced_backend(backend)
    extra = () if branch_bias is None else (branch_bias.dtype,)
    impls = _impls(_ADD_IMPLS, backend, x.dtype, branch.dtype, out_dtype, *extra)
    x2 = x.reshape(-1, D)
    impl = select(op, backend, impls, x2[None])
    s, y = impl(x2, branch.reshape(-1, D), weight, bias, kind=kind, eps=float(eps), out_dtype=out_dtype,
                branch_bias=branch_bias)
    return s.view(x.shape), y.view(x.shape)


def gated_normalize(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    kind: str = "layernorm",
    eps: float = 1e-5,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The norm and an output gate after it: ``normalize(x) * silu(gate)`` (GLA's per-head norm and ``r`` gate,
    seed ``gated-linear-attention-zh.txt`` §4.4), one pass per direction on CUDA.

    Args:
        x: ``[..., D]`` the rows normalised (fp32, fp16, bf16; fp64: the PyTorch forms only).
        gate: ``[..., D]`` the gate's pre-activation (any float dtype; bf16 under autocast).
        weight, bias, kind, eps, backend: as for :func:`normalize`.
        out_dtype: the result's dtype (default ``x.dtype``).
    Returns:
        ``[..., D]`` in ``out_dtype``: the norm and ``silu(gate)`` in fp32 (fp64 if an input is), multiplied
        and rounded once.  Gradients flow to ``x`` and ``gate`` (each in its own dtype), ``weight`` and ``bias``.
    """
    op = "gated_normalize"
    _check(op, x, weight, bias, kind)
    _check_pair(op, x, "gate", gate)
    D = x.shape[-1]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    backend = _traced_backend(backend)
    impls = _impls(_GATED_IMPLS, backend, x.dtype, gate.dtype, out_dtype)
    x2 = x.reshape(-1, D)
    impl = select(op, backend, impls, x2[None])
    y = impl(x2, gate.reshape(-1, D), weight, bias, kind=kind, eps=float(eps), out_dtype=out_dtype)
    return y.view(x.shape)


__all__ = ["add_normalize", "gated_normalize", "normalize"]
