"""The engine's per-step batch work: the text of tokens that split characters (multi-byte UTF-8 over several byte
tokens, stop strings spanning tokens) when many requests are decoded together; one host read per draw whatever the
mix of sampling settings; one wake-up per asyncio event loop for a step's events."""

from __future__ import annotations

import asyncio
import random
import threading
from types import SimpleNamespace

import torch
from test_engine import NO_EOS, WAIT, collect, engine, tiny

import lintime.serving.engine as engine_module
import lintime.serving.request as request_module
from lintime.generation import Detokenizer, StopMatcher
from lintime.generation.sampling import seeded_uniform, seeded_uniform_host
from lintime.serving import Engine, Request
from lintime.serving.engine import _Job
from lintime.serving.request import Event, Handle, publish

# request i's completion, byte by byte: characters of 1 to 4 bytes, and (last) a character cut short
TARGETS = ["naïve café 東京 🙂!", "naïve café 東京 🙂!", "naïve café 東京 🙂!", "ab€"]
TARGET_BYTES = [t.encode() for t in TARGETS[:3]] + [TARGETS[3].encode()[:-1]]


def _peaks(tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]`` logits whose argmax is ``tokens``."""
    logits = torch.zeros(len(tokens), NO_EOS.vocab_size)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return logits


def test_multibyte_characters_and_stop_strings_split_across_tokens(monkeypatch):
    """Requests whose byte tokens spell characters of 2, 3 and 4 bytes, decoded together: each event's text
    holds whole characters only, the texts equal the bytes' decoding (a character cut short by ``max_tokens``
    becomes U+FFFD, as ``decode`` makes it), and a stop string of several tokens (``"東"``: 3 bytes) or spanning
    characters (``"é 東"``) ends its request after its last byte, its text cut before it."""
    m = tiny("gla-tiny")
    real_prefill = engine_module.prefill

    def request_of(last_prompt_token: int) -> int:
        return int(chr(last_prompt_token))  # prompt "i" is request i

    def fake_prefill(model, ids, state=None, chunk_size=None, *, cu_seqlens=None):
        logits, state = real_prefill(model, ids, state, chunk_size, cu_seqlens=cu_seqlens)
        ends = [ids.shape[1] - 1] if cu_seqlens is None else (cu_seqlens[1:] - 1).tolist()
        return _peaks([TARGET_BYTES[request_of(ids[0, e].item())][0] for e in ends]), state

    monkeypatch.setattr(engine_module, "prefill", fake_prefill)
    eng = engine(m, NO_EOS, max_batch=4)

    def fake_step(n: int) -> torch.Tensor:
        tokens = []
        for s in range(n):
            job = eng._running.get(s)
            tokens.append(TARGET_BYTES[request_of(job.ids[-1])][job.drawn] if job is not None else 0)
        return _peaks(tokens)

    eng._slots.decode_step = fake_step
    stops = [(), ("東",), ("never", "é 東"), ()]
    try:
        handles = [eng.submit(Request(str(i), max_tokens=len(TARGET_BYTES[i]), temperature=0, stop=stops[i]))
                   for i in range(4)]
        got = [collect(h) for h in handles]
    finally:
        eng.shutdown(timeout=WAIT, cancel=True)
    assert eng.stats()["steps"] < sum(len(ids) for ids, *_ in got), "the requests were not decoded together"
    for i, (ids, text, reason, events) in enumerate(got):
        shown = [e.text for e in events]
        assert all("\ufffd" not in t for t in shown[:-1]), f"request {i} streamed part of a character: {shown}"
        if i == 0:
            assert (text, reason, bytes(ids)) == (TARGETS[0], "length", TARGET_BYTES[0])
        elif i == 1:
            assert (text, reason, bytes(ids)) == ("naïve café ", "stop", "naïve café 東".encode())
        elif i == 2:
            assert (text, reason, bytes(ids)) == ("naïve caf", "stop", "naïve café 東".encode())
        else:
            assert (text, reason, bytes(ids)) == (NO_EOS.decode(TARGET_BYTES[3]), "length", TARGET_BYTES[3])
            assert text == "ab\ufffd"
        assert events[-1].completion_tokens == len(ids)


def test_one_host_read_per_draw_with_mixed_sampling(monkeypatch):
    """Greedy rows and two groups of sampled rows in one step: their tokens come to the host in one read."""
    eng = engine(tiny("gla-tiny"), NO_EOS, max_batch=8)
    reads, draws = [], []
    counting = threading.local()
    real_tolist, real_draw = torch.Tensor.tolist, eng._draw

    def tolist(self):
        if getattr(counting, "on", False):
            reads[-1] += 1
        return real_tolist(self)

    def draw(jobs, logits, rows=None):
        draws.append({job.sampling for job in jobs})
        reads.append(0)
        counting.on = True
        try:
            return real_draw(jobs, logits, rows)
        finally:
            counting.on = False

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    eng._draw = draw
    settings = [dict(temperature=0), dict(temperature=0.8, top_k=5), dict(temperature=1.3)]
    try:
        handles = [eng.submit(Request(f"row {i}", max_tokens=6, seed=i, **settings[i % 3])) for i in range(6)]
        for h in handles:
            _, reason, usage = h.result(timeout=WAIT)
            assert (reason, usage["completion_tokens"]) == ("length", 6), usage
    finally:
        eng.shutdown(timeout=WAIT)
    assert any(len(keys) == 3 for keys in draws), "no step drew greedy and both sampled groups together"
    assert reads == [1] * len(draws)


def test_publish_wakes_each_event_loop_once():
    """A step's events for 8 requests read by one asyncio event loop: one wake-up of that loop, every reader
    gets its event."""
    handles = [Handle(Request("x"), i, lambda _h: None) for i in range(8)]

    async def first_event(h):
        async for ev in h.events():
            return ev

    async def main():
        loop = asyncio.get_running_loop()
        calls, real = [], loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(a) or real(*a)
        tasks = [asyncio.create_task(first_event(h)) for h in handles]
        while not all(h._waiters for h in handles):  # every reader has parked its future
            await asyncio.sleep(0)
        events = [(h, Event(str(i), [i], None, 1, 1)) for i, h in enumerate(handles)]
        await asyncio.to_thread(publish, events)
        got = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        return calls, got

    calls, got = asyncio.run(main())
    assert [e.text for e in got] == [str(i) for i in range(8)]
    assert len([c for c in calls if c[0] is request_module._resolve]) == 1


def test_stop_text_equals_the_stop_matcher_on_random_streams():
    """The engine's text of a request with stop strings (which skips the matcher while it holds nothing and a
    token brings no character of a stop string) equals a plain :class:`StopMatcher` fed every piece, on random
    byte streams over a small alphabet with multi-byte characters and overlapping stop strings."""
    rng = random.Random(0)
    alphabet = "abé東 "
    for trial in range(200):
        stops = tuple(rng.choice(["ab", "aab", "é東", "東 a", "b b", "éé", "a"][: 2 + trial % 6])
                      for _ in range(1 + trial % 3))
        data = "".join(rng.choice(alphabet) for _ in range(40)).encode()
        job = _Job(None, [1], len(data), 0.0, 0, 1.0, 0, stops, None, Detokenizer(NO_EOS), StopMatcher(stops))
        detok, matcher = Detokenizer(NO_EOS), StopMatcher(stops)
        owner = SimpleNamespace(eos_id=None)
        for token in data:
            job.drawn += 1
            shown, reason = Engine._text(owner, job, token)
            new = detok.push(token)
            if job.drawn == len(data):
                new += detok.flush()
            want, stopped = matcher.push(new)
            if not stopped and job.drawn == len(data):
                want += matcher.flush()
            assert shown == want, (stops, data, job.drawn)
            assert reason == ("stop" if stopped else "length" if job.drawn == len(data) else None)
            if reason is not None:
                break


def test_host_uniforms_equal_the_device_hash():
    """The engine's sampled rows draw with uniform numbers hashed on the host: bit for bit the device hash
    that ``lintime generate`` uses, over seeds of the whole 64-bit range (negative ones included) and steps."""
    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-(2**63), 2**63 - 1, (4000,), generator=gen),
                       torch.tensor([0, 1, -1, 2**32 - 1, 2**32, -(2**63), 2**63 - 1])])
    steps = torch.randint(0, 2**31, seeds.shape, generator=gen)
    steps[:100] = torch.arange(100)
    host = seeded_uniform_host(seeds.tolist(), steps.tolist())
    assert torch.equal(torch.from_numpy(host), seeded_uniform(seeds, steps))
    assert 0 <= host.min() and host.max() < 1 and len(set(host.tolist())) > 3990
