"""CUDA-graph decoding: one decoding step captured once, replayed per token.

    dec = StaticDecoder(model, state, capacity)
    loop = DecodeLoop(dec, logits, seeds, max_steps, temperature=0.8, top_p=0.9)   # captures on CUDA
    for _ in range(n):
        loop.advance()                     # one graph replay: no host work, no sync
    new = loop.tokens[:, :n].tolist()      # the host reads the drawn tokens in batches
    loop = loop.select(still_running)      # a smaller batch: its own buffers and graph

The step (:meth:`DecodeLoop.body`) draws a token from the current logits on the device
(:func:`~lintime.generation.sampling.sample_seeded`: a hash of the row's seed and the step
counter, no generator objects), writes it to the ``tokens`` history, feeds it through the
:class:`~lintime.generation.static.StaticDecoder` (state buffers updated in place) and keeps the new
logits.  Every tensor it reads or writes is a buffer that the loop or its decoder owns, the step
counter included, so a replay needs no input from the host.

Capture (PyTorch's recipe): a few warm-up steps on a side stream (Triton compilation, cuBLAS
workspaces, lazy allocations), the buffers restored from a snapshot, then one step captured.  A
graph is tied to the addresses of its buffers: each loop owns its decoder and its buffers, so two
live generations never share state.  Where capture fails (a host read or a data-dependent shape
left on some mixer's decoding path), :func:`build_loop` warns in one line and the same loop runs
eagerly.
"""

from __future__ import annotations

import warnings

import torch

from lintime.generation.sampling import sample_seeded
from lintime.generation.static import StaticDecoder

WARMUP_STEPS = 2  # eager steps on a side stream before capture (PyTorch's CUDA-graph recipe)


class DecodeLoop:
    """Sampling + one decoding step over a :class:`StaticDecoder`, captured in a CUDA graph when
    ``graph`` (else run eagerly: the same buffers and arithmetic).

    ``logits [B, V]``: the distribution of the first token to draw (e.g. the prefill's last
    logits); ``seeds [B]`` int64 per-row seeds; ``max_steps``: tokens to draw at most (the size of
    the ``tokens [B, max_steps]`` history); ``temperature`` / ``top_k`` / ``top_p`` as in
    :func:`~lintime.generation.sampling.sample`; ``first_step``: the sampling step counter's start
    (a loop continuing another one's rows, :meth:`select`).
    """

    def __init__(self, decoder: StaticDecoder, logits: torch.Tensor, seeds: torch.Tensor, max_steps: int, *,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, graph: bool = False,
                 first_step: int = 0):
        B = decoder.batch_size
        if logits.shape[0] != B or seeds.shape != (B,):
            raise ValueError(f"DecodeLoop: {B} state rows, logits {tuple(logits.shape)}, seeds {tuple(seeds.shape)}")
        self.decoder, self.max_steps = decoder, int(max_steps)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        dev = logits.device
        self.logits = logits.clone()
        self.seeds = seeds.to(device=dev, dtype=torch.long).clone()
        self.tokens = torch.zeros(B, self.max_steps, dtype=torch.long, device=dev)
        self.first_step = int(first_step)
        self.step = torch.full((), self.first_step, dtype=torch.long, device=dev)  # the sampling step
        self.graph: torch.cuda.CUDAGraph | None = None
        self.steps_taken = 0
        if graph:
            self._capture()

    def body(self) -> None:
        """Draw one token per row, record it, feed it; all on the device."""
        tok = sample_seeded(self.logits, self.seeds, self.step, **self.sampling)  # [B]
        self.tokens.index_copy_(1, (self.step - self.first_step).view(1), tok[:, None])
        self.logits.copy_(self.decoder.step(tok))
        self.step.add_(1)

    def advance(self) -> None:
        """One token per row (a graph replay, or :meth:`body` eagerly)."""
        if self.steps_taken >= self.max_steps:
            raise RuntimeError(f"DecodeLoop: all {self.max_steps} steps taken")
        if self.graph is not None:
            self.graph.replay()
        else:
            self.body()
        self.steps_taken += 1

    def select(self, index: torch.Tensor) -> DecodeLoop:
        """A new loop (own decoder, buffers and graph) over rows ``index``, continuing where this
        one stands: e.g. the rows still running, so that the step shrinks with the batch."""
        index = index.to(self.logits.device)
        return build_loop(self.decoder.select(index), self.logits.index_select(0, index),
                          self.seeds.index_select(0, index), self.max_steps - self.steps_taken,
                          graph=self.graph is not None, first_step=self.first_step + self.steps_taken,
                          **self.sampling)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step reads or writes (the loop's and its decoder's)."""
        return [self.logits, self.seeds, self.tokens, self.step, *self.decoder.buffers()]

    def _capture(self) -> None:
        saved = self.decoder.snapshot()
        logits, step = self.logits.clone(), self.step.clone()
        try:
            side = torch.cuda.Stream(device=self.logits.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self.body()
            torch.cuda.current_stream().wait_stream(side)
        finally:  # the warm-up steps (or a failed one) leave no trace in the buffers
            self.decoder.restore(saved)
            self.logits.copy_(logits)
            self.step.copy_(step)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.body()
        self.graph = graph


def build_loop(decoder: StaticDecoder, logits, seeds, max_steps: int, *, graph: bool, **kwargs) -> DecodeLoop:
    """A :class:`DecodeLoop`, captured in a CUDA graph when ``graph``; where capture fails, a
    one-line warning and the eager loop over the same buffers."""
    if not graph:
        return DecodeLoop(decoder, logits, seeds, max_steps, graph=False, **kwargs)
    try:
        return DecodeLoop(decoder, logits, seeds, max_steps, graph=True, **kwargs)
    except Exception as e:  # noqa: BLE001 -- any capture failure falls back to the eager step
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        warnings.warn(f"lintime.generation: CUDA graph capture failed ({type(e).__name__}: {first}); "
                      f"decoding eagerly", RuntimeWarning, stacklevel=2)
        return DecodeLoop(decoder, logits, seeds, max_steps, graph=False, **kwargs)


__all__ = ["DecodeLoop", "WARMUP_STEPS", "build_loop"]


def token_blocks(loop: DecodeLoop, steps: int, sync_every: int, live: list[int]):
    """Replay ``loop`` for up to ``steps`` steps, reading the drawn tokens to the host after 1, 2, 4, ... up to
    ``sync_every`` steps (one device -> host read per block).  ``live`` (the caller's list of row ids, batch
    order) names the rows still running: each block is yielded as ``(done, {row: [tokens]})`` for those rows,
    ``done`` the steps before it, and the caller removes the rows that ended (in place) before asking for the next
    block.  When at most half of the batch is still running (and more than ``sync_every`` steps are left), the
    running rows move to a smaller loop (captured anew)."""
    batch = live[:]  # batch position -> row
    done, n = 0, 1
    while done < steps and live:
        n = min(n, steps - done)
        for _ in range(n):
            loop.advance()
        first = done - loop.first_step  # the loop's history starts at its first step
        block = loop.tokens[:, first : first + n].tolist()
        where = {r: b for b, r in enumerate(batch)}
        yield done, {r: block[where[r]] for r in live}
        done += n
        n = min(2 * n, sync_every)
        if live and len(live) <= len(batch) // 2 and steps - done > sync_every:
            loop = loop.select(torch.tensor([where[r] for r in live]))
            batch = live[:]
