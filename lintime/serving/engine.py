"""Continuous batching: many completion requests decoded together, each joining and leaving the batch at
a token boundary.

    engine = Engine(model, tokenizer, max_batch=64)
    engine.start()
    handle = engine.submit(Request("def parse(", max_tokens=64, temperature=0))
    async for ev in handle.events():     # or: for ev in handle.iter()
        print(ev.text, end="")
    engine.shutdown()

One background thread runs the loop; :meth:`Engine.submit` and :meth:`Handle.cancel` only queue work for
it and wake it.  Each iteration of the loop:

1. ends the requests cancelled since the last one (their slots are freed);
2. gives waiting requests free slots (the lowest first, :mod:`lintime.serving.slots`), oldest first;
3. prefills: at most ``prefill_chunk`` prompt tokens of the requests holding a slot, oldest first.  Whole
   prompts that fit go together in one packed call (:func:`lintime.generation.prefill` with ``cu_seqlens``:
   no prompt attends to another, each gets its own state); a prompt longer than what is left is consumed
   in pieces over several iterations (batch 1, continuing its own partial state), so it never stalls the
   running requests for more than one piece.  A request whose prompt is done has its state written into
   its slot (a row copy) and draws its first token from the prefill's logits;
4. runs one decoding step of every running request (:meth:`SlotStates.step` over the slots' bucket), draws
   each request's next token with its own settings, and publishes the events; a request that finishes
   frees its slot at once.

The loop sleeps on a condition variable while there is nothing to do.

Sampling: temperature 0 is greedy (argmax); otherwise :func:`lintime.generation.sample_seeded`'s draw with the
request's temperature, top-k and top-p, and its ``t``-th token drawn from a hash of ``(seed, t)`` (computed on the
host: :func:`~lintime.generation.sampling.seeded_uniform_host`); rows with the same settings are drawn together,
and a step's tokens come to the host in one read.  A request's tokens depend only on its own logits, and every
family's decoding step is row-wise, so batching changes a row's logits at most by the last bits a matrix
product of another batch size may round differently (on the CPU in fp32: not at all; greedy output alone
and in a batch of staggered requests is the same, tested per family, and so is a seeded sample).  The
text goes through :class:`~lintime.generation.Detokenizer` and :class:`~lintime.generation.StopMatcher`,
as in ``lintime generate``.

Limits: a request needs ``prompt + max_tokens <= capacity`` tokens when the model's state grows with the
sequence (softmax and GAU KV caches, Combiner, FLASH with first-to-all) or its positions are a learned
table (whose size then bounds ``capacity``); ``submit`` refuses one that does not fit.
"""

from __future__ import annotations

import heapq
import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from lintime.generation import Detokenizer, StopMatcher, prefill
from lintime.generation.sampling import sample_uniform, seeded_uniform_host
from lintime.layers.base import select_state
from lintime.serving.request import EngineClosed, Event, Handle, QueueFull, Request, publish
from lintime.utils.checks import is_int
from lintime.serving.slots import SlotStates, state_grows

# tokens per slot when the model's state grows and neither a capacity nor a prompt bound is given: room for
# a few thousand tokens without reserving the largest completion for every slot
DEFAULT_CAPACITY = 4096
# prompt tokens per loop iteration: enough to prefill several prompts in one packed call (a prefill call costs
# about the same host time for a few hundred tokens as for a few thousand), few enough that the running
# requests' next token waits for one such call only
PREFILL_CHUNK = 4096


@dataclass(eq=False)
class _Job:
    """The engine's side of one request (owned by the loop thread once admitted)."""

    handle: Handle | None
    ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: tuple[str, ...]
    echo_text: str | None
    detok: Detokenizer
    matcher: StopMatcher
    cancelled: bool = False
    slot: int = -1
    consumed: int = 0  # prompt tokens prefilled
    state: object = None  # the partial prefill state (one sequence) until the prompt is done
    drawn: int = 0  # tokens drawn
    next_token: int = 0  # the token to feed at the next step
    sampling: tuple = field(default=())  # rows with equal keys are drawn together
    stop_chars: frozenset = field(default=frozenset())  # every character of the stop strings
    held: int = 0  # characters the stop matcher holds back

    def __post_init__(self):
        self.sampling = ("greedy",) if self.temperature == 0 else (self.temperature, self.top_k, self.top_p)
        self.stop_chars = frozenset("".join(self.stop))


class Engine:
    """The continuous-batching engine (see the module docstring).

    ``max_batch``             slots: requests decoded together;
    ``max_queue``             requests waiting or running at most (``submit`` raises :class:`QueueFull` beyond);
    ``prefill_chunk``         most prompt tokens prefilled per loop iteration;
    ``max_prompt_tokens``     longest prompt accepted (``None``: what the model can take);
    ``max_new_tokens_limit``  largest ``max_tokens`` accepted;
    ``capacity``              tokens (prompt + completion) a slot holds for a model whose state grows
                              (default: ``max_prompt_tokens + max_new_tokens_limit``, else
                              ``DEFAULT_CAPACITY``; a learned position table's size at most);
    ``device``                where to run (``None``: the model's device; else the model moves there);
    ``graphs``                each batch bucket's decoding step replayed from a CUDA graph (``None``: on CUDA).

    The model is put in eval mode and must be a causal lintime LM (``init_state`` / ``ModelState``).
    """

    def __init__(self, model, tokenizer, *, max_batch: int = 64, max_queue: int = 256,
                 prefill_chunk: int = PREFILL_CHUNK,
                 max_prompt_tokens: int | None = None, max_new_tokens_limit: int = 4096,
                 capacity: int | None = None, device=None, graphs: bool | None = None):
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk),
                            ("max_new_tokens_limit", max_new_tokens_limit)):
            if not is_int(value) or value < 1:
                raise ValueError(f"Engine: {name} must be an integer >= 1, got {value!r}")
        if max_prompt_tokens is not None and (not is_int(max_prompt_tokens) or max_prompt_tokens < 1):
            raise ValueError(f"Engine: max_prompt_tokens must be None or an integer >= 1, got {max_prompt_tokens!r}")
        if getattr(model, "causal", True) is False:
            raise ValueError(f"Engine: {type(model).__name__} is bidirectional (masked LM): it cannot generate text")
        if not hasattr(model, "init_state"):
            raise TypeError(f"Engine needs a lintime causal LM (init_state, ModelState), got {type(model).__name__}")
        if device is not None:
            model.to(device)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.device = next(model.parameters()).device
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.max_prompt_tokens, self.max_new_tokens_limit = max_prompt_tokens, max_new_tokens_limit
        cfg = getattr(model, "config", None)
        self.vocab_size = int(getattr(cfg, "vocab_size", None) or tokenizer.vocab_size)
        self.eos_id = getattr(tokenizer, "eos_id", None)
        self.max_positions = cfg.max_positions if getattr(cfg, "position", None) == "learned" else None
        if capacity is None:
            capacity = max_prompt_tokens + max_new_tokens_limit if max_prompt_tokens else DEFAULT_CAPACITY
            capacity = min(capacity, self.max_positions or capacity)
        if not is_int(capacity) or capacity < 2:
            raise ValueError(f"Engine: capacity must be an integer >= 2, got {capacity!r}")
        if self.max_positions is not None and capacity > self.max_positions:
            raise ValueError(f"Engine: capacity {capacity} exceeds the model's learned position table "
                             f"({self.max_positions} positions)")
        self.capacity = capacity
        # whether a request must fit in capacity: a growing state, or positions bounded by a table
        self.bounded = self.max_positions is not None or state_grows(model, capacity)
        with torch.no_grad():
            graphs = self.device.type == "cuda" if graphs is None else bool(graphs)
            self._slots = SlotStates(model, max_batch, capacity, self.device, graphs=graphs)
        self.graphs = graphs
        self.capture_s: float | None = None  # seconds :meth:`start` spent capturing the buckets' graphs
        self.buckets = self._slots.buckets()  # the batch sizes a decoding step takes

        self._cv = threading.Condition()  # guards the fields below up to the loop's own
        self._pending: deque[_Job] = deque()  # submitted, waiting for a slot
        self._live = 0  # requests submitted and not finished
        self._closing = self._cancel_all = False
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self._rng = random.Random()  # seeds of requests without one
        # the loop thread's own
        self._prefilling: list[_Job] = []  # holding a slot, prompt not consumed yet (oldest first)
        self._running: dict[int, _Job] = {}  # slot -> request decoding
        self._free = list(range(max_batch))  # heap of free slots
        self._counts = {"tokens_generated": 0, "prompt_tokens": 0, "steps": 0, "requests_finished": 0}

    # ------------------------------------------------------------------ public API
    def start(self) -> Engine:
        """Start the loop thread (idempotent).  With graphs, every batch bucket's decoding step is captured
        first (:attr:`capture_s` seconds), so no request waits for a capture."""
        if self.graphs and self._thread is None and self.capture_s is None:
            t0 = time.perf_counter()
            with torch.no_grad():
                self._slots.capture_all()
            self.capture_s = time.perf_counter() - t0
        with self._cv:
            if self._closing:
                raise EngineClosed("the engine has been shut down")
            self._start_locked()
        return self

    def submit(self, request: Request) -> Handle:
        """Queue ``request``; its :class:`Handle` streams the completion.  Raises ``ValueError`` for a
        request the engine cannot run (the message names the field), :class:`QueueFull` with ``max_queue``
        requests waiting or running, :class:`EngineClosed` after :meth:`shutdown`.  The request runs once
        :meth:`start` has been called."""
        if self._closing:
            raise EngineClosed("the engine has been shut down: it takes no new requests")
        job = self._check(request)
        with self._cv:
            if self._closing:
                raise EngineClosed("the engine has been shut down: it takes no new requests")
            if self._live >= self.max_queue:
                raise QueueFull(f"{self._live} requests are already waiting or running (max_queue={self.max_queue})")
            self._live += 1
            self._next_id += 1
            job.handle = Handle(request, self._next_id, lambda _h: self._cancel(job))
            self._pending.append(job)
            self._cv.notify_all()
        return job.handle

    def stats(self) -> dict:
        """``running`` (decoding), ``prefilling`` (holding a slot, prompt being consumed), ``waiting`` (for a
        slot), ``free_slots``, ``max_batch``, ``capacity``, and since the start ``tokens_generated``,
        ``prompt_tokens`` (prefilled), ``steps`` (decoding steps), ``requests_finished``."""
        with self._cv:
            waiting = len(self._pending)
        return {"running": len(self._running), "prefilling": len(self._prefilling), "waiting": waiting,
                "free_slots": len(self._free), "max_batch": self.max_batch, "capacity": self.capacity,
                **self._counts}

    def shutdown(self, timeout: float = 30.0, cancel: bool = False) -> None:
        """Stop taking requests (``submit`` raises :class:`EngineClosed`), let the ones in flight finish
        (``cancel``: end them as ``"cancelled"`` at the next token boundary; also what happens to those
        still running after ``timeout`` seconds) and join the loop thread."""
        with self._cv:
            self._closing = True
            self._cancel_all = self._cancel_all or cancel
            if self._live:
                self._start_locked()  # requests queued before any start still get their end
            thread = self._thread
            self._cv.notify_all()
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            with self._cv:
                self._cancel_all = True
                self._cv.notify_all()
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the engine's loop did not stop within {2 * timeout} s")

    # ------------------------------------------------------------------ checks
    def _check(self, r: Request) -> _Job:
        if not isinstance(r, Request):
            raise ValueError(f"submit takes a lintime.serving.Request, got {type(r).__name__}")
        stop = r.checked(self.max_new_tokens_limit)
        ids, echo = self._encode(r.prompt)
        self._check_length(len(ids), r.max_tokens)
        return _Job(None, ids, int(r.max_tokens), float(r.temperature), int(r.top_k), float(r.top_p),
                    self._rng.getrandbits(63) if r.seed is None else int(r.seed), tuple(stop),
                    echo if r.echo else None, Detokenizer(self.tokenizer), StopMatcher(tuple(stop)))

    def _encode(self, prompt) -> tuple[list[int], str]:
        """The prompt's token ids and its text (for ``echo``)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return [self.tokenizer.bos_id, *self.tokenizer.encode(prompt)], prompt
        if isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            if not prompt:
                raise ValueError("prompt is empty")
            bad = [int(t) for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}) (the vocabulary), "
                                 f"got {bad[:5]}")
            ids = [int(t) for t in prompt]
            return ids, self.tokenizer.decode(ids)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def _check_length(self, P: int, M: int) -> None:
        if self.max_prompt_tokens is not None and P > self.max_prompt_tokens:
            raise ValueError(f"prompt has {P} tokens, more than this engine takes (max_prompt_tokens="
                             f"{self.max_prompt_tokens})")
        if not self.bounded or P + M <= self.capacity:
            return
        if self.max_positions is not None and self.capacity == self.max_positions:
            limit = f"the model's learned position table ({self.max_positions} positions)"
        else:
            limit = (f"this engine's capacity of {self.capacity} tokens per sequence (the model's decoding state "
                     f"grows with the sequence: Engine(capacity=...))")
        if P >= self.capacity:
            raise ValueError(f"prompt has {P} tokens: too long for {limit}")
        raise ValueError(f"prompt ({P} tokens) + max_tokens ({M}) = {P + M} tokens exceeds {limit}; "
                         f"max_tokens can be at most {self.capacity - P}")

    # ------------------------------------------------------------------ the loop thread
    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="lintime-serving", daemon=True)
            self._thread.start()

    def _cancel(self, job: _Job) -> None:
        with self._cv:
            job.cancelled = True
            self._cv.notify_all()

    def _has_work(self) -> bool:
        return bool(self._pending or self._prefilling or self._running or self._closing)

    def _loop(self) -> None:
        with torch.no_grad():
            while True:
                with self._cv:
                    self._cv.wait_for(self._has_work)
                    if self._closing and self._live == 0:
                        return
                    cancel_all = self._cancel_all
                    admitted = self._admit(cancel_all)
                try:
                    self._iteration(admitted, cancel_all)
                except Exception as err:  # a fault of the loop itself: end every request, keep the engine
                    for job in [*self._prefilling, *self._running.values()]:
                        self._end(job, "error", f"{type(err).__name__}: {err}")

    def _admit(self, cancel_all: bool) -> list[_Job]:
        """(Under the lock.)  Pending requests cancelled end; the oldest others get the free slots."""
        cancelled = [j for j in self._pending if j.cancelled or cancel_all]
        if cancelled:
            self._pending = deque(j for j in self._pending if not (j.cancelled or cancel_all))
        for job in cancelled:
            self._finish_locked(job, Event("", [], "cancelled", len(job.ids), 0))
        admitted = []
        while self._pending and self._free:
            job = self._pending.popleft()
            job.slot = heapq.heappop(self._free)
            admitted.append(job)
        return admitted

    def _iteration(self, admitted: list[_Job], cancel_all: bool) -> None:
        self._prefilling += admitted
        for job in [*self._prefilling, *self._running.values()]:
            if job.cancelled or cancel_all:
                self._end(job, "cancelled")
        self._prefill(self.prefill_chunk)
        if self._running:
            self._decode()

    def _prefill(self, budget: int) -> None:
        while budget > 0 and self._prefilling:
            job = self._prefilling[0]
            if job.consumed == 0 and len(job.ids) <= budget:  # whole prompts: prefilled together, packed
                budget -= self._prefill_whole(self._whole_prompts(budget))
                continue
            n = min(budget, len(job.ids) - job.consumed)
            try:
                ids = torch.tensor(job.ids[job.consumed : job.consumed + n], device=self.device)[None]  # [1, n]
                logits, job.state = prefill(self.model, ids, job.state, chunk_size=n)  # [1, V]
                job.consumed += n
                self._counts["prompt_tokens"] += n
                budget -= n
                if job.consumed < len(job.ids):
                    continue
                self._prefilling.pop(0)
                self._slots.write_row(job.slot, job.state, len(job.ids))
                job.state = None
                self._running[job.slot] = job
                tokens = self._draw([job], logits)
            except Exception as err:
                self._end(job, "error", f"prefill: {type(err).__name__}: {err}")
                continue
            self._take_all([job], tokens)

    def _whole_prompts(self, budget: int) -> list[_Job]:
        """The oldest requests not yet started whose whole prompts fit in ``budget`` tokens together (at least the
        first, which the caller checked), in order: the first that does not fit ends the group."""
        group, total = [], 0
        for job in self._prefilling:
            if job.consumed or total + len(job.ids) > budget:
                break
            group.append(job)
            total += len(job.ids)
        return group

    def _prefill_whole(self, group: list[_Job]) -> int:
        """Prefill the whole prompts of ``group`` in one packed call (:func:`lintime.generation.prefill` with
        ``cu_seqlens``: no prompt sees another), write each state into its slot and draw each first token;
        return the tokens prefilled.  Where the packed call fails, each prompt is tried alone, so a request that
        breaks the model ends alone."""
        lens = [len(job.ids) for job in group]
        try:
            ids = torch.tensor([t for job in group for t in job.ids], device=self.device)[None]  # [1, sum(lens)]
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=self.device)
            logits, state = prefill(self.model, ids, None, chunk_size=max(lens), cu_seqlens=cu)  # [N, V]
            for i, job in enumerate(group):
                self._slots.write_row(job.slot, select_state(state, torch.tensor([i], device=self.device)), lens[i])
        except Exception as err:
            if len(group) > 1:
                return sum(self._prefill_whole([job]) for job in group)
            self._end(group[0], "error", f"prefill: {type(err).__name__}: {err}")
            return sum(lens)
        self._counts["prompt_tokens"] += sum(lens)
        for job in group:
            job.consumed = len(job.ids)
            self._prefilling.remove(job)
            self._running[job.slot] = job
        try:
            tokens = self._draw(group, logits)
        except Exception as err:
            for job in group:
                self._end(job, "error", f"sampling: {type(err).__name__}: {err}")
            return sum(lens)
        self._take_all(group, tokens)
        return sum(lens)

    def _decode(self) -> None:
        running = self._running
        slots = sorted(running)
        n = self._slots.bucket(slots[-1])
        if len(slots) < n:
            self._slots.park_idle(n, [s for s in range(n) if s not in running])
        jobs = [running[s] for s in slots]
        feed = [0] * n
        for s, job in zip(slots, jobs):
            feed[s] = job.next_token
        try:
            self._slots.tokens[:n].copy_(torch.tensor(feed))
            logits = self._slots.step(n)  # [n, V]
            self._counts["steps"] += 1
            tokens = self._draw(jobs, logits, slots)
        except Exception as err:
            for job in jobs:
                self._end(job, "error", f"decoding step: {type(err).__name__}: {err}")
            for s in range(n):  # a step that failed half-way leaves its rows unknown: empty them
                self._slots.reset_row(s)
            return
        self._take_all(jobs, tokens)

    def _draw(self, jobs: list[_Job], logits: torch.Tensor, rows: list[int] | None = None) -> list[int]:
        """The next token of each of ``jobs`` from its row of ``logits`` (row ``rows[i]`` for ``jobs[i]``; ``None``:
        row ``i``), with one read to the host for all of them.  Greedy rows take one argmax over every row of
        ``logits`` (no gather: a step's greedy batch costs one kernel); each group of sampled rows with equal
        settings is drawn together and written over its rows of that argmax before the read."""
        rows = list(range(len(jobs))) if rows is None else rows
        groups: dict[tuple, list[int]] = {}
        for i, job in enumerate(jobs):
            groups.setdefault(job.sampling, []).append(i)
        if ("greedy",) in groups:
            picked = logits.argmax(dim=-1)  # [n]
        else:
            picked = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        for key, members in groups.items():
            if key == ("greedy",):
                continue
            index = torch.tensor([rows[i] for i in members], device=logits.device)
            # the members' uniform numbers, hashed from their seeds and draw counts on the host
            u = seeded_uniform_host([jobs[i].seed for i in members], [jobs[i].drawn for i in members])
            tokens = sample_uniform(logits.index_select(0, index), torch.from_numpy(u).to(logits.device),
                                    temperature=key[0], top_k=key[1], top_p=key[2])  # [m]
            picked.index_copy_(0, index, tokens)
        best = picked.tolist()
        return [best[r] for r in rows]

    def _take_all(self, jobs: list[_Job], tokens: list[int]) -> None:
        """``jobs[i]`` drew ``tokens[i]``: publish each one's text, all in one :func:`publish`; end a request at
        eos, a stop string or ``max_tokens``."""
        self._counts["tokens_generated"] += len(jobs)
        events, ended = [], []
        for job, token in zip(jobs, tokens):
            job.drawn += 1
            try:
                shown, reason = self._text(job, token)
            except Exception as err:
                self._end(job, "error", f"detokenising: {type(err).__name__}: {err}")
                continue
            events.append((job.handle, Event(shown, [token], reason, len(job.ids), job.drawn)))
            if reason is None:
                job.next_token = token
            else:
                ended.append(job)
        if ended:
            for job in ended:
                self._release(job)
            with self._cv:
                self._live -= len(ended)
                self._counts["requests_finished"] += len(ended)
        publish(events)

    def _text(self, job: _Job, token: int) -> tuple[str, str | None]:
        """The text ``token`` makes final for ``job`` and the request's finish reason (``None``: it goes on)."""
        if token == self.eos_id:
            reason, new = "stop", job.detok.flush()
        else:
            new = job.detok.push(token)
            reason = "length" if job.drawn == job.max_tokens else None
            if reason is not None:
                new += job.detok.flush()
        if job.stop and (job.held or not job.stop_chars.isdisjoint(new)):
            shown, stopped = job.matcher.push(new)
            job.held += len(new) - len(shown)
            if stopped:
                reason = "stop"
            elif reason is not None:
                shown += job.matcher.flush()
        else:  # no text held and no character of a stop string: the matcher would pass the text through
            shown = new
        if job.echo_text is not None:
            shown, job.echo_text = job.echo_text + shown, None
        return shown, reason

    def _end(self, job: _Job, reason: str, error: str | None = None) -> None:
        """End ``job`` (holding a slot) without a token: ``"cancelled"`` or ``"error"``."""
        self._release(job)
        with self._cv:
            self._finish_locked(job, Event("", [], reason, len(job.ids), job.drawn, error))

    def _release(self, job: _Job) -> None:
        if job in self._prefilling:
            self._prefilling.remove(job)
        if self._running.get(job.slot) is job:
            del self._running[job.slot]
        if job.slot >= 0:
            heapq.heappush(self._free, job.slot)
            job.slot, job.state = -1, None

    def _finish_locked(self, job: _Job, ev: Event) -> None:
        self._live -= 1
        self._counts["requests_finished"] += 1
        job.handle._publish(ev)


__all__ = ["DEFAULT_CAPACITY", "Engine"]
