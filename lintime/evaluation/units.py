"""Per-token against per-byte figures, and a mean with its spread over seeds.

A tokenizer with ``b`` bytes per token on a text turns a loss of ``L`` nats per token into
``L / b`` nats per byte, so perplexity per byte is perplexity per token to the power ``1 / b``
and a *relative* perplexity change shrinks accordingly::

    (1 + r_byte) = (1 + r_token) ** (1 / b)        r_byte ~ r_token / b for small r

(a relative change of the *loss* itself, nats or bits, is the same per token and per byte).  A
paper's perplexity gap measured per token (e.g. the FLASH seed's Table 5, SentencePiece on
Wiki-40B) must be converted before it is compared with a per-byte gap measured here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Bytes per token assumed for the seeds' subword tokenizers (SentencePiece / T5 vocabularies on
# English web and Wikipedia text): ~4 UTF-8 bytes per token, the usual figure for 32k vocabularies
# on English.  An estimate, stated wherever a converted number is shown.
SEED_BYTES_PER_TOKEN = 4.0


def per_byte_change(per_token_change: float, bytes_per_token: float = SEED_BYTES_PER_TOKEN) -> float:
    """Relative perplexity change per byte (a fraction: 0.01 = 1 %) from the per-token one."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    if per_token_change <= -1:
        raise ValueError(f"a relative perplexity change is > -1 (-100 %), got {per_token_change}")
    return (1 + per_token_change) ** (1 / bytes_per_token) - 1


def per_token_change(per_byte_change_: float, bytes_per_token: float = SEED_BYTES_PER_TOKEN) -> float:
    """The inverse of :func:`per_byte_change`."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    if per_byte_change_ <= -1:
        raise ValueError(f"a relative perplexity change is > -1 (-100 %), got {per_byte_change_}")
    return (1 + per_byte_change_) ** bytes_per_token - 1


def bits_per_byte(loss_per_token: float, bytes_per_token: float) -> float:
    """Bits per byte from a loss in nats per token."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    return loss_per_token / math.log(2) / bytes_per_token


def mean_spread(values: Sequence[float]) -> tuple[float, float, int]:
    """``(mean, spread, n)`` of the finite values: the spread is the sample standard deviation
    (``n - 1``), 0 for one value (no spread measured: say so), NaN for none."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return math.nan, math.nan, 0
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, 0.0, 1
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)), len(xs)


def format_mean_spread(values: Sequence[float], spec: str = ".4f") -> str:
    """``"2.7110 ± 0.0123 (3 seeds)"``; one value: ``"2.7110 (1 seed)"``; none: ``"-"``."""
    m, s, n = mean_spread(values)
    if n == 0:
        return "-"
    if n == 1:
        return f"{m:{spec}} (1 seed)"
    return f"{m:{spec}} ± {s:{spec}} ({n} seeds)"


def differs(a: Sequence[float], b: Sequence[float]) -> bool | None:
    """Whether two sets of seeds' values differ by more than their spread: ``|mean_a - mean_b| >
    spread_a + spread_b``.  ``None`` (no verdict) unless both have at least two values."""
    ma, sa, na = mean_spread(a)
    mb, sb, nb = mean_spread(b)
    if na < 2 or nb < 2:
        return None
    return abs(ma - mb) > sa + sb
