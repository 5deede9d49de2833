"""Parallel == recurrent: full-sequence logits equal chunked prefill plus
token-by-token decoding, packed batches equal their sequences run one by one, and ``select``
reorders states.  Exact forms in fp64 / fp32 are compared with ``assert_exact`` (tests/tolerances.py)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lintime.models import CausalLM, MaskedLM, get_preset
from tolerances import assert_exact

TINY = ["transformer-tiny", "transformer-p-tiny", "transformer-pp-tiny"]
_MODELS = {}


def model(name, dtype=torch.float64, cls=CausalLM):
    key = (name, dtype, cls)
    if key not in _MODELS:
        torch.manual_seed(1)
        _MODELS[key] = cls(get_preset(name)).to(dtype).eval()
    return _MODELS[key]


def decode_in_pieces(m, ids, splits):
    """Logits of ``ids`` fed as chunks ending at ``splits`` then one token at a time."""
    outs, state, start = [], None, 0
    for end in [*splits, *range(splits[-1] + 1 if splits else 1, ids.shape[1] + 1)]:
        logits, state = m(ids[:, start:end], state, return_state=True)
        outs.append(logits)
        start = end
    return torch.cat(outs, 1), state


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_sequence_equals_prefill_plus_decoding(name, dtype):
    m = model(name, dtype)
    ids = torch.randint(0, 256, (3, 37))
    with torch.no_grad():
        full = m(ids)
        for splits in ([1], [16], [5, 20, 33]):
            pieces, state = decode_in_pieces(m, ids, splits)
            assert_exact(f"{name} {dtype} prefill {splits}", full, pieces)
            assert state.offset.tolist() == [37, 37, 37]


@given(T=st.integers(1, 40), cut=st.integers(0, 40), B=st.integers(1, 3))
def test_any_split_point(T, cut, B):
    m = model("transformer-pp-tiny")
    ids = torch.randint(0, 256, (B, T))
    cut = min(cut, T)
    with torch.no_grad():
        full = m(ids)
        pieces = [ids[:, :cut], ids[:, cut:]] if 0 < cut < T else [ids]
        outs, state = [], None
        for p in pieces:
            logits, state = m(p, state, return_state=True)
            outs.append(logits)
    assert_exact(f"split T={T} cut={cut}", full, torch.cat(outs, 1))


def _packed(lengths):
    seqs = [torch.randint(0, 256, (1, n)) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, torch.cat(seqs, 1), cu


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("cls", [CausalLM, MaskedLM])
def test_packed_equals_separate(name, cls):
    m = model(name, cls=cls)
    seqs, packed, cu = _packed([7, 1, 0, 19, 12])
    with torch.no_grad():
        ref = torch.cat([m(s) for s in seqs if s.shape[1]], 1)
        out = m(packed, cu_seqlens=cu)
    assert_exact(f"{name} {cls.__name__} packed", ref, out)


@pytest.mark.parametrize("name", TINY)
def test_packed_prefill_state_then_decoding(name):
    """A packed prefill returns one state row per sequence; decoding continues each one."""
    m = model(name)
    lengths = [5, 12, 1, 9]
    seqs, packed, cu = _packed(lengths)
    more = torch.randint(0, 256, (4, 3))
    with torch.no_grad():
        logits, state = m(packed, cu_seqlens=cu, return_state=True)
        assert_exact("packed prefill logits", m(packed, cu_seqlens=cu), logits)
        assert state.offset.tolist() == lengths
        steps = []
        for t in range(3):
            lg, state = m(more[:, t : t + 1], state, return_state=True)
            steps.append(lg)
        ref = torch.stack([m(torch.cat([s, more[i : i + 1]], 1))[0, -3:] for i, s in enumerate(seqs)])
    assert_exact("decode after packed prefill", ref, torch.cat(steps, 1))


def test_packed_chunk_continues_a_state():
    """With cu_seqlens and a non-empty state, each packed piece continues its own sequence."""
    m = model("transformer-p-tiny")
    a, b = torch.randint(0, 256, (1, 10)), torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        _, state = m(torch.cat([a[:, :4], b[:, :2]], 1), cu_seqlens=torch.tensor([0, 4, 6]), return_state=True)
        lg, state = m(torch.cat([a[:, 4:], b[:, 2:]], 1), state, return_state=True, cu_seqlens=torch.tensor([0, 6, 10]))
        ref = torch.cat([m(a)[:, 4:], m(b)[:, 2:]], 1)
    assert_exact("packed continuation", ref, lg)
    assert state.offset.tolist() == [10, 6]


def test_select_reorders_states_for_beam_search():
    m = model("transformer-pp-tiny")
    ids = torch.randint(0, 256, (3, 9))
    nxt = torch.randint(0, 256, (4, 2))
    index = torch.tensor([2, 0, 0, 1])
    with torch.no_grad():
        _, state = m(ids, return_state=True)
        beams = state.select(index)
        assert beams.batch_size == 4 and beams.offset.tolist() == [9, 9, 9, 9]
        out, _ = m(nxt, beams, return_state=True)
        ref = m(torch.cat([ids[index], nxt], 1))[:, -2:]
        # the original state is unchanged and still decodes its own rows
        out0, _ = m(nxt[:3], state, return_state=True)
        ref0 = m(torch.cat([ids, nxt[:3]], 1))[:, -2:]
    assert_exact("beam select", ref, out)
    assert_exact("original state after select", ref0, out0)
    assert state.to("cpu").layers[0].k.device.type == "cpu"


def test_causal_vs_bidirectional_masks():
    ids = torch.randint(0, 256, (1, 12))
    changed = ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 256
    with torch.no_grad():
        c, c2 = model("transformer-p-tiny")(ids), model("transformer-p-tiny")(changed)
        b, b2 = model("transformer-p-tiny", cls=MaskedLM)(ids), model("transformer-p-tiny", cls=MaskedLM)(changed)
    assert torch.equal(c[0, :8], c2[0, :8]) and not torch.allclose(c[0, 8:], c2[0, 8:])
    assert not torch.allclose(b[0, :8], b2[0, :8])


def test_state_errors():
    m = model("transformer-tiny")
    mlm = model("transformer-tiny", cls=MaskedLM)
    ids = torch.randint(0, 256, (2, 5))
    with pytest.raises(ValueError, match="bidirectional"):
        mlm(ids, return_state=True)
    with pytest.raises(ValueError, match="bidirectional"):
        mlm.init_state(2)
    with pytest.raises(ValueError, match="holds 2 sequences but the input has 3"):
        m(torch.randint(0, 256, (3, 1)), m.init_state(2))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        m(torch.randint(0, 256, (1, 5)), cu_seqlens=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="packed into one row"):
        m(ids, cu_seqlens=torch.tensor([0, 5]))
    # learned positions: decoding past the table is a clear error
    _, state = m(torch.randint(0, 256, (1, 1023)), return_state=True)
    m(torch.randint(0, 256, (1, 1)), state)
    with pytest.raises(ValueError, match="beyond the learned position table"):
        m(torch.randint(0, 256, (1, 2)), state)
