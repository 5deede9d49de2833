"""The decoding rows of ``lintime bench model``: ms per token at each context ``L``, per decoding path.

One model per preset; the decoding state is built by chunked :func:`lintime.generation.prefill` and
carried from one context to the next (the state at ``L = 1k`` is continued to ``2k``, ...: states are
values, so the timed steps never alter it).  At each ``L``, one row per path (``Settings.decode_paths``):

* ``eager`` -- :func:`lintime.generation.decode_one_token` timed for ``decode_steps`` tokens fed one
  after the other (a Python call per token, a new state object per step);
* ``graph`` -- what ``lintime generate`` runs on CUDA: the state copied into fixed buffers
  (:class:`~lintime.generation.static.StaticDecoder`, a KV cache at a capacity of ``L`` + the steps),
  one greedy step (argmax, feed, logits kept) captured in a CUDA graph
  (:class:`~lintime.generation.graphs.DecodeLoop`), each timed step one replay; needs CUDA (a
  ``skipped`` row elsewhere); a capture failure is the row's error.

Anchors (:mod:`lintime.bench.anchors`) decode by the library's ``generate`` (greedy) from a fresh
``L``-token prompt: ``eager`` with its default cache; for ``hf:llama-*``, where ``graph`` rows are
asked for, also ``static-compiled``: ``cache_implementation="static"`` (one cache length for every
``L``) with the forward ``torch.compile``'d by HF's generate (its default on CUDA for a static
cache; a ``skipped`` row on other devices).

Every row records ``path``; the prefill fields of the rows of one ``L`` are those of the one
prefill they share.  A failing path skips its own longer contexts; a failing prefill, all of them.
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


def decode_paths(spec: str, device: torch.device) -> tuple[str, ...]:
    """``--decode-path``: ``eager``, ``graph``, ``both``, or ``auto`` (``both`` on CUDA, ``eager`` elsewhere)."""
    table = {"eager": ("eager",), "graph": ("graph",), "both": PATHS}
    if spec == "auto":
        return PATHS if device.type == "cuda" else ("eager",)
    if spec not in table:
        raise ValueError(f"--decode-path must be one of auto, eager, graph, both; got {spec!r}")
    return table[spec]


class CarriedState:
    """Ours: :meth:`extend` prefills the carried state from the previous context to ``row.L``; then
    :meth:`eager` / :meth:`graph` time the steps from it without altering it."""

    def __init__(self, model, cfg, s, device: torch.device, amp):
        self.model, self.cfg, self.s, self.device, self.amp = model, cfg, s, device, amp
        self.g = torch.Generator().manual_seed(1)
        self.state, self.logits, self.have = None, None, 0

    def extend(self, row) -> None:
        from lintime.generation import prefill
        from lintime.generation.decode import state_nbytes

        model, s, device, Bd = self.model, self.s, self.device, self.s.decode_batch
        t0 = time.perf_counter()
        ids = torch.randint(0, self.cfg.vocab_size, (Bd, row.L - self.have), generator=self.g).to(device)
        with torch.no_grad(), autocast(device, self.amp):
            self.logits, self.state = prefill(model, ids, self.state, chunk_size=s.prefill_chunk)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row.prefill_tokens = row.L - self.have
        self.have = row.L
        row.prefill_s = time.perf_counter() - t0
        row.state_mib = state_nbytes(self.state) / Bd / 2**20

    def eager(self, row) -> list[float]:
        from lintime.generation import decode_one_token

        model, s, device, amp, Bd = self.model, self.s, self.device, self.amp, self.s.decode_batch
        tokens = torch.randint(0, self.cfg.vocab_size, (s.decode_steps + 1, Bd), generator=self.g).to(device)
        cur = {"state": self.state, "i": 0}

        def one() -> None:
            with torch.no_grad(), autocast(device, amp):
                _, cur["state"] = decode_one_token(model, tokens[cur["i"]], cur["state"])
            cur["i"] += 1

        with torch.no_grad(), autocast(device, amp):  # untimed: first-call compilation
            decode_one_token(model, tokens[-1], self.state)
        common.reset_peak(device)
        return call_times_ms(one, s.decode_steps, device, budget_s=s.case_budget_s)

    def graph(self, row) -> list[float]:
        from lintime.generation.decode import state_nbytes
        from lintime.generation.graphs import DecodeLoop
        from lintime.generation.static import StaticDecoder

        s, device, Bd = self.s, self.device, self.s.decode_batch
        if device.type != "cuda":
            raise SkipPreset(f"CUDA graphs need a CUDA device (device {device})")
        steps = GRAPH_WARMUP + s.decode_steps
        with torch.no_grad(), autocast(device, self.amp):
            dec = StaticDecoder(self.model, self.state, row.L + steps + 1)
            loop = DecodeLoop(dec, self.logits, torch.zeros(Bd, dtype=torch.long, device=device), steps,
                              graph=True, temperature=0.0)  # a capture failure raises: the row's error
            for _ in range(GRAPH_WARMUP):
                loop.advance()
        row.state_mib = state_nbytes(dec.state) / Bd / 2**20  # the static buffers (a KV cache at capacity)
        common.reset_peak(device)
        times = call_times_ms(loop.advance, s.decode_steps, device, budget_s=s.case_budget_s)
        del loop, dec
        return times


def _static_compiled(model, cfg: AnchorSpec, s, device, amp) -> Callable:
    """``measure(row)`` of HF's static cache + compiled forward, or raises :class:`SkipPreset`."""
    if not cfg.name.startswith("hf:"):
        raise SkipPreset(f"{cfg.impl.split()[0]} has no static-cache compiled generate here")
    if device.type != "cuda":
        raise SkipPreset(f"HF compiles the static-cache forward on CUDA only (device {device})")
    longest = max(s.decode_contexts) + s.decode_steps + 2  # one cache length for every L: no recompilation
    return anchors.generate_measure(model, cfg, s.decode_steps, s.decode_batch, device, amp,
                                    lambda: common.reset_peak(device), warmup_tokens=4,
                                    generate_kwargs={"cache_implementation": "static", "max_cache_len": longest})


def _measures(model, cfg, s, device, amp) -> tuple[CarriedState | None, dict[str, Callable | str]]:
    """``(carried state or None, {path: measure(row) -> times, or the status of every row of the path})``."""
    out: dict[str, Callable | str] = {}
    if isinstance(cfg, AnchorSpec):
        if "eager" in s.decode_paths:
            out["eager"] = anchors.generate_measure(model, cfg, s.decode_steps, s.decode_batch, device, amp,
                                                    lambda: common.reset_peak(device))
        if "graph" in s.decode_paths:
            try:  # its untimed warm-up compiles: a failure is this path's status, not the preset's
                out["static-compiled"] = _static_compiled(model, cfg, s, device, amp)
            except SkipPreset as e:
                out["static-compiled"] = f"skipped: {e}"
            except Exception as e:  # noqa: BLE001
                out["static-compiled"] = f"error: {common.one_line(e)}"
        return None, out
    carried = CarriedState(model, cfg, s, device, amp)
    for path in s.decode_paths:
        out[path] = getattr(carried, path)
    if "graph" in out and device.type != "cuda":
        out["graph"] = f"skipped: CUDA graphs need a CUDA device (device {device})"
    return carried, out


def _fill(row, times: list[float], device) -> None:
    q = quantiles(times)
    row.token_ms, row.token_p10_ms, row.token_p90_ms = q["median"], q["p10"], q["p90"]
    row.tokens_per_s = row.batch / (q["median"] / 1e3)
    row.peak_mib = common.peak_mib(device)
    row.steps = len(times)
    if row.prefill_s:
        row.prefill_tokens_per_s = row.batch * row.prefill_tokens / row.prefill_s


def _contexts(model, s, device, amp, name, cfg, note, emit, decode_case: Callable | None) -> None:
    params = common.num_parameters(model)
    carried, measures = (None, {p: None for p in s.decode_paths}) if decode_case else _measures(model, cfg, s, device, amp)
    stop: dict[str, str | None] = dict.fromkeys(measures)
    for L in s.decode_contexts:
        prefill: dict = {}
        for path, measure in measures.items():
            row = common.DecodeRow(name, cfg.family, L, s.decode_batch, params=params, impl=common.impl_name(cfg), note=note,
                               path=path)
            if isinstance(measure, str) or stop[path]:
                row.status = measure if isinstance(measure, str) else f"skipped: {stop[path]}"
                emit(row)
                continue
            try:
                if decode_case is not None:
                    decode_case(row, model, s, device, amp)
                else:
                    if carried is not None and not prefill:
                        carried.extend(row)
                        prefill = {k: getattr(row, k) for k in ("prefill_s", "prefill_tokens", "state_mib")}
                    for k, v in prefill.items():
                        setattr(row, k, v)
                    _fill(row, measure(row), device)
                    if row.prefill_s > s.case_budget_s and L != s.decode_contexts[0]:  # the first holds compilation
                        why = f"prefill to L={fmt_size(L)} took {row.prefill_s:.0f} s > budget {s.case_budget_s:g} s"
                        stop = dict.fromkeys(stop, why)
            except SkipPreset as e:
                row.status = f"skipped: {e}"
                stop[path] = str(e)
            except Exception as e:
                extended = carried is None or bool(prefill)  # else the carried state is lost: stop every path
                if common.is_oom(e):
                    row.status = "OOM"
                    why = f"OOM at L={fmt_size(L)}"
                else:
                    row.status = f"error: {common.one_line(e)}"
                    why = f"error at L={fmt_size(L)}"
                if extended:
                    stop[path] = why
                else:
                    stop = dict.fromkeys(stop, why)
                row.token_ms = row.tokens_per_s = None
                row.peak_mib = common.peak_mib(device)
                del e
            if row.status != "ok" and not row.status.startswith("skipped"):
                common.free_memory(device)  # outside the except block: the traceback no longer pins the tensors
            emit(row)


def bench_decode(s, on_row: Callable = lambda r: None, decode_case: Callable | None = None) -> list:
    """Decoding rows for every preset x decoding context x path of ``s`` (see the module docstring).
    ``decode_case(row, model, settings, device, amp)`` replaces one row's measurement (tests)."""
    device = torch.device(s.device)
    amp = common.autocast_for(s.dtype, device)
    rows: list = []

    def emit(r) -> None:
        rows.append(r)
        on_row(r)

    for name in s.presets:
        try:
            cfg, note = common.preset_config(name, max(s.decode_contexts) + s.decode_steps + 1, device)
        except SkipPreset as e:
            for L in s.decode_contexts:
                emit(common.DecodeRow(name, None, L, s.decode_batch, status=f"skipped: {e}"))
            continue
        torch.manual_seed(0)
        model = None
        try:
            model = common.build_model(cfg, device).eval()
            _contexts(model, s, device, amp, name, cfg, note, emit, decode_case)
        except Exception as e:  # building the model failed (OOM or otherwise): one row per context
            status = "OOM" if common.is_oom(e) else f"error: {common.one_line(e)}"
            done = {r.L for r in rows if r.preset == name}
            for L in s.decode_contexts:
                if L not in done:
                    emit(common.DecodeRow(name, cfg.family, L, s.decode_batch, status=status, impl=common.impl_name(cfg),
                                      note=note))
            del e
        del model
        common.free_memory(device)
    return rows


__all__ = ["PATHS", "CarriedState", "bench_decode", "decode_paths"]
