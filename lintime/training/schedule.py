"""Learning-rate schedules: linear warm-up, then linear / cosine decay or constant.

The schedule is a pure function of the position in the horizon, so it needs no state of its own
in a checkpoint (the step is enough) and a resumed run gets exactly the rates of an
uninterrupted one.

Notation: ``s`` the 0-based index of the update being taken, ``N`` the horizon in updates,
``W = round(warmup * N)`` warm-up updates, ``r`` = ``final_lr_ratio``::

    s <  W:  lr(s) = peak * (s + 1) / W                       (FLASH seed Tables 6-7, VQ App. C: linear warm-up)
    s >= W:  q = (s - W) / (N - W), clipped to [0, 1]
             linear:   lr = peak * (1 - (1 - r) * q)          (FLASH seed: linear decay, r = 0)
             cosine:   lr = peak * (r + (1 - r) * (1 + cos(pi q)) / 2)
                                                               (VQ seed: "decayed by a 10x factor
                                                                using a cosine schedule", r = 0.1;
                                                                GLA seed: cosine)
             constant: lr = peak

``(s + 1) / W`` makes the first update use ``peak / W`` rather than 0 (a step at rate 0 would be
wasted).  A time budget has no step count: :func:`lr_at_progress` evaluates the same curve at a
fraction of the horizon.
"""

from __future__ import annotations

import math

TIME_RESOLUTION = 1_000_000  # the clock-driven schedule evaluates the step curve on this many "steps"


def lr_at_step(step: int, total_steps: int, *, peak: float, warmup: float, decay: str, final_lr_ratio: float) -> float:
    """Learning rate of update ``step`` (0-based) of ``total_steps`` (see the module docstring)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if decay not in ("linear", "cosine", "constant"):
        raise ValueError(f"unknown decay {decay!r}")
    w = round(warmup * total_steps)
    if step < w:
        return peak * (step + 1) / w
    if decay == "constant":
        return peak
    q = min(max((step - w) / max(1, total_steps - w), 0.0), 1.0)
    if decay == "linear":
        return peak * (1.0 - (1.0 - final_lr_ratio) * q)
    return peak * (final_lr_ratio + (1.0 - final_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * q)))


def lr_at_progress(progress: float, *, peak: float, warmup: float, decay: str, final_lr_ratio: float) -> float:
    """The same curve at ``progress`` in ``[0, 1]`` of the horizon (time budgets)."""
    step = min(int(progress * TIME_RESOLUTION), TIME_RESOLUTION - 1)
    return lr_at_step(max(step, 0), TIME_RESOLUTION, peak=peak, warmup=warmup, decay=decay, final_lr_ratio=final_lr_ratio)
