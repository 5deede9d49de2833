"""The serving engine's host work per decoding iteration, on the CPU: ``--requests`` completions of a tiny model
decoded together, with the model's decoding step replaced by a table look-up (``--step fake``, the default: the
logits of step ``t`` are a fixed table's, so the step itself costs nothing and each row's tokens are a known text,
multi-byte characters included) or the real tiny model (``--step model``).  What is left is what the engine's loop
thread does around the step: sampling and its read-back, detokenising, stop strings, bookkeeping, events.

The events are read as ``lintime serve`` reads them: ``--consumer asyncio`` (default) runs one asyncio event loop on
its own thread with one task per request iterating :meth:`Handle.events`; ``threads`` one blocking reader thread per
request; ``none`` reads nothing until the end.

Reported per decoding iteration at full batch (every request running), median over ``--rounds`` rounds: the wall
time and the loop thread's CPU time of one iteration (``iteration``), of the decoding step alone (``step``), and of
the engine's phases, timed by wrapping whichever of the functions in ``PHASES`` the engine has (a phase's time
includes the wrappers' own ~0.5 us per call; ``--no-phases``: none).  ``--profile FILE`` also writes a cProfile of
the loop thread's full-batch iterations.

    python3 benchmarks/engine_host_bench.py --requests 64 --new-tokens 256 --stop "never here"
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import pstats
import statistics
import threading
import time

import torch

import lintime.serving.engine as engine_module
from lintime.data import ByteTokenizer
from lintime.generation import Detokenizer, StopMatcher
from lintime.models import CausalLM, get_preset
from lintime.serving import Engine, Request
from lintime.serving.request import Handle

# a completion text with one-, two-, three- and four-byte characters: the byte tokenizer splits them over tokens
TEXT = "def parse(line): return [tok for tok in line.split() if tok] # naïve, café, 東京, 🙂 ok\n"

# (phase, owner, attribute): the functions whose time is reported, where they exist -- ``take`` (a request's
# token to its event, all requests of a step where the engine has ``_take_all``) includes ``detok``, ``stop`` and
# ``publish`` (the events to the handles: per request by ``Handle._publish``, or per step by ``publish``)
PHASES = [
    ("step", "slots", "decode_step"),
    ("step_wrapper", "slots", "step"),
    ("draw", "engine", "_draw"),
    ("take", "engine", "_take"),
    ("take", "engine", "_take_all"),
    ("detok", Detokenizer, "push"),
    ("stop", StopMatcher, "push"),
    ("publish", Handle, "_publish"),
    ("publish", engine_module, "publish"),
]


def fake_step(table: torch.Tensor):
    """A decoding step that returns row ``s``'s logits of its own step count from ``table [T, B, V]``."""
    count = [0]

    def decode_step(n: int) -> torch.Tensor:
        count[0] += 1
        return table[count[0] % table.shape[0], :n]

    return decode_step


def logits_table(steps: int, batch: int, vocab: int) -> torch.Tensor:
    """``[steps, batch, V]``: row ``b`` at step ``t`` peaks at byte ``(7 b + t) mod len`` of ``TEXT``."""
    data = torch.tensor(list(TEXT.encode()))
    t = torch.arange(steps)[:, None]
    b = torch.arange(batch)[None, :]
    ids = data[(7 * b + t) % len(data)]  # [T, B]
    table = torch.randn(steps, batch, vocab) * 0.1
    table.scatter_(-1, ids[..., None], 10.0)
    return table


class Timer:
    """Accumulates wall and thread-CPU seconds per phase while ``on``."""

    def __init__(self):
        self.on = False
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - w
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def consume(handles, how: str):
    """Start reading the handles' events as ``how`` says; return a function that waits for the end."""
    if how == "none":
        return lambda: [h.result(timeout=600) for h in handles]
    if how == "threads":
        threads = [threading.Thread(target=lambda h=h: list(h.iter(timeout=600))) for h in handles]
        for t in threads:
            t.start()
        return lambda: [t.join() for t in threads]

    async def one(h):
        async for _ in h.events():
            pass

    async def main():
        await asyncio.gather(*(one(h) for h in handles))

    t = threading.Thread(target=asyncio.run, args=(main(),))
    t.start()
    return t.join


def one_round(eng: Engine, args, timer: Timer, profile: cProfile.Profile | None) -> dict:
    iters = {"wall": [], "cpu": []}
    decode = eng._decode
    running = eng._running

    def timed_decode():
        full = len(running) == args.requests
        if not full:
            return decode()
        timer.on = True
        if profile is not None:
            profile.enable()
        w, c = time.perf_counter(), time.thread_time()
        try:
            return decode()
        finally:
            iters["wall"].append(time.perf_counter() - w)
            iters["cpu"].append(time.thread_time() - c)
            if profile is not None:
                profile.disable()
            timer.on = False

    eng._decode = timed_decode
    timer.wall.clear(), timer.cpu.clear(), timer.calls.clear()
    prompt = "The quick brown fox"
    requests = [Request(prompt, max_tokens=args.new_tokens, temperature=0 if i >= args.sampled else 0.8,
                        top_k=40 if i < args.sampled else 0, seed=i, stop=args.stop or ())
                for i in range(args.requests)]
    t0 = time.perf_counter()
    handles = [eng.submit(r) for r in requests]
    consume(handles, args.consumer)()
    wall = time.perf_counter() - t0
    del eng._decode
    n = len(iters["wall"])
    us = lambda s: round(1e6 * s / max(n, 1), 1)  # noqa: E731
    texts = [h.result(timeout=0)[0] for h in handles]
    return {"iterations": n, "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(e.completion_tokens for h in handles for e in h._events[-1:]) / wall),
            "iteration_us": {"wall": us(sum(iters["wall"])), "cpu": us(sum(iters["cpu"]))},
            "phases_us": {k: {"wall": us(timer.wall[k]), "cpu": us(timer.cpu[k]), "calls_per_iteration":
                              round(timer.calls[k] / max(n, 1), 2)} for k in sorted(timer.wall)},
            "text_chars": sum(map(len, texts))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gla-tiny")
    p.add_argument("--d-model", type=int, default=32, help="the tiny model's width (--step model)")
    p.add_argument("--step", choices=("fake", "model"), default="fake")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--sampled", type=int, default=0, help="how many of the requests sample (temperature 0.8, top-k 40)")
    p.add_argument("--stop", action="append", help="a stop string every request carries (repeatable)")
    p.add_argument("--consumer", choices=("asyncio", "threads", "none"), default="asyncio")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-phases", dest="phases", action="store_false",
                   help="time whole iterations only (no wrapper around the phases' functions)")
    p.add_argument("--profile", help="write a cProfile of the loop thread's full-batch iterations here (.prof)")
    p.add_argument("--sort", default="tottime")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    tok = type("NoEos", (ByteTokenizer,), {"eos_id": None})()  # every request runs to --new-tokens
    cfg = get_preset(args.preset, vocab_size=tok.vocab_size)
    if args.step == "model":
        cfg = get_preset(args.preset, vocab_size=tok.vocab_size, d_model=args.d_model)
    model = CausalLM(cfg).eval()
    eng = Engine(model, tok, max_batch=args.requests, capacity=args.new_tokens + 64)
    timer = Timer()
    owners = {"engine": eng, "slots": eng._slots}
    if args.step == "fake":
        eng._slots.decode_step = fake_step(logits_table(args.new_tokens + 1, args.requests, tok.vocab_size))
    for name, owner, attr in PHASES if args.phases else ():
        owner = owners.get(owner, owner)
        if hasattr(owner, attr):
            setattr(owner, attr, timer.wrap(name, getattr(owner, attr)))
    eng.start()
    profile = cProfile.Profile() if args.profile else None
    try:
        rows = [one_round(eng, args, timer, profile) for _ in range(args.rounds)]
    finally:
        eng.shutdown(timeout=60)
    for r in rows:
        print(json.dumps(r))
    med = lambda f: round(statistics.median(f(r) for r in rows), 1)  # noqa: E731
    summary = {"settings": {k: v for k, v in vars(args).items() if k not in ("profile", "sort")},
               "iteration_us": {k: med(lambda r: r["iteration_us"][k]) for k in ("wall", "cpu")},
               "phases_us": {ph: {k: med(lambda r: r["phases_us"][ph][k]) for k in ("wall", "cpu")}
                             for ph in rows[0]["phases_us"]},
               "tokens_per_s": med(lambda r: r["tokens_per_s"])}
    print(json.dumps(summary))
    if profile is not None:
        profile.dump_stats(args.profile)
        pstats.Stats(args.profile).sort_stats(args.sort).print_stats(30)


if __name__ == "__main__":
    main()
