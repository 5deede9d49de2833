"""What keeps a run folder usable: one writer at a time (:class:`RunLock`), and a checkpoint when
the run is stopped by SIGINT / SIGTERM (:class:`StopSignals`)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

LOCK_FILE = ".lock"


class RunLockedError(ValueError):
    """Another process holds the run folder's lock."""


class RunLock:
    """An exclusive ``flock`` on ``<run_dir>/.lock`` (holding the owner's pid), released when the
    process ends in any way, ``kill -9`` included: a second ``lintime train`` of the same folder
    fails at once with :class:`RunLockedError` instead of writing beside the first."""

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunLockedError(f"run folder {self.path.parent} is in use by another lintime train (pid {owner}; "
                                 f"lock file {self.path})") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class StopSignals:
    """While active, SIGINT and SIGTERM only set :attr:`received` (the signal's name); the training
    loop checks it between steps, saves a checkpoint and stops.  A second signal of either kind
    interrupts at once (``KeyboardInterrupt``).  Outside the main thread it does nothing."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
