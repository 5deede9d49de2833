"""Static decoding (``lintime.generation.static``): full-sequence logits equal prefill plus
token-by-token decoding through the in-place state buffers, for every family, with the prefill cut
at odd positions, rows reordered and dropped mid-way; a static step has no host read and keeps its
storage; generation through the static path equals the eager path token for token."""

from __future__ import annotations

import pytest
import torch
from static_helpers import SMALL, family_presets, small_model

from lintime.data import ByteTokenizer
from lintime.generation import GenerationConfig, generate, prefill
from lintime.generation.profiling import count_host_syncs
from lintime.generation.static import StaticDecoder
from tolerances import assert_exact

PRESETS = family_presets()
_MODELS: dict = {}


def model(preset):
    if preset not in _MODELS:
        _MODELS[preset] = small_model(preset)
    return _MODELS[preset]


def _prefill_at(m, ids, cuts):
    """Prefill ``ids [B, T]`` in pieces ending at ``cuts`` (then the rest), odd chunk sizes."""
    state, logits, start = None, None, 0
    for end in [*cuts, ids.shape[1]]:
        logits, state = prefill(m, ids[:, start:end], state, chunk_size=3)
        start = end
    return logits, state


@pytest.mark.parametrize("preset", PRESETS)
def test_full_sequence_equals_prefill_plus_static_decoding(preset):
    m = model(preset)
    T = 3 * SMALL + 5  # the steps cross three chunk / block / row boundaries
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, T), generator=g)
    with torch.no_grad():
        full = m(ids)  # [3, T, V]
        for cuts in ([], [5], [3, 11]):
            P = 1 + (cuts[-1] if cuts else 6)
            logits, state = _prefill_at(m, ids[:, :P], cuts)
            assert_exact(f"{preset} prefill {cuts}", full[:, P - 1], logits)
            dec = StaticDecoder(m, state, capacity=T)
            ptrs = [t.data_ptr() for t in dec.buffers()]
            for t in range(P, T):
                out = dec.step(ids[:, t])
                assert_exact(f"{preset} cuts {cuts} step {t}", full[:, t], out)
            assert dec.state.offset.tolist() == [T] * 3
            assert [t.data_ptr() for t in dec.buffers()] == ptrs  # updated in place


@pytest.mark.parametrize("preset", PRESETS)
def test_static_reorder_and_select_continue_the_right_rows(preset):
    m = model(preset)
    T, P, swap, drop = 2 * SMALL + 7, 5, 9, 17
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (3, T), generator=g)
    perm = torch.tensor([2, 0, 0])  # beams: rows may repeat
    keep = torch.tensor([2, 0])
    with torch.no_grad():
        _, state = prefill(m, ids[:, :P])
        dec = StaticDecoder(m, state, capacity=T)
        for t in range(P, swap):
            dec.step(ids[:, t])
        dec.reorder_(perm)
        rows = ids[perm]
        for t in range(swap, drop):
            out = dec.step(rows[:, t])
        ref = m(torch.cat([ids[perm, :swap], rows[:, swap:drop]], 1))[:, -1]
        assert_exact(f"{preset} after reorder", ref, out)
        small = dec.select(keep)
        assert small.batch_size == 2
        assert not {t.data_ptr() for t in small.buffers()} & {t.data_ptr() for t in dec.buffers()}
        for t in range(drop, T):
            out = small.step(rows[keep, t])
        ref = m(torch.cat([ids[perm, :swap], rows[:, swap:]], 1)[keep])[:, -1]
        assert_exact(f"{preset} after select", ref, out)


@pytest.mark.parametrize("preset", PRESETS)
def test_static_step_reads_nothing_back_from_the_device(preset):
    m = model(preset)
    with torch.no_grad():
        logits, state = prefill(m, torch.randint(0, 256, (2, 5)))
        dec = StaticDecoder(m, state, capacity=5 + 2 * SMALL + 1)
        tok = logits.argmax(-1)
        for step in range(2 * SMALL + 1):  # crosses two chunk / block / row boundaries
            with count_host_syncs() as c:
                logits = dec.step(tok)
            assert (c.total, c.h2d) == (0, 0), f"{preset} step {step}: {dict(c.counts)}, {c.h2d} h2d"
            tok = logits.argmax(-1)


def test_static_state_refuses_a_step_past_its_capacity():
    m = model("transformer-pp-tiny")
    with torch.no_grad():
        _, state = prefill(m, torch.randint(0, 256, (1, 4)))
        dec = StaticDecoder(m, state, capacity=5)
        dec.step(torch.tensor([1]))
        with pytest.raises(IndexError):
            dec.step(torch.tensor([1]))
        with pytest.raises(ValueError, match="capacity 3 is below"):
            StaticDecoder(m, state, capacity=3)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_generation_equals_eager_generation(preset, temperature):
    m, tok = model(preset), ByteTokenizer()
    base = dict(max_new_tokens=2 * SMALL + 3, temperature=temperature, top_k=40, top_p=0.9, num_samples=2,
                seed=3, stop_at_eos=False, prefill_chunk=3)
    eager = generate(m, tok, ["ab", "hello"], GenerationConfig(decode="eager", **base))
    static = generate(m, tok, ["ab", "hello"], GenerationConfig(decode="static", **base))
    assert [s.token_ids for s in static] == [s.token_ids for s in eager]
    assert [s.text for s in static] == [s.text for s in eager]
