"""Checks shared by the model tests: every family's tiny model (``test_every_family.py``) and the
family files' own variants (mixer options, other presets) run the same parallel == prefill +
decoding, packing and overfitting checks.

(The family files are called ``test_<family>_model.py``: ``test_gau.py``, ``test_gla.py``, ... are
taken by ``tests/ops/`` and pytest's default import mode refuses two test modules with one
basename.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.models import CausalLM, MaskedLM, ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from tolerances import assert_exact

__all__ = [
    "CausalLM", "MaskedLM", "build", "model", "decode_in_pieces", "packed", "check_prefill_plus_decoding",
    "check_packed_equals_separate", "check_packed_prefill_then_decoding", "state_numel", "overfit",
    "meta_params_m",
]

_MODELS: dict = {}


def build(config: ModelConfig, dtype=torch.float64, cls=CausalLM):
    """``cls(config)`` seeded, in ``dtype``, eval mode; built once per process (the checks only read it)."""
    key = (config.to_json(), dtype, cls)
    if key not in _MODELS:
        torch.manual_seed(1)
        _MODELS[key] = cls(config).to(dtype).eval()
    return _MODELS[key]


def model(name: str, dtype=torch.float64, cls=CausalLM, **overrides):
    """The preset ``name`` (with ``overrides``) through :func:`build`."""
    return build(get_preset(name, **overrides), dtype, cls)


def decode_in_pieces(m, ids, splits):
    """Logits of ``ids`` fed as pieces ending at ``splits``, then one token at a time."""
    outs, state, start = [], None, 0
    for end in [*splits, *range(splits[-1] + 1, ids.shape[1] + 1)]:
        logits, state = m(ids[:, start:end], state, return_state=True)
        outs.append(logits)
        start = end
    return torch.cat(outs, 1), state


def check_prefill_plus_decoding(m, label, T=37, B=3, splits=([1], [16], [5, 20, 33])):
    """Full-sequence logits == prefill pieces ending at ``splits`` + token-by-token decoding, for each
    split; the state has consumed ``T`` tokens per row."""
    ids = torch.randint(0, m.config.vocab_size, (B, T))
    with torch.no_grad():
        full = m(ids)
        for sp in splits:
            pieces, state = decode_in_pieces(m, ids, sp)
            assert_exact(f"{label} prefill {sp}", full, pieces)
            assert state.offset.tolist() == [T] * B
    return state


def packed(lengths, vocab=BYTE_VOCAB):
    """Random sequences of ``lengths``, their packed concatenation ``[1, sum]`` and ``cu_seqlens``."""
    seqs = [torch.randint(0, vocab, (1, n)) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, torch.cat(seqs, 1), cu


def check_packed_equals_separate(m, label):
    """Packed documents (one empty, one of a single token) == each document alone."""
    seqs, ids, cu = packed([7, 1, 0, 19, 12], m.config.vocab_size)
    with torch.no_grad():
        ref = torch.cat([m(s) for s in seqs if s.shape[1]], 1)
        out = m(ids, cu_seqlens=cu)
    assert_exact(f"{label} packed", ref, out)


def check_packed_prefill_then_decoding(m, label, steps):
    """A packed prefill of four sequences returns one state row per sequence; ``steps`` tokens decoded
    for each continue each one (choose ``steps`` so every sequence crosses a chunk / block boundary).
    Then beams: the state's rows reordered and repeated with ``select`` continue as the selected
    sequences, one token at a time and as a packed piece, and the state selected from is unchanged."""
    vocab = m.config.vocab_size
    lengths = [5, 12, 1, 9]
    seqs, ids, cu = packed(lengths, vocab)
    more = torch.randint(0, vocab, (4, steps))
    with torch.no_grad():
        logits, state = m(ids, cu_seqlens=cu, return_state=True)
        assert_exact(f"{label} packed prefill", m(ids, cu_seqlens=cu), logits)
        assert state.offset.tolist() == lengths and state.batch_size == 4
        outs, st = [], state
        for t in range(steps):
            lg, st = m(more[:, t : t + 1], st, return_state=True)
            outs.append(lg)
        ref = torch.stack([m(torch.cat([s, more[i : i + 1]], 1))[0, -steps:] for i, s in enumerate(seqs)])
        assert_exact(f"{label} decode after packed prefill", ref, torch.cat(outs, 1))

        index = torch.tensor([3, 1, 1])
        beams = state.select(index)
        assert beams.batch_size == 3 and beams.offset.tolist() == [lengths[i] for i in index.tolist()]
        lg, _ = m(more[:3, :2], beams, return_state=True)
        ref = torch.cat([m(torch.cat([seqs[i], more[j : j + 1, :2]], 1))[:, -2:] for j, i in enumerate(index.tolist())])
        assert_exact(f"{label} beams after select", ref, lg)
        pieces = [more[0, : steps - 2], more[1, :1], more[2, :4]]
        cu_pieces = torch.tensor([0, *torch.tensor([len(p) for p in pieces]).cumsum(0).tolist()])
        lg, st2 = m(torch.cat(pieces)[None], beams, return_state=True, cu_seqlens=cu_pieces)
        ref = torch.cat([m(torch.cat([seqs[i][0], p])[None])[:, -len(p):] for i, p in zip(index.tolist(), pieces)], 1)
        assert_exact(f"{label} packed continuation after select", ref, lg)
        assert st2.offset.tolist() == [lengths[i] + len(p) for i, p in zip(index.tolist(), pieces)]
        # the state selected from still continues its own rows (states are values)
        lg, _ = m(more[:, :1], state, return_state=True)
        ref = torch.stack([m(torch.cat([s, more[i : i + 1, :1]], 1))[0, -1:] for i, s in enumerate(seqs)])
        assert_exact(f"{label} original state after select", ref, lg)


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


def overfit(config: ModelConfig, cls=CausalLM, steps=40, lr=5e-3, aux_weight=1e-4):
    """``steps`` AdamW steps on one small batch (2 x 16 predictions): the loss starts near
    ``ln(vocab)`` (an untrained model guesses) and falls below 10 % of its start.  Auxiliary losses
    (Transformer-VQ's commitment loss) are added at ``aux_weight``.  A masked LM predicts the
    quarter of the tokens it is given masked."""
    torch.manual_seed(0)
    m = cls(config).train()
    opt = torch.optim.AdamW(m.param_groups(0.01), lr=lr)
    V = config.vocab_size
    ids = torch.randint(0, min(V, 256), (2, 17))
    mask = torch.rand(2, 17) < 0.25
    mask[:, 0] = True  # at least one prediction per row
    losses = []
    for _ in range(steps):
        aux = {}
        if cls is CausalLM:
            logits = m(ids[:, :-1], aux_losses=aux)
            loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        else:
            logits = m(ids.masked_fill(mask, V - 1), aux_losses=aux)  # the last id: the byte tokenizer's <mask>
            loss = F.cross_entropy(logits[mask], ids[mask])
        opt.zero_grad()
        (loss + aux_weight * sum(aux.values())).backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(float(V)))) < 0.5 * losses[0], losses[0]
    assert losses[-1] < 0.1 * losses[0], losses[::10]


def meta_params_m(name) -> float:
    """Parameters (millions) of a preset, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        m = CausalLM(get_preset(name))
    return m.num_parameters() / 1e6
