"""lintime.evaluation.tasks.mqar: the Zoology layout, determinism by seed, and the accuracy
pipeline against an oracle that recalls every value and one that cannot."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn

from lintime.evaluation.tasks.mqar import IGNORE_INDEX, MQARConfig, evaluate_mqar, mqar_examples


def _check_layout(cfg: MQARConfig, x: torch.Tensor, y: torch.Tensor) -> None:
    n, T, half = cfg.kv_pairs, cfg.seq_len, cfg.vocab_size // 2
    assert x.shape == y.shape == (x.shape[0], T) and x.dtype == y.dtype == torch.int64
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys, values = row_x[0 : 2 * n : 2], row_x[1 : 2 * n : 2]
        assert len(set(keys)) == n and all(1 <= k < half for k in keys)
        assert len(set(values)) == n and all(half <= v < cfg.vocab_size for v in values)
        scored = [p for p, t in enumerate(row_y) if t != IGNORE_INDEX]
        assert len(scored) == cfg.queries
        for p in scored:
            assert p >= 2 * n and (p - 2 * n) % 2 == 0  # even offsets of the query section
            assert row_x[p] in keys and row_y[p] == values[keys.index(row_x[p])]  # the key's own value
        assert len({row_x[p] for p in scored}) == cfg.queries  # each key queried once
        if not cfg.random_fill:
            assert all(row_x[p] == 0 for p in range(2 * n, T) if p not in scored)


@pytest.mark.parametrize("cfg", [
    MQARConfig(vocab_size=12, seq_len=16, kv_pairs=2),
    MQARConfig(vocab_size=8192, seq_len=64, kv_pairs=4),
    MQARConfig(vocab_size=8192, seq_len=256, kv_pairs=64),  # the densest: 4 * pairs = seq_len
    MQARConfig(vocab_size=64, seq_len=40, kv_pairs=6, n_queries=3, random_fill=True),
])
def test_layout(cfg):
    x, y = mqar_examples(cfg, 300, seed=3)  # crosses a generator block
    _check_layout(cfg, x, y)


def test_deterministic_by_seed_split_and_offset():
    cfg = MQARConfig(vocab_size=64, seq_len=32, kv_pairs=4)
    x, y = mqar_examples(cfg, 600, seed=1)
    x2, y2 = mqar_examples(cfg, 600, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    xs, ys = mqar_examples(cfg, 100, seed=1, start=250)  # a window across a block boundary
    assert torch.equal(xs, x[250:350]) and torch.equal(ys, y[250:350])
    assert not torch.equal(mqar_examples(cfg, 50, seed=2)[0], x[:50])
    assert not torch.equal(mqar_examples(cfg, 50, seed=1, split="test")[0], x[:50])


def test_query_gaps_follow_the_power_law():
    """power_a 0.01 puts most queries right after the pairs; power_a 1 is uniform over the slots."""
    def first_gap_share(a: float) -> float:
        cfg = MQARConfig(vocab_size=512, seq_len=128, kv_pairs=2, n_queries=1, power_a=a)
        _, y = mqar_examples(cfg, 2000, seed=0)
        pos = (y != IGNORE_INDEX).int().argmax(1)
        return float(((pos - 4) // 2 == 0).float().mean())

    space = (128 - 4) // 2
    p = np.arange(1, space + 1, dtype=float) ** (0.01 - 1)
    assert first_gap_share(0.01) == pytest.approx(p[0] / p.sum(), abs=0.03)
    assert first_gap_share(1.0) == pytest.approx(1 / space, abs=0.015)


@pytest.mark.parametrize("bad", [dict(seq_len=15), dict(kv_pairs=20, seq_len=64), dict(vocab_size=8, kv_pairs=4, seq_len=32),
                                 dict(n_queries=5), dict(power_a=0.0)])
def test_invalid_settings_are_refused(bad):
    with pytest.raises(ValueError, match="mqar"):
        MQARConfig(**bad)


class _Recall(nn.Module):
    """A fake LM: at every position, the logits peak on the value that followed the current
    token's first earlier occurrence (``perfect``), or on the smallest value id (a model that
    cannot recall)."""

    def __init__(self, vocab: int, perfect: bool):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=vocab, position="none", max_positions=0)
        self.w = nn.Parameter(torch.zeros(()))
        self.perfect = perfect

    def forward(self, ids):
        B, T = ids.shape
        V = self.config.vocab_size
        out = torch.zeros(B, T, V)
        for b in range(B):
            for t in range(T):
                guess = V // 2
                if self.perfect:
                    earlier = (ids[b, : max(t - 1, 0)] == ids[b, t]).nonzero()
                    if len(earlier):
                        guess = int(ids[b, earlier[0, 0] + 1])
                out[b, t, guess] = 5.0
        return out


def test_accuracy_of_an_oracle_and_of_a_guesser():
    cfg = MQARConfig(vocab_size=64, seq_len=32, kv_pairs=4)
    good = evaluate_mqar(_Recall(64, True), cfg, n_examples=40, batch_size=16)
    assert good.accuracy == 1.0 and good.n_queries == 160
    bad = evaluate_mqar(_Recall(64, False), cfg, n_examples=40, batch_size=16)
    assert bad.accuracy < 0.2  # the fixed guess is right only when it is the queried value
    small = evaluate_mqar(_Recall(32, True), cfg, n_examples=4)
    assert small.skipped and "token ids" in small.skipped
