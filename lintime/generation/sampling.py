"""Turning next-token logits into a token: temperature, top-k, nucleus (top-p), seeded draws.

Notation: ``B`` rows (sequences being decoded), ``V`` vocabulary.

Order (the usual one, e.g. HF ``generate``): divide by the temperature, keep the top ``k``
logits, then keep the nucleus of the resulting distribution, renormalise, draw.  ``temperature
== 0`` is greedy (argmax; the filters cannot change the argmax, so they are skipped).

Every row draws from its own random stream: a sample's tokens depend only on its own seed and its
own logits, never on how many other rows share the batch or when they stop.  :func:`sample` takes
one ``torch.Generator`` per row; :func:`sample_seeded` (what generation uses) derives the uniform
number of row ``b`` at step ``t`` from ``(seeds[b], t)`` with an integer hash on the device -- no
generator objects, no host work, the same bits on every device, so a CUDA graph can replay it.
Where the seeds and steps are host numbers anyway (the serving engine's rows),
:func:`seeded_uniform_host` computes the same bits with numpy in a few microseconds, instead of the
hash's ~80 elementwise kernels on the device, and :func:`sample_uniform` draws with them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def _checked_greedy(logits: torch.Tensor, temperature: float) -> torch.Tensor | None:
    """Validate ``logits [B, V]`` and ``temperature``; the argmax tokens when ``temperature == 0``, else ``None``."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return logits.argmax(dim=-1) if temperature == 0 else None


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits [..., V]`` with everything below the ``k``-th largest value set to ``-inf``.

    ``k <= 0`` or ``k >= V`` keeps all.  Ties with the ``k``-th value are kept (so more than
    ``k`` tokens may survive when values tie), as in gpt-fast / HF.
    """
    V = logits.shape[-1]
    if k <= 0 or k >= V:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits [..., V]`` restricted to the nucleus: the most likely tokens whose probability
    sums to at least ``p`` (Holtzman et al. 2020); the rest become ``-inf``.

    A token (in decreasing order of probability) is kept when the mass of the tokens before it
    is still below ``p``, so the most likely token is always kept and the nucleus is the
    smallest prefix reaching ``p``.  ``p >= 1`` keeps all.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [..., V] exclusive prefix sum
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filtered_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution actually sampled from: ``softmax(top_p(top_k(logits / temperature)))``
    in fp32, ``[..., V]``.  ``temperature`` must be > 0 (0 means greedy: use :func:`sample`)."""
    if temperature <= 0:
        raise ValueError(f"filtered_probs needs temperature > 0, got {temperature}")
    logits = logits.float() / temperature
    logits = top_k_filter(logits, top_k)
    logits = top_p_filter(logits, top_p)
    return torch.softmax(logits, dim=-1)


def sample(
    logits: torch.Tensor,
    generators: list[torch.Generator] | None = None,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Next tokens ``[B]`` (int64) from ``logits [B, V]``.

    ``temperature == 0``: argmax (no randomness).  Otherwise row ``b`` draws one token from
    :func:`filtered_probs` with ``generators[b]`` (``None``: the global RNG).  The draw is an
    inverse-CDF lookup of one uniform number per row, so a row consumes exactly one number of
    its generator per token.
    """
    greedy = _checked_greedy(logits, temperature)
    if greedy is not None:
        return greedy
    B = logits.shape[0]
    if generators is not None and len(generators) != B:
        raise ValueError(f"{len(generators)} generators for {B} rows")
    probs = filtered_probs(logits, temperature, top_k, top_p)  # [B, V] fp32
    if generators is None:
        u = torch.rand(B, 1, device=probs.device)
    else:
        u = torch.stack([torch.rand(1, generator=g, device=g.device) for g in generators]).to(probs.device)
    return _inverse_cdf(probs, u)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ``[B]`` of each row of ``probs [B, V]`` for its uniform number ``u [B, 1]``."""
    cdf = torch.cumsum(probs.double(), dim=-1)  # fp64: the last entry is 1 up to ~1e-16
    cdf = cdf / cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u.double(), right=True).squeeze(-1)  # first index with cdf > u
    # a zero-probability token can never be picked: searchsorted lands on the next entry whose
    # cdf grew, i.e. a token with positive mass; clamp only guards u == 1 rounding.
    return tokens.clamp_(max=probs.shape[-1] - 1)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for ``x`` in ``[0, 2**32)`` held in int64, without int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (the "lowbias32" constants of Chris Wellons' hash prospector)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_host(x: np.ndarray) -> np.ndarray:
    """:func:`_mix32` of ``x`` (uint64 in ``[0, 2**32)``); uint64 products wrap mod ``2**64``, so their low
    32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def seeded_uniform_host(seeds: Sequence[int], steps: Sequence[int]) -> np.ndarray:
    """:func:`seeded_uniform` on the host: ``[B]`` float64, the same bits, for 64-bit integer ``seeds`` and
    ``steps`` (row ``b`` at step ``steps[b]``)."""
    s = np.asarray(seeds, dtype=np.int64).view(np.uint64) & _M32  # the low 32 bits, as the device's ``& _M32``
    t = np.asarray(steps, dtype=np.int64).view(np.uint64) & _M32
    h = _mix32_host(_mix32_host(s) ^ t)
    hi = _mix32_host(h ^ 0x68E31DA4)
    lo = _mix32_host(h ^ 0xB5297A4D) >> 11
    return ((hi << 21) + lo).astype(np.float64) * 2.0**-53


def seeded_uniform(seeds: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``[B]`` float64 uniform numbers in ``[0, 1)`` (53 bits), a hash of ``(seeds[b], step)``:
    ``seeds [B]`` int64 (their low 32 bits are used), ``step`` an int64 scalar tensor."""
    h = _mix32(_mix32(seeds & _M32) ^ (step & _M32))
    hi = _mix32(h ^ 0x68E31DA4)
    lo = _mix32(h ^ 0xB5297A4D) >> 11
    return ((hi << 21) + lo).double() * 2.0**-53


def sample_seeded(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    step: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Next tokens ``[B]`` (int64) from ``logits [B, V]``, as :func:`sample` but row ``b`` draws
    :func:`seeded_uniform` of ``(seeds[b], step)``: all on the device, no host read."""
    greedy = _checked_greedy(logits, temperature)
    if greedy is not None:
        return greedy
    return sample_uniform(logits, seeded_uniform(seeds, step), temperature=temperature, top_k=top_k, top_p=top_p)


def sample_uniform(
    logits: torch.Tensor,
    u: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Next tokens ``[B]`` (int64) from ``logits [B, V]``, row ``b`` drawn with the uniform number ``u[b]``
    (``[B]`` float64 in ``[0, 1)``): :func:`sample_seeded` is this with ``u = seeded_uniform(seeds, step)``."""
    greedy = _checked_greedy(logits, temperature)
    if greedy is not None:
        return greedy
    if u.shape != logits.shape[:1]:
        raise ValueError(f"u must be [B] = [{logits.shape[0]}], got shape {tuple(u.shape)}")
    probs = filtered_probs(logits, temperature, top_k, top_p)  # [B, V] fp32
    return _inverse_cdf(probs, u[:, None])
