"""The decoding rows of ``lintime bench model``: prefill speed and ms per token at each context ``L``, per
batch size and decoding path.

Ours (one model per preset): at each ``L`` a fresh random prompt of ``L`` tokens is prefilled into an
empty state by :func:`lintime.generation.prefill` (its automatic pieces: the whole prompt per model call
up to ``PREFILL_TOKENS``), timed between two device synchronisations -- the row's prefill columns (an untimed prefill of one
piece runs first for every new piece size: Triton's compilation).  The state of that one
prompt is replicated to each batch size ``B`` of ``Settings.decode_batch`` (rows decode independently, so
``B`` copies of one prompt cost what ``B`` prompts cost), and one row per path (``Settings.decode_paths``):

* ``eager`` -- :func:`lintime.generation.decode_one_token` timed for ``decode_steps`` tokens fed one
  after the other (a Python call per token, a new state object per step);
* ``graph`` -- what ``lintime generate`` runs on CUDA: the state copied into fixed buffers
  (:class:`~lintime.generation.static.StaticDecoder`, a KV cache at a capacity of ``L`` + the steps),
  one greedy step (argmax, feed, logits kept) captured in a CUDA graph
  (:class:`~lintime.generation.graphs.DecodeLoop`), each timed step one replay; needs CUDA (a
  ``skipped`` row elsewhere); a capture failure is the row's error.

Anchors (:mod:`lintime.bench.anchors`) decode by the library's ``generate`` (greedy) from a fresh
``B x L`` prompt, which gives their prefill columns too: ``eager`` with the library's default cache;
for ``hf:llama-*``, where ``graph`` rows are asked for, also ``static-compiled``: HF's static cache of
``L`` + the steps slots with the one-token forward compiled by HF's ``generate``.

Memory: before a case runs, its state (and, for the anchors, the prompt's one-forward activations) is
estimated and compared with the free device memory; a case that cannot fit is a ``skipped: memory ...``
row (e.g. a softmax KV cache of 128k tokens for 64 sequences), as are its longer contexts.  A failing
path skips its own longer contexts at that batch size; a failing prefill, every path's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lintime.bench import anchors
from lintime.bench import common
from lintime.bench.anchors import AnchorSpec, SkipPreset, autocast
from lintime.bench.measure import call_times_ms, quantiles
from lintime.bench.report import fmt_size

PATHS = ("eager", "graph")
GRAPH_WARMUP = 2  # untimed replays after capture (the first replays of a fresh graph upload it)
MEMORY_FRACTION = 0.85  # of the free device memory a case may plan to fill (the rest: allocator slack, workspaces)
# transient copies of the replicated state a path holds at once: eager decoding's first step grows a KV cache
# to twice its length out of place (old + new + the doubled capacity); the graph path holds the replicated
# state and its static buffers
STATE_COPIES = {"eager": 4.0, "graph": 2.0}
REPLICATED = "state: one prefilled prompt replicated to every row"


def decode_paths(spec: str, device: torch.device) -> tuple[str, ...]:
    """``--decode-path``: ``eager``, ``graph``, ``both``, or ``auto`` (``both`` on CUDA, ``eager`` elsewhere)."""
    table = {"eager": ("eager",), "graph": ("graph",), "both": PATHS}
    if spec == "auto":
        return PATHS if device.type == "cuda" else ("eager",)
    if spec not in table:
        raise ValueError(f"--decode-path must be one of auto, eager, graph, both; got {spec!r}")
    return table[spec]


def free_bytes(device: torch.device) -> int | None:
    """Free device memory (CUDA), ``None`` elsewhere (no memory rule off CUDA)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def memory_skip(need: float, device: torch.device, what: str) -> str | None:
    """``None`` when ``need`` bytes fit in ``MEMORY_FRACTION`` of the free memory, else the skip reason."""
    free = free_bytes(device)
    if free is None or need <= MEMORY_FRACTION * free:
        return None
    return f"memory: {what} needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


class Prompts:
    """Ours: :meth:`prefill` builds the state of a fresh ``L``-token prompt (timed); :meth:`eager` /
    :meth:`graph` time the steps from it, replicated to ``B`` rows, without altering it."""

    def __init__(self, model, cfg, s, device: torch.device, amp):
        self.model, self.cfg, self.s, self.device, self.amp = model, cfg, s, device, amp
        self.g = torch.Generator().manual_seed(1)
        self.state = self.logits = None
        self.warm: set[int] = set()  # piece sizes prefilled once untimed
        self.row_bytes = 0  # the state of one prompt

    def _prefill(self, L: int):
        from lintime.generation import prefill

        ids = torch.randint(0, self.cfg.vocab_size, (1, L), generator=self.g).to(self.device)
        with torch.no_grad(), autocast(self.device, self.amp):
            return prefill(self.model, ids, None, self.s.prefill_chunk)

    def prefill(self, L: int) -> dict:
        """Prefill a fresh ``L``-token prompt; returns the row fields ``prefill_s``, ``prefill_tokens``,
        ``state_mib``."""
        from lintime.generation.decode import prefill_piece, state_nbytes

        self.state = self.logits = None
        common.free_memory(self.device)
        piece = min(L, self.s.prefill_chunk or prefill_piece(1, L))
        if piece not in self.warm:  # untimed, once per piece size: Triton compilation and autotuning
            self._prefill(piece)
            self.warm.add(piece)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        self.logits, self.state = self._prefill(L)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        self.row_bytes = state_nbytes(self.state)
        return {"prefill_s": seconds, "prefill_tokens": L, "state_mib": self.row_bytes / 2**20}

    def rows(self, B: int):
        """``(logits [B, V], state)``: the prompt's, replicated."""
        if B == 1:
            return self.logits, self.state
        index = torch.zeros(B, dtype=torch.long, device=self.device)
        return self.logits.index_select(0, index), self.state.select(index)

    def eager(self, row) -> list[float]:
        from lintime.generation import decode_one_token

        s, device, amp, B = self.s, self.device, self.amp, row.batch
        _, start = self.rows(B)
        tokens = torch.randint(0, self.cfg.vocab_size, (s.decode_steps + 1, B), generator=self.g).to(device)
        cur = {"state": start, "i": 0}

        def one() -> None:
            with torch.no_grad(), autocast(device, amp):
                _, cur["state"] = decode_one_token(self.model, tokens[cur["i"]], cur["state"])
            cur["i"] += 1

        with torch.no_grad(), autocast(device, amp):  # untimed: first-call compilation
            decode_one_token(self.model, tokens[-1], start)
        common.reset_peak(device)
        return call_times_ms(one, s.decode_steps, device, budget_s=s.case_budget_s)

    def graph(self, row) -> list[float]:
        from lintime.generation.decode import state_nbytes
        from lintime.generation.graphs import DecodeLoop
        from lintime.generation.static import StaticDecoder

        s, device, B = self.s, self.device, row.batch
        if device.type != "cuda":
            raise SkipPreset(f"CUDA graphs need a CUDA device (device {device})")
        steps = GRAPH_WARMUP + s.decode_steps
        logits, start = self.rows(B)
        with torch.no_grad(), autocast(device, self.amp):
            dec = StaticDecoder(self.model, start, row.L + steps + 1)
            del start
            loop = DecodeLoop(dec, logits, torch.zeros(B, dtype=torch.long, device=device), steps,
                              graph=True, temperature=0.0)  # a capture failure raises: the row's error
            for _ in range(GRAPH_WARMUP):
                loop.advance()
        row.state_mib = state_nbytes(dec.state) / B / 2**20  # the static buffers (a KV cache at capacity)
        common.reset_peak(device)
        times = call_times_ms(loop.advance, s.decode_steps, device, budget_s=s.case_budget_s)
        del loop, dec
        return times

    def need(self, row) -> float:
        """Bytes the row's path will hold at once (the replicated state's copies)."""
        return STATE_COPIES[row.path] * row.batch * self.row_bytes


def _anchor_measures(model, cfg: AnchorSpec, s, device, amp, B: int) -> dict[str, Callable | str]:
    """``{path: measure(row) -> times, or the status of every row of the path}`` of an anchor at batch ``B``."""
    out: dict[str, Callable | str] = {}
    reset = lambda: common.reset_peak(device)  # noqa: E731
    if "eager" in s.decode_paths:
        out["eager"] = anchors.generate_measure(model, cfg, s.decode_steps, B, device, amp, reset)
    if "graph" in s.decode_paths:
        if not cfg.name.startswith("hf:"):
            out["static-compiled"] = f"skipped: {cfg.impl.split()[0]} has no static-cache compiled generate here"
        elif device.type != "cuda":
            out["static-compiled"] = f"skipped: HF compiles the static-cache forward on CUDA only (device {device})"
        else:  # its untimed warm-up compiles: a failure there is this path's status, not the preset's
            try:
                out["static-compiled"] = anchors.generate_measure(model, cfg, s.decode_steps, B, device, amp, reset,
                                                                  warmup_tokens=4, static=True)
            except Exception as e:  # noqa: BLE001
                out["static-compiled"] = f"error: {common.one_line(e)}"
    return out


def _fill(row, times: list[float], device) -> None:
    q = quantiles(times)
    row.token_ms, row.token_p10_ms, row.token_p90_ms = q["median"], q["p10"], q["p90"]
    row.tokens_per_s = row.batch / (q["median"] / 1e3)
    row.peak_mib = common.peak_mib(device)
    row.steps = len(times)
    if row.prefill_s and row.prefill_tokens_per_s is None:  # the anchors' (their whole B x L prompt)
        row.prefill_tokens_per_s = row.batch * row.prefill_tokens / row.prefill_s


def _anchor_need(cfg: AnchorSpec, row) -> float:
    return row.batch * row.L * (cfg.cache_bytes_per_token + cfg.act_bytes_per_token) * (2 if row.path != "eager" else 1)


def _run_case(row, measure, need: Callable | None, device) -> None:
    """Measure one row (or raise :class:`SkipPreset` when it cannot fit)."""
    if need is not None:
        why = memory_skip(need(row), device, f"B={row.batch} at L={fmt_size(row.L)}")
        if why:
            raise SkipPreset(why)
    _fill(row, measure(row), device)


def _contexts(model, s, device, amp, name, cfg, note, emit, decode_case: Callable | None) -> None:
    params = common.num_parameters(model)
    ours = not isinstance(cfg, AnchorSpec)
    prompts = Prompts(model, cfg, s, device, amp) if ours and decode_case is None else None
    measures: dict[tuple[int, str], Callable | str | None] = {}
    for B in s.decode_batch:
        if decode_case is not None:
            paths = {p: None for p in s.decode_paths}
        elif ours:
            paths = {p: getattr(prompts, p) for p in s.decode_paths}
            if "graph" in paths and device.type != "cuda":
                paths["graph"] = f"skipped: CUDA graphs need a CUDA device (device {device})"
        else:
            try:
                paths = _anchor_measures(model, cfg, s, device, amp, B)
            except Exception as e:  # the untimed warm-up generate at this batch failed
                paths = {p: ("OOM" if common.is_oom(e) else f"error: {common.one_line(e)}") for p in
                         (("eager",) if "eager" in s.decode_paths else ()) +
                         (("static-compiled",) if "graph" in s.decode_paths else ())}
                del e
                common.free_memory(device)
        measures.update({(B, p): m for p, m in paths.items()})
    stop: dict[tuple[int, str], str | None] = dict.fromkeys(measures)
    for L in s.decode_contexts:
        prefill: dict | None = None  # ours: the fields of this L's one prefill
        slow = None  # ours: a prefill over the budget skips the longer contexts (this one still runs)
        for (B, path), measure in measures.items():
            row = common.DecodeRow(name, cfg.family, L, B, params=params, impl=common.impl_name(cfg), note=note,
                                   path=path)
            if isinstance(measure, str) or stop[B, path]:
                row.status = measure if isinstance(measure, str) else f"skipped: {stop[B, path]}"
                emit(row)
                continue
            try:
                if decode_case is not None:
                    decode_case(row, model, s, device, amp)
                elif ours:
                    if prefill is None:
                        prefill = {}
                        prefill = prompts.prefill(L)
                        if prefill["prefill_s"] > s.case_budget_s:
                            slow = f"prefill to L={fmt_size(L)} took {prefill['prefill_s']:.0f} s > budget {s.case_budget_s:g} s"
                    if B == 1:  # the prefill's columns, also when the decoding below is skipped
                        for k, v in prefill.items():
                            setattr(row, k, v)
                        row.prefill_tokens_per_s = row.prefill_tokens / row.prefill_s
                    else:
                        row.state_mib = prefill["state_mib"]
                        row.note = f"{note}; {REPLICATED}" if note else REPLICATED
                    _run_case(row, measure, prompts.need, device)
                else:
                    _run_case(row, measure, lambda r: _anchor_need(cfg, r), device)
            except SkipPreset as e:
                row.status = f"skipped: {e}"
                stop[B, path] = str(e)
            except Exception as e:
                failed_prefill = ours and decode_case is None and prefill == {}
                if common.is_oom(e):
                    row.status = "OOM"
                    why = f"OOM at L={fmt_size(L)}"
                else:
                    row.status = f"error: {common.one_line(e)}"
                    why = f"error at L={fmt_size(L)}"
                if failed_prefill:  # no state at this L: every path's longer contexts go
                    why = f"prefill {why}"
                    stop = {k: v or why for k, v in stop.items()}
                    prefill = None
                stop[B, path] = why
                row.token_ms = row.tokens_per_s = None
                row.peak_mib = common.peak_mib(device)
                del e
            if row.status != "ok" and not row.status.startswith("skipped"):
                common.free_memory(device)  # outside the except block: the traceback no longer pins the tensors
            emit(row)
        if slow:
            stop = {k: v or slow for k, v in stop.items()}


def bench_decode(s, on_row: Callable = lambda r: None, decode_case: Callable | None = None) -> list:
    """Decoding rows for every preset x decoding context x batch size x path of ``s`` (see the module
    docstring).  ``decode_case(row, model, settings, device, amp)`` replaces one row's measurement (tests)."""
    device = torch.device(s.device)
    amp = common.autocast_for(s.dtype, device)
    rows: list = []

    def emit(r) -> None:
        rows.append(r)
        on_row(r)

    for name in s.presets:
        try:
            if "@" in name or name.endswith("+compile"):
                raise SkipPreset("a training row (the step it names is a training step)")
            cfg, note = common.preset_config(name, max(s.decode_contexts) + s.decode_steps + 1, device)
        except SkipPreset as e:
            for L in s.decode_contexts:
                for B in s.decode_batch:
                    emit(common.DecodeRow(name, None, L, B, status=f"skipped: {e}"))
            continue
        torch.manual_seed(0)
        model = None
        try:
            model = common.build_model(cfg, device).eval()
            _contexts(model, s, device, amp, name, cfg, note, emit, decode_case)
        except Exception as e:  # building the model failed (OOM or otherwise): one row per context
            status = "OOM" if common.is_oom(e) else f"error: {common.one_line(e)}"
            done = {(r.L, r.batch) for r in rows if r.preset == name}
            for L in s.decode_contexts:
                for B in s.decode_batch:
                    if (L, B) not in done:
                        emit(common.DecodeRow(name, cfg.family, L, B, status=status, impl=common.impl_name(cfg),
                                              note=note))
            del e
        del model
        common.free_memory(device)
    return rows


__all__ = ["PATHS", "Prompts", "bench_decode", "decode_paths", "memory_skip"]
