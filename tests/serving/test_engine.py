"""The continuous-batching engine (``lintime.serving``): on every family's tiny model (fp32, CPU), a
request's greedy tokens are the same in a batch of staggered requests, alone, and from
``lintime.generation.generate``; chunked prefill gives the same tokens and lets running requests go on
between its pieces; seeded sampling does not depend on the batch; stop strings, eos, max_tokens;
cancel, queue limits, shutdown, validation; errors end a request, not the engine; asyncio consumers.
Every wait has a timeout, so a hang fails."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from tiny_presets import FAMILY_TINY_PRESETS, small_chunks

import lintime.serving.engine as engine_module
from lintime.data import ByteTokenizer
from lintime.generation import GenerationConfig, generate
from lintime.models import CausalLM, get_preset
from lintime.serving import Engine, EngineClosed, QueueFull, Request

TOK = ByteTokenizer()
# the byte tokenizer without an eos: a sampled request (random weights) then runs to max_tokens
NO_EOS = type("NoEosTokenizer", (ByteTokenizer,), {"eos_id": None})()
WAIT = 60  # seconds any one wait may take before the test fails
_MODELS: dict = {}


def tiny(preset: str, **changes) -> CausalLM:
    """``preset`` (``+fta``: FLASH with first-to-all, whose state holds a KV cache) with the byte vocabulary
    and chunks of 8, random weights (seed 0)."""
    key = (preset, tuple(sorted(changes.items())))
    if key not in _MODELS:
        name, _, extra = preset.partition("+")
        cfg = small_chunks(get_preset(name, vocab_size=ByteTokenizer.vocab_size, **changes))
        if extra == "fta":
            cfg = dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, first_to_all=True))
        torch.manual_seed(0)
        _MODELS[key] = CausalLM(cfg).eval()
    return _MODELS[key]


def engine(model, tokenizer=TOK, **kw) -> Engine:
    kw.setdefault("capacity", 128)
    return Engine(model, tokenizer, **kw).start()


def collect(handle):
    """``(token ids, text, finish_reason, events)`` of a handle, blocking."""
    events = list(handle.iter(timeout=WAIT))
    ids = [t for e in events for t in e.token_ids]
    return ids, "".join(e.text for e in events), events[-1].finish_reason, events


def reference(model, prompt: str, max_tokens: int, tokenizer=TOK, **sampling):
    """``lintime generate``'s tokens, text and finish reason (its ``"eos"`` is the engine's ``"stop"``)."""
    cfg = GenerationConfig(max_new_tokens=max_tokens, **({"temperature": 0} | sampling))
    s = generate(model, tokenizer, prompt, cfg)[0]
    return s.token_ids, s.text, {"eos": "stop"}.get(s.finish_reason, s.finish_reason)


PROMPTS = [("The quick brown fox " * 3)[: 1 + 3 * i] + str(i) for i in range(16)]  # 2..47 characters
MAX_TOKENS = [3 + (5 * i) % 9 for i in range(16)]  # 3..11


@pytest.mark.parametrize("preset", [*FAMILY_TINY_PRESETS, "flash-tiny+fta"])
def test_staggered_batch_equals_alone_equals_generate(preset):
    m = tiny(preset)
    requests = [Request(p, max_tokens=n, temperature=0) for p, n in zip(PROMPTS, MAX_TOKENS)]
    eng = engine(m, max_batch=4 + len(preset) % 5, prefill_chunk=16)  # 4..8 slots: requests queue
    try:
        handles, streams = [], []
        for wave in (requests[:5], requests[5:11], requests[11:]):
            handles += [eng.submit(r) for r in wave]
            streams.append(handles[-1].iter(timeout=WAIT))
            next(streams[-1])  # the wave's last request has its first token: the next wave joins a running batch
        batched = [collect(h)[:3] for h in handles]
        stats = eng.stats()
    finally:
        eng.shutdown(timeout=WAIT, cancel=True)
    drawn = sum(len(ids) for ids, _, _ in batched)
    assert stats["tokens_generated"] == drawn and stats["requests_finished"] == 16
    assert stats["steps"] < drawn - 16, "the requests were not decoded together"
    solo = engine(m, max_batch=1)  # one slot: each request runs alone
    try:
        alone = [collect(solo.submit(r))[:3] for r in requests]
    finally:
        solo.shutdown(timeout=WAIT)
    for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        assert batched[i] == alone[i] == reference(m, p, n), f"{preset} request {i}"


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "flash-tiny"])
def test_chunked_prefill_same_tokens_and_interleaved(preset):
    m = tiny(preset)
    long_prompt = "".join(chr(97 + (7 * i) % 26) for i in range(100))  # 101 tokens with bos: 13 pieces of 8
    whole = engine(m, prefill_chunk=512)
    try:
        expected = collect(whole.submit(Request(long_prompt, max_tokens=6, temperature=0)))[:3]
    finally:
        whole.shutdown(timeout=WAIT)
    assert expected == reference(m, long_prompt, 6)

    eng = engine(m, prefill_chunk=8)
    try:
        a = eng.submit(Request("a running request", max_tokens=40, temperature=0))
        a_events = a.iter(timeout=WAIT)
        a_first = next(a_events)
        submitted = time.perf_counter()
        b = eng.submit(Request(long_prompt, max_tokens=6, temperature=0))
        b_ids, b_text, b_reason, b_events = collect(b)
        a_rest = list(a_events)
    finally:
        eng.shutdown(timeout=WAIT, cancel=True)
    assert (b_ids, b_text, b_reason) == expected
    # B's prompt took 13 loop iterations; each decoded one token of A after its piece of B's prompt
    between = [e for e in a_rest if submitted < e.time < b_events[0].time]
    assert len(between) >= 12, f"A got {len(between)} tokens while B's prompt was prefilled (13 pieces)"
    a_ref = reference(m, "a running request", 40)
    assert len(a_ref[0]) >= 20  # A runs for the whole prefill of B
    assert ([t for e in [a_first, *a_rest] for t in e.token_ids], "".join(e.text for e in [a_first, *a_rest]),
            a_rest[-1].finish_reason) == a_ref


def test_seeded_sampling_alone_equals_batch_equals_generate():
    m = tiny("gla-tiny")
    sampled = dict(temperature=0.8, top_k=40, top_p=0.9)
    req = Request("Once upon a time", max_tokens=12, seed=123, **sampled)
    eng = engine(m, max_batch=4)
    try:
        alone = collect(eng.submit(req))[:3]
        others = [eng.submit(Request(f"noise {i}", max_tokens=12, temperature=[0, 1.3, 0.8][i % 3], seed=i))
                  for i in range(5)]
        batched = collect(eng.submit(req))[:3]
        for h in others:
            assert h.result(timeout=WAIT)[1] == "length"
        unseeded = {collect(eng.submit(dataclasses.replace(req, seed=None)))[0] == alone[0] for _ in range(3)}
    finally:
        eng.shutdown(timeout=WAIT, cancel=True)
    assert alone == batched == reference(m, "Once upon a time", 12, seed=123, **sampled)
    assert unseeded != {True}, "requests without a seed drew the same tokens as seed 123"


@pytest.mark.parametrize("change, message", [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=101), "max_tokens"),
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt=[1, 2, 260]), "vocabulary"),
    (dict(prompt=3.5), "prompt must be"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(seed=2**64), "seed"),
    (dict(prompt="x" * 30), "max_prompt_tokens=20"),
])
def test_invalid_requests_raise_value_error(change, message):
    eng = Engine(tiny("gla-tiny"), TOK, max_new_tokens_limit=100, max_prompt_tokens=20)
    with pytest.raises(ValueError, match=message):
        eng.submit(dataclasses.replace(Request("hello"), **change))
    eng.shutdown()


def test_requests_that_cannot_fit_raise_value_error():
    learned = Engine(tiny("linear-tiny", max_positions=32), NO_EOS).start()  # learned positions: at most 32 tokens
    with pytest.raises(ValueError, match=r"prompt has 41 tokens: too long for the model's learned position table \(32"):
        learned.submit(Request("x" * 40))
    with pytest.raises(ValueError, match=r"\(21 tokens\) \+ max_tokens \(16\) = 37 .* learned position table"):
        learned.submit(Request("x" * 20, max_tokens=16))
    assert learned.submit(Request("x" * 20, max_tokens=11)).result(timeout=WAIT)[1] == "length"
    learned.shutdown(timeout=WAIT)
    growing = Engine(tiny("transformer-pp-tiny"), TOK, capacity=48)  # a KV cache of 48 tokens per slot
    with pytest.raises(ValueError, match="capacity of 48 tokens per sequence"):
        growing.submit(Request("x" * 40, max_tokens=10))
    growing.shutdown()
    constant = Engine(tiny("gla-tiny"), NO_EOS, capacity=48).start()  # a constant-size state: capacity bounds nothing
    assert constant.submit(Request("x" * 40, max_tokens=10)).result(timeout=WAIT)[1] == "length"
    constant.shutdown(timeout=WAIT)


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "combiner-tiny", "linear-tiny"])
def test_idle_slot_is_parked_before_it_fills(preset):
    """Slot 0 idles from position 6 (its request: 5 prompt tokens, 2 drawn) while slot 1 decodes 12 more
    steps, up to the capacity of 16 tokens: the idle row would pass the capacity (a KV cache write past its
    end, a position past the learned table) unless it is reset."""
    m = tiny(preset, **({"max_positions": 16} if preset == "linear-tiny" else {}))
    eng = engine(m, max_batch=2, capacity=16)
    try:
        short = eng.submit(Request("abcd", max_tokens=2, temperature=0))
        full = eng.submit(Request("c", max_tokens=14, temperature=0))
        assert collect(short)[:3] == reference(m, "abcd", 2)
        assert collect(full)[:3] == reference(m, "c", 14)
    finally:
        eng.shutdown(timeout=WAIT)


def test_stop_string_across_tokens_and_length():
    m = tiny("flash-tiny")
    _, text, _ = reference(m, "Hello", 12)
    stop = text[5:7]  # two bytes: two tokens
    cut = text.index(stop)
    eng = engine(m)
    try:
        ids, got, reason, events = collect(eng.submit(Request("Hello", max_tokens=12, temperature=0,
                                                              stop=["never appears", stop])))
        assert (got, reason) == (text[:cut], "stop")
        assert len(ids) == len(text[: cut + 2].encode()) and events[-1].completion_tokens == len(ids)
        assert all(stop not in e.text for e in events)
        ids, got, reason, _ = collect(eng.submit(Request("Hello", max_tokens=12, temperature=0, echo=True)))
        assert (got, reason, len(ids)) == ("Hello" + text, "length", 12)
    finally:
        eng.shutdown(timeout=WAIT)


def test_eos_ends_with_stop():
    m = tiny("gla-tiny")
    ids, _, _ = reference(m, "Hello", 10)
    tokenizer = type("EosTokenizer", (ByteTokenizer,), {"eos_id": ids[4]})()  # the 5th greedy token is eos
    eng = engine(m, tokenizer)
    try:
        got = collect(eng.submit(Request("Hello", max_tokens=10, temperature=0)))[:3]
    finally:
        eng.shutdown(timeout=WAIT)
    assert got == reference(m, "Hello", 10, tokenizer)
    assert got[2] == "stop" and len(got[0]) == ids.index(ids[4]) + 1


def test_cancel_frees_the_slot_for_a_waiting_request():
    eng = engine(tiny("gla-tiny"), NO_EOS, max_batch=1)
    try:
        a = eng.submit(Request("long", max_tokens=4000))
        first = a.iter(timeout=WAIT)
        next(first)
        b = eng.submit(Request("waiting", max_tokens=3))
        assert eng.stats()["waiting"] == 1
        a.cancel()
        assert b.result(timeout=WAIT)[1] == "length"
        text, reason, usage = a.result(timeout=WAIT)
        assert reason == "cancelled" and 1 <= usage["completion_tokens"] < 4000
        assert eng.stats()["free_slots"] == 1
    finally:
        eng.shutdown(timeout=WAIT)


def test_queue_full_and_cancel_before_a_slot():
    eng = engine(tiny("gla-tiny"), NO_EOS, max_batch=1, max_queue=2)
    try:
        a = eng.submit(Request("a", max_tokens=4000))
        b = eng.submit(Request("b", max_tokens=4000))
        with pytest.raises(QueueFull, match="max_queue=2"):
            eng.submit(Request("c"))
        b.cancel()  # still waiting for the slot
        assert b.result(timeout=WAIT) == ("", "cancelled", {"prompt_tokens": 2, "completion_tokens": 0,
                                                             "total_tokens": 2})
        c = eng.submit(Request("c", max_tokens=2))  # room again
        a.cancel()
        assert c.result(timeout=WAIT)[1] == "length"
    finally:
        eng.shutdown(timeout=WAIT)


def test_shutdown_finishes_in_flight_requests_then_refuses():
    m = tiny("transformer-pp-tiny")
    eng = engine(m, max_batch=2)
    handles = [eng.submit(Request(p, max_tokens=6, temperature=0)) for p in PROMPTS[:4]]
    eng.shutdown(timeout=WAIT)
    for h, p in zip(handles, PROMPTS):
        assert collect(h)[:3] == reference(m, p, 6)
    with pytest.raises(EngineClosed):
        eng.submit(Request("late"))
    with pytest.raises(EngineClosed):
        eng.start()
    eng.shutdown()  # again: nothing to do


def test_shutdown_cancel_ends_requests_and_never_started_engine():
    eng = engine(tiny("gla-tiny"), NO_EOS, max_batch=2)
    handles = [eng.submit(Request(p, max_tokens=4000)) for p in PROMPTS[:3]]  # one waits for a slot
    next(handles[0].iter(timeout=WAIT))
    eng.shutdown(timeout=WAIT, cancel=True)
    assert [h.result(timeout=0)[1] for h in handles] == ["cancelled"] * 3
    idle = Engine(tiny("gla-tiny"), NO_EOS)  # never started: shutdown still ends what was queued
    queued = idle.submit(Request("queued", max_tokens=3))
    idle.shutdown(timeout=WAIT)
    assert queued.result(timeout=0)[1] == "length"


def test_errors_end_the_request_not_the_engine(monkeypatch):
    m = tiny("transformer-pp-tiny")
    eng = engine(m, max_batch=4)
    real_prefill, real_step = engine_module.prefill, eng._slots.step

    def broken_prefill(model, ids, *args, **kw):
        if ids[0, -1] == ord("!"):
            raise RuntimeError("bad prompt")
        return real_prefill(model, ids, *args, **kw)

    monkeypatch.setattr(engine_module, "prefill", broken_prefill)
    try:
        good = eng.submit(Request("fine", max_tokens=8, temperature=0))
        bad = eng.submit(Request("boom!", max_tokens=8))
        assert collect(good)[:3] == reference(m, "fine", 8)
        _, _, usage = bad.result(timeout=WAIT)
        assert bad.result()[1] == "error" and "prefill: RuntimeError: bad prompt" in usage["error"]

        calls = []

        def failing_step(n):
            calls.append(n)
            if len(calls) == 2:
                raise RuntimeError("device fault")
            return real_step(n)

        eng._slots.step = failing_step
        hit = [eng.submit(Request(p, max_tokens=5, temperature=0)) for p in PROMPTS[:2]]
        results = [h.result(timeout=WAIT) for h in hit]
        assert {r[1] for r in results} == {"error"} and "device fault" in results[0][2]["error"]
        after = eng.submit(Request("after", max_tokens=6, temperature=0))  # the engine goes on, rows reset
        assert collect(after)[:3] == reference(m, "after", 6)
    finally:
        eng.shutdown(timeout=WAIT, cancel=True)


def test_async_consumers():
    m = tiny("mc-tfm-pp-tiny")
    eng = engine(m, NO_EOS, max_batch=4)

    async def consume(h):
        texts, reasons = [], []
        async for ev in h.events():
            texts.append(ev.text)
            reasons.append(ev.finish_reason)
        return "".join(texts), reasons

    async def main():
        handles = [eng.submit(Request(p, max_tokens=n, temperature=0)) for p, n in zip(PROMPTS[:4], MAX_TOKENS)]
        outs = await asyncio.wait_for(asyncio.gather(*(consume(h) for h in handles)), WAIT)
        # a consumer cancelled while it waits (the client went away) cancels its request
        long = eng.submit(Request("long", max_tokens=4000))
        task = asyncio.create_task(consume(long))
        await asyncio.wait_for(asyncio.to_thread(lambda: next(long.iter(timeout=WAIT))), WAIT)
        task.cancel()  # the task waits for the next event
        with pytest.raises(asyncio.CancelledError):
            await task
        return outs, await asyncio.wait_for(asyncio.to_thread(long.result, WAIT), WAIT)

    try:
        outs, cancelled = asyncio.run(main())
    finally:
        eng.shutdown(timeout=WAIT, cancel=True)
    for (text, reasons), p, n in zip(outs, PROMPTS, MAX_TOKENS):
        assert text == reference(m, p, n, NO_EOS)[1]
        assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] == "length"
    assert cancelled[1] == "cancelled"
