"""Type checks of user-given values (configs, requests), shared so every message means the same thing by "an
integer": a bool is not one (``True`` is not a layer count), though Python's ``int`` would accept it."""

from __future__ import annotations

import math
import numbers
from typing import Any


def is_int(x: Any) -> bool:
    """An integer (Python or NumPy) that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x: Any, *, finite: bool = False) -> bool:
    """A real number (an integer or a float) that is not a bool; ``finite``: and neither infinite nor NaN."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and (not finite or math.isfinite(x))
