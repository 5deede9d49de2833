"""Static decoding: the model's state in preallocated buffers, updated in place by every step.

    dec = StaticDecoder(model, state, capacity=prompt_len + max_new_tokens)
    logits = dec.step(token)          # [B, V]; dec.state's buffers now hold the next state

A :class:`StaticDecoder` owns a copy of a decoding state in fixed-size buffers
(:func:`lintime.layers.base.static_state`: KV caches at a fixed capacity, written in place;
constant-size states as they are).  :meth:`StaticDecoder.step` feeds one token per sequence with
:func:`~lintime.generation.decode.decode_one_token` and writes the result back into the same
buffers (:func:`lintime.layers.base.copy_state_`), so one step is a fixed-shape function of
``(token, buffers)`` with no host read: what :mod:`lintime.generation.graphs` captures in a CUDA
graph.  Each decoder owns its buffers; two decoders never share one.

Notation: ``B`` sequences, ``V`` vocabulary, ``capacity`` the most tokens a sequence will hold
(prompt + new tokens).
"""

from __future__ import annotations

import dataclasses

import torch

from lintime.generation.decode import decode_one_token
from lintime.layers.base import copy_state_, map_state, select_state, static_state
from lintime.ops.utils import mark_checked


def state_tensors(state) -> list[torch.Tensor]:
    """Every tensor of a decoding state (its buffers), in a fixed order."""
    out: list[torch.Tensor] = []
    map_state(state, lambda t: out.append(t) or t)
    return out


def mark_state_checked(state) -> None:
    """Record that the state's buffers hold values an op produced (they were copied from op
    outputs), so the ops skip their value checks (a host read) on them; needed after every
    in-place write, which bumps the tensors' version counters."""
    mark_checked(*state_tensors(state))


class StaticDecoder:
    """Decoding ``B`` sequences of up to ``capacity`` tokens through in-place state buffers.

    ``state``: a model state (e.g. from :func:`~lintime.generation.decode.prefill`); it is copied,
    not kept.  ``capacity`` must cover every token a sequence will hold (its prompt included).
    """

    def __init__(self, model, state, capacity: int):
        if not hasattr(state, "layers") or not hasattr(state, "offset"):
            raise TypeError(f"StaticDecoder needs a lintime ModelState, got {type(state).__name__}")
        self.model, self.capacity = model, int(capacity)
        self.state = static_state(state, self.capacity)
        # a host bound of every offset the steps will see (positions < capacity): the learned
        # position table then needs no device read, and the bound never changes per token
        self.state.max_offset = self.capacity - 1
        mark_state_checked(self.state)

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor of the state (the decoder's own storage)."""
        return state_tensors(self.state)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Feed ``token [B]`` (int64); return the logits ``[B, V]``; the state advances in place."""
        logits, new = decode_one_token(self.model, token, self.state)
        copy_state_(self.state, new, "decoding state")
        mark_state_checked(self.state)
        return logits

    def reorder_(self, index: torch.Tensor) -> None:
        """Rows ``index`` (``[B]``, may repeat: beams) into the same buffers."""
        if index.numel() != self.batch_size:
            raise ValueError(f"reorder_ keeps the batch of {self.batch_size} rows, got {index.numel()} indices; "
                             f"use select() to change the batch size")
        copy_state_(self.state, select_state(self.state, index.to(self.state.offset.device)))
        mark_state_checked(self.state)

    def select(self, index: torch.Tensor) -> StaticDecoder:
        """A new decoder (its own buffers) holding rows ``index`` of this one, e.g. the sequences
        still running."""
        new = object.__new__(StaticDecoder)
        new.model, new.capacity = self.model, self.capacity
        new.state = select_state(self.state, index.to(self.state.offset.device))
        new.state = dataclasses.replace(new.state, max_offset=self.capacity - 1)
        mark_state_checked(new.state)
        return new

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the buffers, for :meth:`restore`."""
        return [t.clone() for t in self.buffers()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.buffers(), saved, strict=True):
            t.copy_(s)
        mark_state_checked(self.state)


__all__ = ["StaticDecoder", "mark_state_checked", "state_tensors"]
