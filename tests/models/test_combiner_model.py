"""Family ``combiner`` (FLASH seed baseline: Combiner, row-major axial, Appendix A) as a model: the state's
documented memory, Tables 8-10 shapes, model-level validation.  The layer against a token-by-token reference:
``tests/layers/test_combiner.py``; what every family passes: ``test_every_family.py``."""

import pytest
import torch
from model_helpers import meta_params_m, model

from lintime.models import get_preset
from lintime.models.families.combiner import CombinerConfig


def test_state_memory_is_the_documented_one():
    """Per layer and sequence: ``2 x rows x C x H x D`` summaries of complete rows (a KV cache's
    size) + the current row (``< C`` tokens): ``rows = T // C``, ``buf_len = T % C``."""
    m = model("combiner-tiny")
    c = m.config
    C, H = c.mixer.chunk_size, c.mixer.n_heads
    D = c.d_model // H
    with torch.no_grad():
        for T in (5, C, 29):
            _, st = m(torch.randint(0, 256, (2, T)), return_state=True)
            s = st.layers[0]
            assert s.rows.tolist() == [T // C] * 2 and s.buf_len.tolist() == [T % C] * 2
            assert s.sum_k.shape[0] == 2 and s.sum_k.shape[1] >= T // C and s.sum_k.shape[2:] == (C, H, D)
            assert s.sum_k[:, T // C :].abs().sum() == 0 and s.buf_q[:, T % C :].abs().sum() == 0
            assert s.buf_x.shape == (2, C, c.d_model)


def test_seed_table_shapes():
    """Tables 8-10 (the counts: ``test_presets.py``): C = 256 at base, 512 at large.  The gap to Transformer+ is
    the 'proj' row summary: 2d^2 + 4d per layer."""
    gap = meta_params_m("combiner-base") - meta_params_m("transformer-p-base")
    assert round(gap * 1e6) == 12 * (2 * 768 * 768 + 4 * 768)
    assert (get_preset("combiner-base").mixer.chunk_size, get_preset("combiner-large").mixer.chunk_size) == (256, 512)
    assert get_preset("combiner-base-mlm").norm == "scalenorm"


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="d_model=64 is not divisible by n_heads=6"):
        get_preset("combiner-tiny", mixer=CombinerConfig(n_heads=6))
