"""The checks every mixer family passes, parametrized over the registry (one tiny preset a family,
``tests/tiny_presets.py``, two layers, chunks / blocks of 8 so ~30 tokens cross several):
parallel == prefill + decoding (fp64, fp32, any split point), packed documents == each alone,
packed prefill then decoding, beams and packed continuation, a causal model ignores later tokens
and a masked one does not, the state's growth in T, overfitting a batch, the byte vocabulary,
validation messages.  What only one family has (its formula, options, state layout, presets) is in
its ``test_<family>_model.py`` and under ``tests/layers``.

(Not ``test_families.py``: that basename belongs to ``tests/ops/``.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from model_helpers import (
    CausalLM,
    MaskedLM,
    build,
    check_packed_equals_separate,
    check_packed_prefill_then_decoding,
    check_prefill_plus_decoding,
    overfit,
    state_numel,
)
from tiny_presets import FAMILY_TINY_PRESETS, small_chunks

from lintime.data.tokenizer import ByteTokenizer
from lintime.models import get_family, get_preset
from tolerances import assert_exact

FAMILY = {name: get_preset(name).family for name in FAMILY_TINY_PRESETS}
# Decoders only: a masked LM of these raises (the gated recurrence, the VQ cache are causal).
CAUSAL_ONLY = {"gla", "vq"}
# Quadratic families decode from a cache that grows with T; every other family's state has a fixed size.
GROWING_STATE = {"softmax", "gau", "combiner"}
BIDIRECTIONAL = [n for n in FAMILY_TINY_PRESETS if FAMILY[n] not in CAUSAL_ONLY]


def config(name):
    return small_chunks(get_preset(name, n_layers=2))


def tiny(name, dtype=torch.float64, cls=CausalLM):
    return build(config(name), dtype, cls)


def test_tables_name_shipped_families():
    assert CAUSAL_ONLY | GROWING_STATE <= set(FAMILY.values())


# ----------------------------------------------------------------------------- parallel == recurrent
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_full_sequence_equals_prefill_plus_decoding(name, dtype):
    check_prefill_plus_decoding(tiny(name, dtype), f"{name} {dtype}")


@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
@given(T=st.integers(1, 40), cut=st.integers(0, 40), B=st.integers(1, 3))
def test_any_split_point(name, T, cut, B):
    m = tiny(name)
    ids = torch.randint(0, m.config.vocab_size, (B, T))
    cut = min(cut, T)
    with torch.no_grad():
        full = m(ids)
        pieces = [ids[:, :cut], ids[:, cut:]] if 0 < cut < T else [ids]
        outs, state = [], None
        for p in pieces:
            logits, state = m(p, state, return_state=True)
            outs.append(logits)
    assert_exact(f"{name} split T={T} cut={cut}", full, torch.cat(outs, 1))


@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_packed_equals_separate_causal(name):
    check_packed_equals_separate(tiny(name), f"{name} causal")


@pytest.mark.parametrize("name", BIDIRECTIONAL)
def test_packed_equals_separate_masked(name):
    check_packed_equals_separate(tiny(name, cls=MaskedLM), f"{name} masked")


@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_packed_prefill_decoding_beams_and_continuation(name):
    check_packed_prefill_then_decoding(tiny(name), name, steps=9)  # blocks of 8: every sequence crosses one


@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_causal_ignores_later_tokens_masked_does_not(name):
    ids = torch.randint(0, 256, (1, 12))
    changed = ids.clone()
    changed[0, 5] = (changed[0, 5] + 1) % 256
    with torch.no_grad():
        c, c2 = tiny(name)(ids), tiny(name)(changed)
        assert_exact(f"{name} causal prefix", c[0, :5], c2[0, :5])
        assert not torch.allclose(c[0, 5:], c2[0, 5:])
        if FAMILY[name] in CAUSAL_ONLY:
            with pytest.raises(ValueError, match="causal"):
                MaskedLM(config(name))
            return
        b, b2 = tiny(name, cls=MaskedLM)(ids), tiny(name, cls=MaskedLM)(changed)
    assert not torch.allclose(b[0, :5], b2[0, :5])


# ----------------------------------------------------------------------------- the state
@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_state_size_in_T(name):
    """Linear-time families decode with memory that does not grow with T (after 10, 100 or 333
    tokens, and one more); quadratic ones keep a cache that does.  A state is a value: ``to`` moves
    it, and a state for the wrong number of sequences is refused."""
    m = tiny(name)
    sizes = []
    with torch.no_grad():
        for T in (10, 100, 333):
            _, state = m(torch.randint(0, 256, (2, T)), return_state=True)
            sizes.append(state_numel(state))
            _, state = m(torch.randint(0, 256, (2, 1)), state, return_state=True)
            sizes.append(state_numel(state))
        with pytest.raises(ValueError, match="holds 2 sequences"):
            m(torch.randint(0, 256, (3, 1)), state)
    assert state.to("cpu").offset.tolist() == [334, 334]
    if FAMILY[name] in GROWING_STATE:
        assert sizes[2] > sizes[0] and sizes[4] > sizes[2], sizes
    else:
        assert len(set(sizes)) == 1, sizes


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_tiny_overfits_causal(name):
    overfit(config(name))


# The masked objective's training is checked on the baseline and FLASH (the families' masked forwards: above).
@pytest.mark.parametrize("name", ["transformer-pp-tiny", "flash-tiny"])
def test_tiny_overfits_masked(name):
    overfit(config(name), MaskedLM)


# ----------------------------------------------------------------------------- presets, config
@pytest.mark.parametrize("name", FAMILY_TINY_PRESETS)
def test_tiny_presets_use_the_byte_vocabulary(name):
    assert get_preset(name).vocab_size == ByteTokenizer().vocab_size


BAD = {  # family -> (sub-config fields, what the message says)
    "gau": [
        (dict(kernel="softmax", scaling="n"), "kernel='softmax' scales scores by 1/sqrt\\(s\\)"),
        (dict(kernel="softmax", causal_norm=True), "leave scaling=None|causal_norm applies to the relu2 kernel"),
        (dict(kernel="gelu"), "kernel must be one of"),
        (dict(scaling="n2"), "scaling must be one of"),
        (dict(s=0), "s must be an int >= 1"),
        (dict(max_len=0), "max_len must be an int >= 1"),
        (dict(expansion=-1), "expansion must be a positive number"),
        (dict(n_heads=3), "n_heads=3 must split s=128"),
        (dict(n_heads=128), "heads of even width"),
        (dict(gating=1), "gating must be a bool"),
        (dict(rope_base=1), "rope_base must be a number > 1"),
    ],
    "flash": [
        (dict(chunk_size=0), "chunk_size must be an int >= 1"),
        (dict(chunk_size=64.0), "chunk_size must be an int >= 1"),
        (dict(linear_norm="mean"), "linear_norm must be one of"),
        (dict(scaling="1/n"), "scaling must be one of"),
        (dict(s=7), "RoPE needs an even s"),
        (dict(expansion=0), "expansion must be a positive number"),
        (dict(first_to_all="yes"), "first_to_all must be a bool"),
    ],
    "mc_tfm": [
        (dict(n_heads=0), "n_heads must be an int >= 1"),
        (dict(chunk_size=0), "chunk_size must be an int >= 1"),
        (dict(linear_norm="sum"), "linear_norm must be one of"),
        (dict(rope="no"), "rope must be a bool"),
        (dict(head_dim=0), "head_dim must be an int >= 1"),
    ],
    "linear": [
        (dict(n_heads=0), "n_heads must be a positive int"),
        (dict(feature_map="softmax"), "feature_map must be one of"),
        (dict(feature_map="identity"), "feature_map='identity' needs normalize=False"),
        (dict(feature_map="relu", feature_eps=0.0), "feature_map='relu' with normalize=True needs feature_eps > 0"),
        (dict(normalize="yes"), "normalize must be a bool"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
    ],
    "gla": [
        (dict(n_heads=0), "n_heads must be a positive int"),
        (dict(expand_k=0), "expand_k must be a number > 0"),
        (dict(gate_temperature=-1.0), "gate_temperature must be a number > 0"),
        (dict(gate_rank=1.5), "gate_rank must be a positive int"),
        (dict(head_norm="batchnorm"), "head_norm must be one of"),
        (dict(output_gate=1), "output_gate must be a bool"),
    ],
    "performer": [
        (dict(n_heads=-1), "n_heads must be a positive int"),
        (dict(features="favor+"), "features must be one of"),
        (dict(num_features=0), "num_features must be a positive int"),
        (dict(feature_eps=0.0), "feature_eps must be > 0"),
        (dict(feature_seed=-1), "feature_seed must be an int >= 0"),
        (dict(rope_base=1), "rope_base must be a number > 1"),
    ],
    "combiner": [
        (dict(n_heads=0), "n_heads must be a positive int"),
        (dict(chunk_size=0), "chunk_size must be a positive int"),
        (dict(row_summary="mean"), "row_summary must be one of"),
        (dict(rope="yes"), "rope and bias must be bools"),
    ],
    "vq": [
        (dict(n_codes=0), "n_codes must be an int >= 1"),
        (dict(block_len=64.0), "block_len must be an int >= 1"),
        (dict(d_k=-1), "d_k must be an int >= 1"),
        (dict(gamma=1.0), r"gamma must be a number in \[0, 1\)"),
        (dict(gamma=True), r"gamma must be a number in \[0, 1\)"),
        (dict(reduction="cumsum"), "reduction must be one of"),
        (dict(sin_dropout=1.0), r"sin_dropout must be in \[0, 1\)"),
        (dict(sin_base=1), "sin_base must be a number > 1"),
        (dict(rel_bias="yes"), "rel_bias must be a bool"),
        (dict(expansion=0), "expansion must be a positive number"),
    ],
    "softmax": [(dict(n_heads=0), "n_heads must be a positive int")],
}
BAD_CASES = [(family, kwargs, msg) for family, cases in BAD.items() for kwargs, msg in cases]


def test_every_family_has_bad_config_cases():
    assert set(BAD) == set(FAMILY.values())


@pytest.mark.parametrize("family,kwargs,msg", BAD_CASES, ids=[f"{f}: {m}" for f, _, m in BAD_CASES])
def test_bad_sub_configs_fail_clearly(family, kwargs, msg):
    cls = get_family(family).config_cls
    with pytest.raises(ValueError, match=f"{cls.__name__}: .*(?:{msg})"):
        cls(**kwargs)
