"""lintime.evaluation.units: per-token <-> per-byte perplexity changes, mean ± spread."""

from __future__ import annotations

import math

import pytest

from lintime.evaluation.units import (
    bits_per_byte,
    differs,
    format_mean_spread,
    mean_spread,
    per_byte_change,
    per_token_change,
)


def test_the_seed_gaps_per_byte():
    """The FLASH seed's Table 5 gaps (-0.3 / +0.35 / +1.4 % per token, ~4 bytes per token) are
    about -0.08 / +0.09 / +0.35 % per byte; its ~1.5 % bound is ~0.37 % per byte."""
    got = [100 * per_byte_change(r / 100, 4.0) for r in (-0.3, 0.35, 1.4, 1.5)]
    assert got == pytest.approx([-0.0751, 0.0874, 0.3482, 0.3729], abs=1e-3)
    for r in (-0.5, 0.0, 0.2, 3.0):
        assert per_token_change(per_byte_change(r, 3.7), 3.7) == pytest.approx(r, abs=1e-12)
    # the definition: perplexity per byte = perplexity per token ** (1 / bytes per token)
    L, b = 3.1, 4.2
    assert per_byte_change(math.exp(L * 1.05) / math.exp(L) - 1, b) == pytest.approx(math.exp(L * 1.05 / b - L / b) - 1)
    assert bits_per_byte(2 * math.log(2), 4.0) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        per_byte_change(0.1, 0.0)


def test_mean_spread_and_verdict():
    assert mean_spread([1.0, 2.0, 3.0]) == (2.0, 1.0, 3)
    assert mean_spread([2.5]) == (2.5, 0.0, 1)
    assert math.isnan(mean_spread([])[0]) and mean_spread([None, float("nan")])[2] == 0
    assert format_mean_spread([1.0, 2.0, 3.0], ".2f") == "2.00 ± 1.00 (3 seeds)"
    assert format_mean_spread([2.5], ".1f") == "2.5 (1 seed)" and format_mean_spread([]) == "-"
    assert differs([1.0, 1.1, 1.2], [2.0, 2.1, 2.2]) is True
    assert differs([1.0, 1.5, 2.0], [1.4, 1.6, 1.8]) is False
    assert differs([1.0], [2.0, 2.1]) is None  # one seed: no verdict
