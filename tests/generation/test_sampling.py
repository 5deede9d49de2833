"""Temperature, top-k and nucleus filters on hand-built distributions; seeded, reproducible draws."""

from __future__ import annotations

import math

import pytest
import torch
from gen_helpers import tiny_model

from lintime.data import ByteTokenizer
from lintime.generation import (
    GenerationConfig,
    filtered_probs,
    generate,
    sample,
    top_k_filter,
    top_p_filter,
)

NEG = float("-inf")


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[1.0, 3.0, 2.0, 5.0, 4.0], [0.0, -1.0, 7.0, 7.0, 1.0]])
    out = top_k_filter(logits, 2)
    assert out.tolist() == [[NEG, NEG, NEG, 5.0, 4.0], [NEG, NEG, 7.0, 7.0, NEG]]
    # ties with the k-th value are kept
    assert top_k_filter(torch.tensor([3.0, 1.0, 3.0, 3.0]), 2).tolist() == [3.0, NEG, 3.0, 3.0]
    # k = 0 and k >= V keep everything
    assert torch.equal(top_k_filter(logits, 0), logits) and torch.equal(top_k_filter(logits, 5), logits)


@pytest.mark.parametrize(
    "p,kept",
    [
        (0.4, {0}),  # the most likely token alone already reaches p
        (0.49, {0}),
        (0.51, {0, 1}),  # the mass before token 1 (0.5) is below p
        (0.79, {0, 1}),  # 0.5 + 0.3 reaches p
        (0.81, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    perm = torch.tensor([2, 0, 3, 1])  # shuffled vocabulary order: the filter must sort
    logits = probs.log()[perm]
    out = top_p_filter(logits, p)
    kept_ids = {int(perm[i]) for i in range(4) if out[i] != NEG}
    assert kept_ids == kept
    assert torch.equal(out[out != NEG], logits[out != NEG])  # survivors untouched


def test_top_p_rejects_bad_p():
    with pytest.raises(ValueError):
        top_p_filter(torch.zeros(3), 0.0)
    with pytest.raises(ValueError):
        top_p_filter(torch.zeros(3), 1.5)


def test_filtered_probs_order_temperature_then_top_k_then_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    # T = 0.5: logits become [4, 2, 0, -2]; top-k 3 drops the last; top-p 0.9 of the remaining
    # renormalised distribution softmax([4, 2, 0]) = [0.867, 0.117, 0.016] keeps the first two
    probs = filtered_probs(logits, temperature=0.5, top_k=3, top_p=0.9)
    e = [math.exp(4), math.exp(2)]
    expected = torch.tensor([[e[0] / sum(e), e[1] / sum(e), 0.0, 0.0]])
    torch.testing.assert_close(probs, expected)


def test_sample_frequencies_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    B = 20000
    torch.manual_seed(3)
    draws = sample(logits.expand(B, 4), temperature=1.0, top_p=0.8)
    freq = torch.bincount(draws, minlength=4).double() / B
    assert freq[2] == 0 and freq[3] == 0  # outside the nucleus: never drawn
    torch.testing.assert_close(freq[:2], torch.tensor([0.625, 0.375], dtype=torch.float64), atol=0.015, rtol=0)
    # temperature -> 0 is argmax
    assert sample(torch.tensor([[0.1, 0.9, 0.3]]), temperature=0).tolist() == [1]


def test_sample_is_reproducible_per_generator():
    logits = torch.randn(3, 50)

    def draw(seeds):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return [sample(logits, gens, temperature=1.0).tolist() for _ in range(5)]

    assert draw([1, 2, 3]) == draw([1, 2, 3])
    assert draw([1, 2, 3]) != draw([4, 5, 6])


def test_seeded_generation_is_reproducible_and_rows_are_independent():
    model, tok = tiny_model("gla-tiny"), ByteTokenizer()
    cfg = GenerationConfig(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95, num_samples=3, seed=7,
                           stop_at_eos=False)
    a = generate(model, tok, "ab", cfg)
    b = generate(model, tok, "ab", cfg)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert len({tuple(s.token_ids) for s in a}) == 3  # three different samples
    c = generate(model, tok, "ab", GenerationConfig(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95,
                                                    num_samples=3, seed=8, stop_at_eos=False))
    assert [s.token_ids for s in a] != [s.token_ids for s in c]
    # sample j draws from seed + j: sample 1 of seed 7 is sample 0 of seed 8, whatever the batch
    assert a[1].token_ids == c[0].token_ids and a[2].token_ids == c[1].token_ids
    alone = generate(model, tok, "ab", GenerationConfig(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.95,
                                                        seed=7, stop_at_eos=False))
    assert alone[0].token_ids == a[0].token_ids


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
        ({"num_samples": 0}, "num_samples"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"prefill_chunk": -2}, "prefill_chunk"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_generation_config_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**kwargs)
