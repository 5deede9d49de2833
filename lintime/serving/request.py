"""What a client hands the engine and gets back: :class:`Request`, :class:`Event`, :class:`Handle`.

A :class:`Handle` is the one object two threads share: the engine's loop thread publishes events into
it (:meth:`Handle._publish`), a consumer reads them from any thread -- blocking (:meth:`Handle.iter`,
:meth:`Handle.result`) or from an asyncio event loop (:meth:`Handle.events`).  Events are kept in an
append-only list and every reader has its own cursor, so several readers may follow one request
(a stream and, later, :meth:`Handle.result`).

The thread bridge: a blocking reader waits on the handle's condition variable; an asyncio reader
parks a future of its own running loop, and the loop thread resolves it with
``loop.call_soon_threadsafe`` after appending an event.  No reader polls.  The engine publishes one
decoding step's events together (:func:`publish`): each handle's lock is taken once, a condition is
notified only when a blocking reader sleeps on it, and each asyncio event loop with readers waiting is
woken once for all of them (one ``call_soon_threadsafe``, not one per request).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from lintime.utils.checks import is_int, is_number

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class QueueFull(RuntimeError):
    """:meth:`lintime.serving.Engine.submit` with ``max_queue`` requests already waiting or running."""


class EngineClosed(RuntimeError):
    """:meth:`lintime.serving.Engine.submit` (or ``start``) after ``shutdown``."""


@dataclass
class Request:
    """One completion request (checked by :meth:`lintime.serving.Engine.submit`, which raises
    ``ValueError`` naming the field).

    ``prompt``       text (encoded and preceded by the tokenizer's ``bos``, as ``lintime generate`` and
                     training wrap documents) or a list of token ids (taken as they are);
    ``max_tokens``   most tokens to draw (the ``eos`` that ends a completion counts), ``>= 1``;
    ``temperature``  0 = greedy (argmax);
    ``top_p``        nucleus mass in ``(0, 1]``; ``top_k``: keep the ``k`` most likely tokens (0 = all);
    ``stop``         stop strings: the completion ends at the first one, which is not emitted;
    ``seed``         the draws of a sampled request: its ``t``-th token uses a hash of ``(seed, t)``
                     (:func:`lintime.generation.sample_seeded`, what ``lintime generate --seed`` draws for
                     its first row), so its tokens do not depend on the other requests; ``None``: a
                     random seed;
    ``echo``         the first event's text starts with the prompt's text.
    """

    prompt: str | Sequence[int]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: Sequence[str] | str = ()
    seed: int | None = None
    echo: bool = False

    def checked(self, max_tokens_limit: int) -> tuple[str, ...]:
        """The stop strings as a tuple, once every field but the prompt is checked (``ValueError`` naming the
        field); ``max_tokens_limit``: the engine's largest ``max_tokens``."""
        if not is_int(self.max_tokens) or not 1 <= self.max_tokens <= max_tokens_limit:
            raise ValueError(f"max_tokens must be an integer in [1, {max_tokens_limit}], got {self.max_tokens!r}")
        if not is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = all tokens), got {self.top_k!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be None or a 64-bit integer, got {self.seed!r}")
        if not isinstance(self.echo, bool):
            raise ValueError(f"echo must be true or false, got {self.echo!r}")
        return tuple(stop)


@dataclass(frozen=True)
class Event:
    """A piece of a completion.

    ``text``               the text that became final since the previous event (may be ``""``: a token
                           that ends inside a character, or text held back while it may still become a
                           stop string);
    ``token_ids``          the tokens drawn since the previous event (an ``eos`` and the tokens of a
                           stop string included);
    ``finish_reason``      ``None`` while the request runs; on its last event ``"stop"`` (a stop string
                           or ``eos``), ``"length"`` (``max_tokens``), ``"cancelled"`` or ``"error"``;
    ``prompt_tokens``, ``completion_tokens``  usage so far;
    ``error``              the message of an ``"error"`` finish;
    ``time``               ``time.perf_counter()`` when the engine published the event (latencies).
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    time: float = field(default_factory=time.perf_counter)


def _resolve(futures: list[asyncio.Future]) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_result(None)


def publish(events: list[tuple[Handle, Event]]) -> None:
    """(The engine's loop thread.)  Append each event to its handle and wake the readers: the blocking ones
    of each handle, and each asyncio event loop once for all its readers of these handles."""
    wake: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for handle, ev in events:
        for loop, fut in handle._append(ev):
            wake.setdefault(loop, []).append(fut)
    for loop, futures in wake.items():
        try:
            loop.call_soon_threadsafe(_resolve, futures)
        except RuntimeError:  # the readers' loop is closed: nobody is waiting any more
            pass


class Handle:
    """The client's side of a submitted request: its events, and :meth:`cancel`."""

    def __init__(self, request: Request, request_id: int, cancel_fn):
        self.request, self.id = request, request_id
        self._cancel_fn = cancel_fn
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._events: list[Event] = []
        self._sleepers = 0  # blocking readers waiting on _cond
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []  # asyncio readers

    # ---- engine side (the loop thread)
    def _publish(self, ev: Event) -> None:
        publish([(self, ev)])

    def _append(self, ev: Event) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]:
        """Append ``ev`` (nothing once finished), notify the blocking readers; return the asyncio readers'
        futures, for the caller to resolve on their loops."""
        with self._lock:
            events = self._events
            if events and events[-1].finish_reason is not None:
                return []
            events.append(ev)
            if self._sleepers:
                self._cond.notify_all()
            waiters, self._waiters = self._waiters, []
        return waiters

    def _wait_for(self, predicate, timeout: float | None) -> bool:
        """(Holding ``_lock``.)  ``Condition.wait_for``, counted in ``_sleepers`` so a publish notifies."""
        self._sleepers += 1
        try:
            return self._cond.wait_for(predicate, timeout)
        finally:
            self._sleepers -= 1

    # ---- client side
    @property
    def finished(self) -> bool:
        """Whether the last event (with a ``finish_reason``) has been published."""
        return bool(self._events) and self._events[-1].finish_reason is not None

    def cancel(self) -> None:
        """End the request at the next token boundary (its slot is freed; its events end with
        ``"cancelled"``).  Idempotent; nothing happens once it has finished."""
        if not self.finished:
            self._cancel_fn(self)

    def iter(self, timeout: float | None = None) -> Iterator[Event]:
        """The events, blocking; ends after the one with a ``finish_reason``.  ``timeout``: most seconds to
        wait for one event (``TimeoutError`` then; the request goes on)."""
        i = 0
        while True:
            with self._lock:
                if not self._wait_for(lambda: len(self._events) > i, timeout):
                    raise TimeoutError(f"request {self.id}: no event within {timeout} s")
                ev = self._events[i]
            i += 1
            yield ev
            if ev.finish_reason is not None:
                return

    async def events(self) -> AsyncIterator[Event]:
        """The events, from an asyncio event loop (any loop, any thread); ends after the one with a
        ``finish_reason``.  The consuming task being cancelled while it waits (what an ASGI server does
        when the client goes away) cancels the request; leaving the loop early does not."""
        loop = asyncio.get_running_loop()
        i = 0
        while True:
            with self._lock:
                ev = self._events[i] if len(self._events) > i else None
                if ev is None:
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
            if ev is None:
                try:
                    await fut
                except asyncio.CancelledError:
                    self.cancel()
                    raise
                continue
            i += 1
            yield ev
            if ev.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> tuple[str, str, dict]:
        """Wait for the end; ``(text, finish_reason, usage)`` with usage ``{"prompt_tokens",
        "completion_tokens", "total_tokens"}`` (and ``"error"`` for an ``"error"`` finish).  ``timeout``:
        most seconds to wait in all (``TimeoutError`` then; the request goes on)."""
        with self._lock:
            if not self._wait_for(lambda: self.finished, timeout):
                raise TimeoutError(f"request {self.id}: not finished within {timeout} s")
            events = list(self._events)
        last = events[-1]
        usage = {"prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
                 "total_tokens": last.prompt_tokens + last.completion_tokens}
        if last.error is not None:
            usage["error"] = last.error
        return "".join(e.text for e in events), last.finish_reason, usage


__all__ = ["FINISH_REASONS", "EngineClosed", "Event", "Handle", "QueueFull", "Request", "publish"]
