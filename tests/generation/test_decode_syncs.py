"""Host work of one decoded token (``docs/design/kernels.md``, "Decoding: host work per token"):
the number of device->host syncs and host->device tensor constructions per
:func:`decode_one_token`, pinned per family so
a regression (a ``.tolist()`` / ``.item()`` / ``bool(tensor)`` / ``torch.tensor(list)`` back on
the decoding path) fails here.  Counted with :func:`lintime.generation.profiling.count_host_syncs`
on CPU tensors, where a "sync" is the call that would make the host wait on CUDA.

The value checks that a decoding step skips (a state the op returned itself) still run once on
a state that did not come from the op, and again after an in-place edit."""

import dataclasses

import pytest
import torch
from gen_helpers import FAMILY_PRESETS, SMALL_CHUNKS, tiny_model

from lintime.generation import decode_one_token, prefill
from lintime.generation.profiling import count_host_syncs
from lintime.models import CausalLM, get_preset
from lintime.ops import MixedChunkState, mixed_chunk_attention

# syncs per decoded token and layer: every family decodes without reading the device, except
# Combiner, whose per-call segment layout (rows, buffer fill) is sized on the host
SYNCS_PER_LAYER = {"combiner-tiny": 1}


@pytest.mark.parametrize("preset", FAMILY_PRESETS)
def test_syncs_per_decoded_token(preset):
    m = tiny_model(preset, **SMALL_CHUNKS.get(preset, {}))
    ids = torch.randint(0, 256, (2, 5))
    per_token = SYNCS_PER_LAYER.get(preset, 0) * m.config.n_layers
    with torch.no_grad():
        logits, state = prefill(m, ids)
        tok = logits.argmax(-1)
        # 19 steps: positions 5..23 cross two chunk / block boundaries of 8
        for step in range(19):
            with count_host_syncs() as c:
                logits, state = decode_one_token(m, tok, state)
            assert (c.total, c.h2d) == (per_token, 0), \
                f"{preset} step {step}: {c.total} syncs {dict(c.counts)}, {c.h2d} host->device tensors"
            tok = logits.argmax(-1)
    assert state.offset.tolist() == [24, 24]


def test_counter_sees_syncs():
    x = torch.arange(4.0)
    with count_host_syncs() as c:
        x.sum().item()
        x.tolist()
        bool(x[0])
        int(x[1])
        x[x > 1]
        x.nonzero()
        torch.tensor([1, 2])
    assert c.counts == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "bool_index": 1, "nonzero": 1}
    assert c.h2d == 1 and c.total == 6 and c.ops > 7


def _mc_inputs(N=2, T=3, H=1, S=4, E=4):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(N, T, H, d, generator=g, dtype=torch.float64) for d in (S, S, S, S, E)]


@pytest.mark.parametrize("inference", [False, True])
def test_state_value_checks_skipped_only_for_unmodified_op_states(inference):
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        x = _mc_inputs()
        _, st = mixed_chunk_attention(*x, chunk_size=4, output_final_state=True)
        step = [t[:, :1] for t in x]
        with count_host_syncs() as c:  # the op's own state: no value read
            mixed_chunk_attention(*step, chunk_size=4, initial_state=st, output_final_state=True)
        assert c.total == 0
        # a state built outside the op is checked once (and trusted afterwards)
        fresh = MixedChunkState.zeros(2, 4, 1, 4, 4, dtype=torch.float64)
        with count_host_syncs() as c:
            mixed_chunk_attention(*step, chunk_size=4, initial_state=fresh, output_final_state=True)
        assert c.total > 0
        bad = dataclasses.replace(st, fill=torch.full((2,), 7))
        with pytest.raises(ValueError, match="fill must lie in"):
            mixed_chunk_attention(*step, chunk_size=4, initial_state=bad, output_final_state=True)
        if not inference:  # an in-place edit of the op's own state is seen (version counter)
            st.fill.fill_(7)
            with pytest.raises(ValueError, match="fill must lie in"):
                mixed_chunk_attention(*step, chunk_size=4, initial_state=st, output_final_state=True)


def test_learned_positions_still_checked_past_the_table():
    cfg = dataclasses.replace(get_preset("linear-tiny", vocab_size=256), max_positions=6)
    torch.manual_seed(0)
    m = CausalLM(cfg).eval()
    with torch.no_grad():
        logits, state = prefill(m, torch.randint(0, 256, (1, 4)))
        for _ in range(2):  # positions 4, 5: inside the table, no device read
            with count_host_syncs() as c:
                logits, state = decode_one_token(m, logits.argmax(-1), state)
            assert c.total == 0
        with pytest.raises(ValueError, match="beyond the learned position table"):
            decode_one_token(m, logits.argmax(-1), state)
        # a state without the host bound (built by hand) is checked on the device
        unbounded = dataclasses.replace(state, max_offset=None)
        with pytest.raises(ValueError, match="beyond the learned position table"):
            decode_one_token(m, logits.argmax(-1), unbounded)
