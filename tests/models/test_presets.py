"""Presets against the seeds' tables, init, parameter counting and weight-decay groups.

The expected parameter counts are typed in from the seeds (the FLASH seed's Tables 8, 9 and 10
"Params (M)" row for its baselines, each other seed's stated sizes); they are never computed by our code.
Seed-scale models are built on the meta device
(no memory, no init cost)."""

import pytest
import torch

from lintime.layers import LayerNorm, ScaledSinEmbedding, ScaleNorm
from lintime.models import CausalLM, MaskedLM, all_presets, get_preset

# Parameter counts (millions) the seeds print, typed in from them; never computed by our code.
SEED_TABLE_PARAMS_M = {
    # FLASH seed Table 9 (LM, Wiki-40B): d=768, 12+12 layers (24 FLASH / FLASH-Quad layers)
    "transformer-base": 110, "transformer-p-base": 110, "transformer-pp-base": 110,
    "flash-base": 112, "flash-quad-base": 112, "performer-base": 110, "combiner-base": 124,
    # FLASH seed Table 8 (MLM, C4): same sizes
    "transformer-base-mlm": 110, "transformer-p-base-mlm": 110, "transformer-pp-base-mlm": 110,
    "flash-base-mlm": 112, "flash-quad-base-mlm": 112, "performer-base-mlm": 110, "combiner-base-mlm": 124,
    # FLASH seed Table 10 (LM, PG-19): d=1024, 36+36 layers (72); Performer has no row: Transformer+'s shape
    "transformer-p-large": 486, "transformer-pp-large": 486, "flash-large": 496, "flash-quad-large": 496,
    "performer-large": 486, "combiner-large": 562,
    # MC-TFM++ has no count in the seed: it is compared with Transformer++ at 110M (Figure 7, Table 5)
    "mc-tfm-pp-base": 110, "mc-tfm-pp-base-mlm": 110,
    # GLA seed §A4: "340M" and "1.3B"
    "gla-340m": 340, "gla-1.3b": 1300,
    # linear seed: four scales "from 120 million to 1.5 billion"
    "linear-gpt2-124m": 120, "linear-gpt2-1.5b": 1500,
    # Transformer-VQ seed Section 5.2.1: "a Transformer-VQ with 190M parameters" (EMA statistics: test_vq_model.py)
    "vq-190m": 190,
}


@pytest.mark.parametrize("name", sorted(SEED_TABLE_PARAMS_M))
def test_parameter_counts_match_seed_tables(name):
    with torch.device("meta"):
        m = CausalLM(get_preset(name))
    got = m.num_parameters() / 1e6
    want = SEED_TABLE_PARAMS_M[name]
    assert abs(got - want) <= 0.05 * want, f"{name}: {got:.2f}M vs seed table {want}M"


def test_seed_table_architecture_rows():
    """Tables 8-10 rows: heads, hidden size, layers, FFN type, positions, norm."""
    t, tp, tpp = get_preset("transformer-base"), get_preset("transformer-p-base"), get_preset("transformer-pp-base")
    for c in (t, tp, tpp):
        assert (c.d_model, c.n_layers, c.mixer.n_heads, c.ffn.expansion, c.norm) == (768, 12, 12, 4, "layernorm")
    assert (t.position, t.mixer.rope, t.ffn.kind) == ("learned", False, "mlp")
    assert (tp.position, tp.mixer.rope, tp.ffn.kind) == ("scaled_sin", True, "mlp")
    assert (tpp.position, tpp.mixer.rope, tpp.ffn.kind) == ("scaled_sin", True, "glu")
    assert get_preset("transformer-pp-base-mlm").norm == "scalenorm"  # Table 8
    assert get_preset("transformer-base-mlm").norm == "layernorm"
    large = get_preset("transformer-pp-large")
    assert (large.d_model, large.n_layers, large.mixer.n_heads) == (1024, 36, 16)


@pytest.mark.parametrize("name", [n for n in all_presets() if n.endswith(("-tiny", "-small"))])
def test_cpu_presets_are_small(name):
    m = CausalLM(get_preset(name))
    assert m.num_parameters() < 5e6


# The GPU quality study (benchmarks/quality) trains these at equal tokens: byte vocabulary, 10-40M
# parameters, and within 15 % of Transformer++-medium so the comparison is at about equal size.
STUDY_MEDIUM = ["flash-medium", "flash-quad-medium", "transformer-pp-medium", "transformer-p-medium",
                "gla-medium", "vq-medium", "linear-medium", "performer-medium"]


def test_study_medium_presets_are_byte_level_and_comparable():
    assert set(STUDY_MEDIUM) <= {n for n in all_presets() if n.endswith("-medium")}
    counts = {}
    for name in STUDY_MEDIUM:
        cfg = get_preset(name)
        assert cfg.vocab_size == 260, name  # bytes + <pad> <bos> <eos> <mask>
        with torch.device("meta"):
            counts[name] = CausalLM(cfg).num_parameters(exclude_embeddings=True)
        assert 10e6 <= counts[name] <= 40e6, (name, counts[name])
    ref = counts["transformer-pp-medium"]
    for name, n in counts.items():
        assert abs(n - ref) <= 0.15 * ref, (name, n, ref)


@pytest.mark.parametrize("name", ["gla-base", "vq-base"])
def test_base_presets_of_the_newer_families(name):
    """~110M at vocabulary 32,000, the size of the seed-table ``-base`` presets above."""
    cfg = get_preset(name)
    assert (cfg.vocab_size, cfg.d_model) == (32_000, 768)
    with torch.device("meta"):
        got = CausalLM(cfg).num_parameters() / 1e6
    assert abs(got - 110) <= 0.05 * 110, f"{name}: {got:.2f}M"


def test_init_is_seed_normal_002():
    torch.manual_seed(0)
    m = CausalLM(get_preset("transformer-p-small"))
    for name, p in m.named_parameters():
        if p.dim() == 2:
            assert abs(p.std().item() - 0.02) < 0.002, name
        elif name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
    for mod in m.modules():
        if isinstance(mod, LayerNorm):
            assert torch.equal(mod.weight, torch.ones_like(mod.weight))
        if isinstance(mod, ScaledSinEmbedding):
            assert mod.scale.item() == pytest.approx(m.config.d_model**-0.5)  # seed Code 2: 1/sqrt(d)
    wide = CausalLM(get_preset("transformer-tiny", init_std=0.1))
    assert abs(wide.backbone.embed.weight.std().item() - 0.1) < 0.01


def test_num_parameters_exclude_embeddings():
    cfg = get_preset("transformer-tiny")  # learned positions, tied
    m = CausalLM(cfg)
    emb = cfg.vocab_size * cfg.d_model + cfg.max_positions * cfg.d_model
    assert m.num_parameters() - m.num_parameters(exclude_embeddings=True) == emb
    untied = CausalLM(get_preset("transformer-p-tiny", tie_embeddings=False))
    tied = CausalLM(get_preset("transformer-p-tiny"))
    assert untied.num_parameters() - tied.num_parameters() == cfg.vocab_size * tied.config.d_model
    assert untied.num_parameters(exclude_embeddings=True) == tied.num_parameters(exclude_embeddings=True)
    assert untied.lm_head is not None and tied.lm_head is None


def test_param_groups():
    m = MaskedLM(get_preset("transformer-pp-base-mlm", n_layers=1, vocab_size=100))
    decay, no_decay = m.param_groups(0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    ids = lambda g: {id(p) for p in g["params"]}  # noqa: E731
    assert not ids(decay) & ids(no_decay)
    assert ids(decay) | ids(no_decay) == {id(p) for p in m.parameters()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p in no_decay["params"]:
        assert p.dim() < 2, names[id(p)]  # norm gains, biases, the ScaledSin scale
    assert id(m.backbone.embed.weight) in ids(decay)
    assert id(m.backbone.pos.scale) in ids(no_decay)
    assert any(isinstance(mod, ScaleNorm) and id(mod.scale) in ids(no_decay) for mod in m.modules())
    assert {names[i] for i in ids(decay)} == {
        "backbone.embed.weight", "backbone.blocks.0.mixer.qkv.weight", "backbone.blocks.0.mixer.out.weight",
        "backbone.blocks.0.ffn.up.weight", "backbone.blocks.0.ffn.down.weight",
    }
    torch.optim.AdamW(m.param_groups(0.01), lr=1e-3)  # accepted as is


def test_chunk_ablation_presets_differ_from_flash_medium_only_in_chunk_size():
    import dataclasses

    base = get_preset("flash-medium")
    assert base.mixer.chunk_size == 256  # the seed's default C
    for C in (64, 128, 512):
        cfg = get_preset(f"flash-medium-c{C}")
        assert cfg.mixer.chunk_size == C
        assert dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, chunk_size=256)) == base
