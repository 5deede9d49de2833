"""Helpers for the generation and evaluation tests: tiny models (byte vocabulary) and a
scripted fake LM whose next token is fixed by its position."""

from __future__ import annotations

import dataclasses

import torch
from tiny_presets import FAMILY_TINY_PRESETS as FAMILY_PRESETS, SMALL_CHUNKS  # noqa: F401  (re-exported)
from torch import nn

from lintime.data import ByteTokenizer
from lintime.models import CausalLM, ModelState, get_preset


def tiny_model(preset: str, seed: int = 0, **mixer_changes) -> CausalLM:
    """``preset`` with the byte vocabulary, seeded init, eval mode; ``mixer_changes`` edit the
    family sub-config (e.g. a small FLASH chunk so a short test crosses chunk boundaries)."""
    cfg = get_preset(preset, vocab_size=ByteTokenizer.vocab_size)
    if mixer_changes:
        cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, **mixer_changes))
    torch.manual_seed(seed)
    return CausalLM(cfg).eval()


class ScriptedLM(nn.Module):
    """A fake causal LM: the logits at absolute position ``t`` of a sequence put ``peak`` on
    ``script[t + 1]`` (0 elsewhere), so greedy decoding after a prompt of ``P`` tokens emits
    ``script[P], script[P + 1], ...``.  Records the batch size of every call."""

    causal = True

    def __init__(self, script: list[int], vocab_size: int = 260, peak: float = 30.0):
        super().__init__()
        self.script = torch.tensor(script)
        self.vocab_size, self.peak = vocab_size, peak
        self.dummy = nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[int, int]] = []  # (rows, tokens per row)

    def init_state(self, batch_size, device=None, dtype=None):
        return ModelState([], torch.zeros(batch_size, dtype=torch.long))

    def forward(self, input_ids, state=None, return_state=False, cu_seqlens=None):
        B, T = input_ids.shape
        self.calls.append((B if cu_seqlens is None else cu_seqlens.numel() - 1, T))
        if state is None:
            state = self.init_state(B if cu_seqlens is None else cu_seqlens.numel() - 1)
        if cu_seqlens is None:
            pos = state.offset[:, None] + torch.arange(T)  # [B, T]
            consumed = torch.full((B,), T)
        else:
            cu = cu_seqlens.long()
            seq = torch.searchsorted(cu[1:], torch.arange(T), right=True)
            pos = (torch.arange(T) - cu[seq] + state.offset[seq])[None]
            consumed = cu.diff()
        nxt = self.script[(pos + 1).clamp(max=len(self.script) - 1)]
        logits = torch.zeros(*pos.shape, self.vocab_size)
        logits.scatter_(-1, nxt[..., None], self.peak)
        new = ModelState([], state.offset + consumed)
        return (logits, new) if return_state else logits


def scripted(text: str, prompt: str = "", tail_eos: bool = True) -> ScriptedLM:
    """A :class:`ScriptedLM` that continues ``bos + prompt`` with ``text`` (then ``eos``)."""
    tok = ByteTokenizer()
    ids = [tok.bos_id] + list(prompt.encode()) + list(text.encode()) + ([tok.eos_id] if tail_eos else [])
    return ScriptedLM(ids)
