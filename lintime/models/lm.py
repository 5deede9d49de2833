"""Language-model heads over the shared backbone: :class:`CausalLM` (next-token prediction,
causal mixers, decoding state) and :class:`MaskedLM` (bidirectional mixers, no state).

Both: ``logits = hidden @ W_out^T`` with ``W_out`` the token embedding when
``config.tie_embeddings`` (the seed's parameter counts imply tied embeddings: see
``docs/models.md``), a separate ``[vocab, d]`` matrix otherwise.
Given ``targets`` the forward returns the summed cross-entropy instead of the logits, by default
fused with the output projection (:func:`lintime.modules.linear_cross_entropy`: no ``[B*T, vocab]``
logits, the largest tensor of a training step).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lintime.layers.positional import LearnedPositionEmbedding
from lintime.models.backbone import Backbone, ModelState
from lintime.models.config import ModelConfig
from lintime.modules.cross_entropy import linear_cross_entropy


class _LanguageModel(nn.Module):
    """Everything the two heads share; subclasses only fix ``causal``."""

    causal: bool

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"{type(self).__name__} needs a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.backbone = Backbone(config, causal=self.causal)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Seed init: every dense / embedding weight ``N(0, init_std)``, biases 0, norms at
        their identity; then each module's own ``init_weights(std)`` hook (mixers with special
        parameters, the learned position table); the ScaledSin scale (``1/sqrt(d)``) and
        relative-bias tables keep the init they were built with."""
        std = self.config.init_std
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
        for m in self.modules():
            hook = getattr(m, "init_weights", None)
            if hook is not None:
                hook(std)

    # ------------------------------------------------------------------ forward
    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(h, self.backbone.embed.weight)
        return self.lm_head(h)

    def init_state(self, batch_size: int, device=None, dtype=None) -> ModelState:
        """Empty decoding state for ``batch_size`` sequences."""
        if not self.causal:
            raise ValueError(f"{type(self).__name__} is bidirectional: it has no decoding state")
        return self.backbone.init_state(batch_size, device, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        state: ModelState | None = None,
        return_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        *,
        aux_losses: dict[str, torch.Tensor] | None = None,
        targets: torch.Tensor | None = None,
        fused_loss: bool = True,
    ):
        """``input_ids [B, T]`` -> ``logits [B, T, vocab]`` (and the new state if ``return_state``).

        With ``targets [B, T]`` (class indices, ``-100`` = no target) it returns the summed
        cross-entropy against them instead of the logits (fp32; fp64 for a fp64 model):
        ``fused_loss`` through :func:`lintime.modules.linear_cross_entropy` on the final hidden states
        (chunks of rows; under autocast in the autocast dtype, as the logits would be), else the
        plain loss, ``F.cross_entropy`` on the full logits in fp32 (equal to rounding)."""
        if (state is not None or return_state) and not self.causal:
            raise ValueError(f"{type(self).__name__} is bidirectional: it takes no state and returns none")
        if return_state and state is None:
            n = input_ids.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
            state = self.init_state(n)
        h, new_state = self.backbone(input_ids, state, cu_seqlens=cu_seqlens, aux_losses=aux_losses)
        out = self._logits(h) if targets is None else self._loss(h, targets, fused_loss)
        return (out, new_state) if return_state else out

    def _loss(self, h: torch.Tensor, targets: torch.Tensor, fused: bool) -> torch.Tensor:
        if targets.shape != h.shape[:-1]:
            raise ValueError(f"targets must have the shape of input_ids {tuple(h.shape[:-1])}, got {tuple(targets.shape)}")
        if not fused:
            logits = self._logits(h)
            acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
            return F.cross_entropy(logits.flatten(0, -2).to(acc), targets.flatten(), ignore_index=-100, reduction="sum")
        if torch.is_autocast_enabled(h.device.type):  # custom ops are not autocast: cast as F.linear would
            h = h.to(torch.get_autocast_dtype(h.device.type))
        weight = self.backbone.embed.weight if self.lm_head is None else self.lm_head.weight
        return linear_cross_entropy(h, weight, targets, ignore_index=-100, reduction="sum")

    def set_fused(self, fused: bool) -> None:
        """Turn the layers' fused elementwise kernels on or off: every submodule with a ``fused`` attribute (the
        norms, the FLASH / GAU heads) runs its op's fused kernel where the device has one (``True``, the default)
        or the op's chunked PyTorch reference form on every device (``False``: what the fused path is checked
        against; the backbone's residual adds then run as plain adds before the norms, :attr:`Backbone.fused`).  The
        attention ops keep their dispatch; the loss's fusion is :meth:`forward`'s ``fused_loss``."""
        for m in self.modules():
            if m is not self and isinstance(getattr(m, "fused", None), bool):
                m.fused = bool(fused)

    # ------------------------------------------------------------------ parameters
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Trainable parameters (shared ones once).  ``exclude_embeddings`` leaves out the token
        embedding, the learned position table and the output projection (tied or not)."""
        skip = set()
        if exclude_embeddings:
            skip.add(id(self.backbone.embed.weight))
            if isinstance(self.backbone.pos, LearnedPositionEmbedding):
                skip.add(id(self.backbone.pos.weight))
            if self.lm_head is not None:
                skip.add(id(self.lm_head.weight))
        return sum(p.numel() for p in self.parameters() if p.requires_grad and id(p) not in skip)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Two AdamW groups: ``weight_decay`` on matrices (dense and embedding weights), 0 on
        0-D / 1-D tensors (norm gains and offsets, biases, the ScaledSin scale) and on whatever a
        module names in its ``no_weight_decay()`` hook (e.g. relative-bias tables)."""
        excluded: set[str] = set()
        for mname, m in self.named_modules():
            hook = getattr(m, "no_weight_decay", None)
            if hook is not None:
                excluded |= {f"{mname}.{n}" if mname else n for n in hook()}
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (no_decay if p.dim() < 2 or name in excluded else decay).append(p)
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]


class CausalLM(_LanguageModel):
    """Auto-regressive LM.

    ``forward(input_ids [B, T], state=None, return_state=False, cu_seqlens=None)`` returns the
    logits ``[B, T, vocab]`` (position ``t`` predicts token ``t + 1``), and the state after the
    input when ``return_state`` (continuing ``state``, or starting from an empty one).
    Full-sequence logits equal chunked prefill plus token-by-token decoding with the returned
    states.  With ``cu_seqlens`` (``B == 1``, packed sequences) the state has one row per
    sequence.  ``aux_losses``: optional caller-owned dict that mixers with auxiliary training
    losses add to (see :mod:`lintime.layers.base`).
    """

    causal = True


class MaskedLM(_LanguageModel):
    """Bidirectional (masked) LM: ``forward(input_ids [B, T], cu_seqlens=None) -> logits
    [B, T, vocab]``; every token sees its whole sequence (and only it, with packing).  Same
    signature as :class:`CausalLM`; asking it for a state raises.  Masking the input and
    choosing the predicted positions is the training code's job."""

    causal = False
