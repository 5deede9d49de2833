"""Masked-LM corruption (BERT's rule, used by ``--objective mlm``)."""

from __future__ import annotations

from typing import Sequence

import torch

IGNORE_INDEX = -100


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int] = (),
    mask_prob: float = 0.15,
    generator: torch.Generator | None = None,
    maskable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt ``input_ids`` for masked-LM training; returns ``(corrupted_ids, targets)``.

    Each maskable position is selected with probability ``mask_prob`` (0.15); a selected
    position becomes ``mask_id`` with probability 0.8, a uniformly random non-special token
    with probability 0.1, and stays unchanged with probability 0.1.  ``targets`` holds the
    original id at selected positions and ``IGNORE_INDEX`` (-100) everywhere else.

    A position is maskable when its id is not in ``special_ids`` and ``maskable`` (a bool
    tensor of the same shape, e.g. "not padding") is true there.  One uniform tensor
    ``[3, *shape]`` is drawn from ``generator`` whatever the content, so a given generator
    state always yields the same corruption.

    Shapes: ``input_ids`` any shape (``[B, T]``), integer; outputs the same shape, int64.
    """
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    uniforms = torch.rand((3,) + tuple(input_ids.shape), generator=generator, device=input_ids.device)
    return corrupt(input_ids, uniforms, mask_id=mask_id, vocab_size=vocab_size, special_ids=special_ids, mask_prob=mask_prob, maskable=maskable)


def corrupt(
    input_ids: torch.Tensor,
    uniforms: torch.Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int] = (),
    mask_prob: float = 0.15,
    maskable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mask_tokens` with its randomness given: ``uniforms`` is ``[3, *input_ids.shape]`` in ``[0, 1)``
    (selection, action, replacement token), so a batch can draw each row from its own generator."""
    ids = input_ids.long()
    special = torch.as_tensor(sorted(set(int(s) for s in special_ids)), dtype=torch.long, device=ids.device)
    can = ~torch.isin(ids, special)
    if maskable is not None:
        can &= maskable.to(device=ids.device, dtype=torch.bool)
    # Replacement tokens come from the non-special ids only: a random <pad>/<eos> would be a
    # corruption the model never sees at inference.
    allowed = torch.ones(vocab_size, dtype=torch.bool, device=ids.device)
    allowed[special[(special >= 0) & (special < vocab_size)]] = False
    allowed_ids = allowed.nonzero().squeeze(1)

    select_u, action_u, pick_u = uniforms.unbind(0)
    selected = can & (select_u < mask_prob)
    to_mask = selected & (action_u < 0.8)
    to_random = selected & (action_u >= 0.8) & (action_u < 0.9)
    random_ids = allowed_ids[(pick_u * len(allowed_ids)).long().clamp_(max=len(allowed_ids) - 1)]

    out = torch.where(to_mask, torch.full_like(ids, mask_id), ids)
    out = torch.where(to_random, random_ids, out)
    targets = torch.where(selected, ids, torch.full_like(ids, IGNORE_INDEX))
    return out, targets
