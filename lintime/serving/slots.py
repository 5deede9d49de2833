"""The decoding states of the engine's batch: ``B`` slots of fixed buffers, stepped together.

    slots = SlotStates(model, max_batch=B, capacity=L)
    slots.write_row(s, state)           # a prefilled one-sequence state into slot s (a row copy)
    slots.tokens[s] = token             # the token each slot feeds next
    logits = slots.step(n)              # [n, V]: one token for slots [0, n); their buffers advance in place

The buffers are one static state of ``B`` rows (:func:`lintime.layers.base.static_state`: KV caches and
Combiner's row summaries at a capacity of ``L`` tokens per sequence, the constant-size states as they
are).  A step runs over a prefix of the slots, ``n`` a power of two (a *bucket*) covering the highest
slot in use, through views of the first ``n`` rows -- the same storage, so the rows outside a step keep
their state and a request never moves.  The engine gives a new request the lowest free slot, which keeps
the busy slots in a short prefix.

The step is one function of fixed-shape buffers per bucket: ``tokens[:n]`` in, the views' buffers
updated in place, ``logits[:n]`` out, no host read in the step itself
(:class:`lintime.generation.StaticDecoder`'s step over views).  With ``graphs=True`` (a CUDA device) each
bucket's step is captured in a CUDA graph the first time it runs (at most ``log2(B) + 1`` graphs, one
memory pool) and replayed per token after; everything else (row writes, resets, sampling) runs outside the
replay, on the same buffers.  Capture follows PyTorch's recipe (warm-up steps on a side stream, the rows put
back as they were, then one step captured), so capturing changes no slot; a bucket whose step does not
capture says so in one line and runs eagerly.

Idle slots: a slot without a request still runs in a step that covers it (its input is token 0), and so
moves one position per step.  Its numbers never reach a busy row (every family's step is row-wise), but
a growing state's fill (a KV cache's ``lengths``, Combiner's rows) and a learned position table bound the
positions a row may reach, so :meth:`SlotStates.park_idle` resets an idle slot to the empty state before
it would reach ``capacity`` (once per ``capacity`` idle steps: a row copy).

Notation: ``B`` slots (``max_batch``), ``n`` rows of a step, ``V`` vocabulary, ``L`` capacity.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from lintime.generation import decode_one_token
from lintime.generation.decode import state_nbytes
from lintime.generation.static import mark_state_checked, state_tensors
from lintime.layers.base import copy_state_, map_state, static_state

WARMUP_STEPS = 2  # eager steps on a side stream before a bucket's capture (PyTorch's CUDA-graph recipe)


def _rows(state, start: int, stop: int):
    """The state of rows ``[start, stop)`` as views of ``state``'s buffers (writes go through)."""
    return map_state(state, lambda t: t[start:stop])


def _empty(model, batch: int, capacity: int, device):
    state = static_state(model.init_state(batch, device=device), capacity)
    state.max_offset = capacity - 1  # the host bound of every position a step will see (StaticDecoder's)
    return state


def state_grows(model, capacity: int) -> bool:
    """Whether the model's static state holds more for more tokens (a KV cache, Combiner's row
    summaries): its size at ``capacity`` and at a larger capacity, read from a one-row state on the
    meta device (no memory)."""
    s = model.init_state(1, device="meta")
    return state_nbytes(static_state(s, capacity)) != state_nbytes(static_state(s, 2 * capacity + 8192))


class SlotStates:
    """``max_batch`` slots of static decoding state for sequences of up to ``capacity`` tokens
    (see the module docstring); ``graphs``: each bucket's step captured in a CUDA graph (CUDA only)."""

    def __init__(self, model, max_batch: int, capacity: int, device, *, graphs: bool = False):
        device = torch.device(device)
        if graphs and device.type != "cuda":
            raise ValueError(f"SlotStates: CUDA graphs need a CUDA device, got {device}")
        self.model, self.max_batch, self.capacity = model, int(max_batch), int(capacity)
        self.graphs = graphs
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}  # n -> graph, its logits
        self._pool = None  # the graphs' shared memory pool (they never replay at the same time)
        self.state = _empty(model, self.max_batch, self.capacity, device)  # [B] rows
        self._blank = _empty(model, 1, self.capacity, device)  # the empty state of one sequence
        self.tokens = torch.zeros(self.max_batch, dtype=torch.long, device=device)  # [B] next input
        self.positions = [0] * self.max_batch  # host copy of each slot's offset (tokens it holds)
        self._views = {}  # n -> the state of slots [0, n) (views: fixed storage per bucket)
        mark_state_checked(self.state)

    def bucket(self, highest: int) -> int:
        """Rows of the step that covers slot ``highest``: the next power of two, at most ``B``."""
        return min(1 << highest.bit_length(), self.max_batch)

    def buckets(self) -> list[int]:
        """Every step size :meth:`bucket` can return: the powers of two below ``B``, and ``B``."""
        return sorted({min(1 << k, self.max_batch) for k in range(self.max_batch.bit_length() + 1)})

    def capture_all(self) -> None:
        """Capture every bucket's step now (with graphs; else nothing): a server pays for the captures at start,
        not in its first requests' latency."""
        if self.graphs:
            for n in self.buckets():
                if n not in self._graphs:
                    self._graphs[n] = self._capture(n)

    def view(self, n: int):
        if n not in self._views:
            self._views[n] = _rows(self.state, 0, n)
        return self._views[n]

    def step(self, n: int) -> torch.Tensor:
        """Feed ``tokens[:n]`` to slots ``[0, n)``; return their logits ``[n, V]``."""
        logits = self.decode_step(n)
        self.positions[:n] = [p + 1 for p in self.positions[:n]]
        return logits

    def decode_step(self, n: int) -> torch.Tensor:
        """The device work of :meth:`step`: ``tokens[:n]`` and the buffers of slots ``[0, n)`` in, the
        buffers updated in place and the logits ``[n, V]`` out; fixed shapes per ``n`` and no host read.
        With graphs, a replay of the bucket's graph, and the logits are its output buffer: read them
        before the next step."""
        if self.graphs:
            if n not in self._graphs:
                self._graphs[n] = self._capture(n)
            if self._graphs[n] is not None:
                graph, logits = self._graphs[n]
                graph.replay()
                return logits
        # a row write or the last step bumped the buffers' version counters: the ops would check them again
        # (a replay runs no op's checks)
        mark_state_checked(self.view(n))
        return self._eager_step(n)

    def _eager_step(self, n: int) -> torch.Tensor:
        state = self.view(n)
        logits, new = decode_one_token(self.model, self.tokens[:n], state)
        copy_state_(state, new, "decoding state")
        return logits

    def _capture(self, n: int):
        """Bucket ``n``'s step as ``(graph, logits)``, or ``None`` (one warning) where it does not capture.
        The warm-up steps' effects on the rows and the token buffer are undone."""
        view = self.view(n)
        saved = [t.clone() for t in (*state_tensors(view), self.tokens)]

        def put_back() -> None:
            for t, old in zip((*state_tensors(view), self.tokens), saved, strict=True):
                t.copy_(old)
            mark_state_checked(view)

        try:
            side = torch.cuda.Stream(device=self.tokens.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    mark_state_checked(view)
                    self._eager_step(n)
            torch.cuda.current_stream().wait_stream(side)
            put_back()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._eager_step(n)
            put_back()  # capturing ran nothing, but leave no doubt
            return graph, logits
        except Exception as e:  # noqa: BLE001 -- a bucket that does not capture runs eagerly
            with contextlib.suppress(Exception):  # a failed capture may leave an error on the stream
                torch.cuda.synchronize(self.tokens.device)
            put_back()
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            warnings.warn(f"lintime.serving: the decoding step of {n} slots does not capture in a CUDA graph "
                          f"({type(e).__name__}: {first}); it runs eagerly", RuntimeWarning, stacklevel=2)
            return None

    def write_row(self, slot: int, state, tokens: int) -> None:
        """Slot ``slot`` takes ``state`` (one sequence, e.g. a prefilled prompt of ``tokens`` tokens)."""
        copy_state_(_rows(self.state, slot, slot + 1), static_state(state, self.capacity), "prefilled state")
        self.positions[slot] = tokens

    def reset_row(self, slot: int) -> None:
        """Slot ``slot`` back to the empty state."""
        copy_state_(_rows(self.state, slot, slot + 1), self._blank)
        self.positions[slot] = 0

    def park_idle(self, n: int, idle: list[int]) -> None:
        """Before a step over ``[0, n)``: reset each slot of ``idle`` inside it that is full."""
        for s in idle:
            if s < n and self.positions[s] >= self.capacity:
                self.reset_row(s)


__all__ = ["SlotStates", "state_grows"]
