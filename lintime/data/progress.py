"""A progress bar: ``tqdm`` when it is installed, else a plain one on stderr; silent when quiet."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class _Plain:
    """Minimal stand-in for tqdm: ``desc  42% 13.1/31.2 MB  2.3 s`` rewritten at most 4 times a second."""

    def __init__(self, total: int | None, desc: str, stream: TextIO):
        self.total, self.desc, self.stream = total, desc, stream
        self.n = 0
        self.t0 = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= 0.25:
            self._last = now
            self._draw("\r")

    def _draw(self, end: str) -> None:
        done = f"{self.n / 1e6:.1f}"
        if self.total:
            line = f"{self.desc} {100 * self.n / self.total:3.0f}% {done}/{self.total / 1e6:.1f} MB"
        else:
            line = f"{self.desc} {done} MB"
        self.stream.write(f"\r{line} {time.monotonic() - self.t0:.1f} s{end}")
        self.stream.flush()

    def close(self) -> None:
        self._draw("\n")


class _Silent:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class Progress:
    """``with Progress(total_bytes, "train") as bar: bar.update(n)``."""

    def __init__(self, total: int | None, desc: str, *, quiet: bool = False, stream: TextIO | None = None):
        stream = sys.stderr if stream is None else stream
        if quiet:
            self._bar = _Silent()
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._bar = _Plain(total, desc, stream)
        else:
            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=stream, leave=True)

    def update(self, n: int) -> None:
        self._bar.update(n)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
