"""Checks shared by the tests of the linear-side families (``test_linear_model.py``,
``test_gla_model.py``, ``test_performer.py``, ``test_combiner.py``): parallel == prefill +
decoding, packing, beam select, JSON round trip, overfitting a batch, parameter counts.

(The linear / GLA test files are not called ``test_linear.py`` / ``test_gla.py``: those basenames
are taken by ``tests/ops/`` and pytest's default import mode refuses two test modules with one
basename.)"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from lintime.models import CausalLM, MaskedLM, ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from tolerances import assert_exact

_MODELS: dict = {}


def model(name: str, dtype=torch.float64, cls=CausalLM, **overrides):
    key = (name, dtype, cls, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        torch.manual_seed(1)
        _MODELS[key] = cls(get_preset(name, **overrides)).to(dtype).eval()
    return _MODELS[key]


def decode_in_pieces(m, ids, splits):
    """Logits of ``ids`` fed as pieces ending at ``splits``, then one token at a time."""
    outs, state, start = [], None, 0
    for end in [*splits, *range(splits[-1] + 1, ids.shape[1] + 1)]:
        logits, state = m(ids[:, start:end], state, return_state=True)
        outs.append(logits)
        start = end
    return torch.cat(outs, 1), state


def check_prefill_plus_decoding(name, dtype, T=37, splits=([1], [16], [5, 20, 33])):
    m = model(name, dtype)
    ids = torch.randint(0, 256, (3, T))
    with torch.no_grad():
        full = m(ids)
        for sp in splits:
            pieces, state = decode_in_pieces(m, ids, sp)
            assert_exact(f"{name} {dtype} prefill {sp}", full, pieces)
            assert state.offset.tolist() == [T] * 3


def packed(lengths, vocab=BYTE_VOCAB):
    """Random sequences of ``lengths``, their packed concatenation ``[1, sum]`` and ``cu_seqlens``."""
    seqs = [torch.randint(0, vocab, (1, n)) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, torch.cat(seqs, 1), cu


def check_packed_equals_separate(name, cls=CausalLM):
    m = model(name, cls=cls)
    seqs, ids, cu = packed([7, 1, 0, 19, 12])
    with torch.no_grad():
        ref = torch.cat([m(s) for s in seqs if s.shape[1]], 1)
        out = m(ids, cu_seqlens=cu)
    assert_exact(f"{name} {cls.__name__} packed", ref, out)


def check_packed_prefill_then_decoding(name):
    """A packed prefill returns one state row per sequence; decoding continues each one, and a
    packed chunk with a state continues each sequence."""
    m = model(name)
    lengths = [5, 12, 1, 9]
    seqs, ids, cu = packed(lengths)
    more = torch.randint(0, 256, (4, 3))
    with torch.no_grad():
        logits, state = m(ids, cu_seqlens=cu, return_state=True)
        assert_exact("packed prefill logits", m(ids, cu_seqlens=cu), logits)
        assert state.offset.tolist() == lengths
        steps = []
        for t in range(3):
            lg, state = m(more[:, t : t + 1], state, return_state=True)
            steps.append(lg)
        ref = torch.stack([m(torch.cat([s, more[i : i + 1]], 1))[0, -3:] for i, s in enumerate(seqs)])
        assert_exact(f"{name} decode after packed prefill", ref, torch.cat(steps, 1))

        a, b = torch.randint(0, 256, (1, 10)), torch.randint(0, 256, (1, 6))
        _, st = m(torch.cat([a[:, :4], b[:, :2]], 1), cu_seqlens=torch.tensor([0, 4, 6]), return_state=True)
        lg, st = m(torch.cat([a[:, 4:], b[:, 2:]], 1), st, return_state=True, cu_seqlens=torch.tensor([0, 6, 10]))
        assert_exact(f"{name} packed continuation", torch.cat([m(a)[:, 4:], m(b)[:, 2:]], 1), lg)
        assert st.offset.tolist() == [10, 6]


def check_packed_decode_and_select(m, label, steps, vocab=BYTE_VOCAB):
    """Packed prefill of four sequences, then ``steps`` tokens decoded for each (choose ``steps``
    so every sequence crosses a chunk / block boundary), then beams: state rows reordered and
    repeated with ``select``, and a packed piece continues each of them."""
    lengths = [5, 12, 1, 9]
    seqs, ids, cu = packed(lengths, vocab)
    more = torch.randint(0, vocab, (4, steps))
    with torch.no_grad():
        logits, state = m(ids, cu_seqlens=cu, return_state=True)
        assert_exact(f"{label} packed prefill", m(ids, cu_seqlens=cu), logits)
        assert state.offset.tolist() == lengths
        outs, st = [], state
        for t in range(steps):
            lg, st = m(more[:, t : t + 1], st, return_state=True)
            outs.append(lg)
        ref = torch.stack([m(torch.cat([s, more[i : i + 1]], 1))[0, -steps:] for i, s in enumerate(seqs)])
        assert_exact(f"{label} decode after packed prefill", ref, torch.cat(outs, 1))
        index = torch.tensor([3, 1, 1])
        pieces = [more[0, : steps - 2], more[1, :1], more[2, :4]]
        cu_pieces = torch.tensor([0, *torch.tensor([len(p) for p in pieces]).cumsum(0).tolist()])
        lg, st2 = m(torch.cat(pieces)[None], state.select(index), return_state=True, cu_seqlens=cu_pieces)
        ref = torch.cat([m(torch.cat([seqs[i][0], p])[None])[:, -len(p):] for i, p in zip(index.tolist(), pieces)], 1)
        assert_exact(f"{label} packed continuation after select", ref, lg)
        assert st2.offset.tolist() == [lengths[i] + len(p) for i, p in zip(index.tolist(), pieces)]


def check_select(name):
    """``state.select`` reorders / repeats rows (beam search); the old state stays valid."""
    m = model(name)
    ids = torch.randint(0, 256, (3, 9))
    nxt = torch.randint(0, 256, (4, 2))
    index = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        _, state = m(ids, return_state=True)
        out, _ = m(nxt, state.select(index), return_state=True)
        ref = m(torch.cat([ids[index], nxt], 1))[:, -2:]
        out0, _ = m(nxt[:3], state, return_state=True)
        ref0 = m(torch.cat([ids, nxt[:3]], 1))[:, -2:]
    assert_exact(f"{name} beam select", ref, out)
    assert_exact(f"{name} original state after select", ref0, out0)


def state_numel(state) -> int:
    """Numbers held by a model state's layers (tensors at any depth)."""
    total = 0

    def count(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel()
        elif isinstance(x, (list, tuple)):
            for y in x:
                count(y)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                count(getattr(x, f))

    count(state.layers)
    return total


def check_json_round_trip(name, family):
    cfg = get_preset(name)
    d = json.loads(cfg.to_json())
    assert d["family"] == family and isinstance(d["mixer"], dict)  # names, not classes
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def overfit(name, cls=CausalLM, steps=40, lr=5e-3):
    """40 AdamW steps on one small batch (2 x 16 predictions): the loss must fall below 10 % of
    its start (the bar of the softmax family's ``test_training.py``, on a smaller batch to keep
    the CPU suite fast)."""
    torch.manual_seed(0)
    m = cls(get_preset(name))
    opt = torch.optim.AdamW(m.param_groups(0.01), lr=lr)
    ids = torch.randint(0, 256, (2, 17))
    losses = []
    for _ in range(steps):
        logits = m(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0  # ~ln(256) at init
    assert losses[-1] < 0.1 * losses[0], f"{name}: {losses[::10]}"


def meta_params_m(name) -> float:
    """Parameters (millions) of a preset, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        m = CausalLM(get_preset(name))
    return m.num_parameters() / 1e6


def assert_within_5pct(name, want_m):
    got = meta_params_m(name)
    assert abs(got - want_m) <= 0.05 * want_m, f"{name}: {got:.2f}M vs seed {want_m}M"


__all__ = [
    "model", "decode_in_pieces", "packed", "check_prefill_plus_decoding", "check_packed_equals_separate",
    "check_packed_prefill_then_decoding", "check_packed_decode_and_select", "check_select", "state_numel", "check_json_round_trip", "overfit",
    "meta_params_m", "assert_within_5pct", "MaskedLM", "CausalLM",
]
