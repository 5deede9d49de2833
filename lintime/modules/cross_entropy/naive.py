"""The plain loss: the whole ``[N, V]`` logits matrix, then ``F.cross_entropy`` on it in fp32.

This is what a model does without the fused op (and the reference every other form is tested
against): the logits are computed in ``x``'s dtype (bf16 under autocast), upcast to fp32 (fp64 for
fp64 inputs) and reduced by PyTorch's cross-entropy; autograd differentiates the lot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_linear_cross_entropy(x, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                               label_smoothing=0.0, chunk_size=None):
    """Same arguments and result as :func:`lintime.modules.cross_entropy.linear_cross_entropy` on the
    flat ``x [N, d]``, ``target [N]`` (``chunk_size`` is accepted for a common signature and unused)."""
    logits = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))  # [N, V]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    return F.cross_entropy(logits.to(acc), target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
