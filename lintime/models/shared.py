"""What the model families share, so that no family imports another (each family module stands alone and
registers only itself): the config checks their dataclasses run, the seed-scale vocabulary, and the FLASH
seed's sizes used by both the ``gau`` and the ``flash`` families."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lintime.models.config import BYTE_VOCAB

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig

# Vocabulary of the seed-scale presets: 32,000 (a T5-style 32k SentencePiece vocabulary).  The
# seed's tables do not state it; with tied embeddings it is the size that reproduces their
# parameter counts (Table 10's 486M Transformer+ leaves ~32.8M for the embedding at d=1024).
SEED_VOCAB = 32_000

# size -> (d_model, GAU layers, s, chunk size C, vocab, max_len n).  Seed Tables 8-9 (base) and 10
# (large): 24 / 72 layers, expansion 2, s = 128, C = 256 / 512.  max_len is the fixed n of the
# 1/n scaling: the shortest context of each table (512 on Wiki-40B / C4, 1024 on PG-19).
# ``medium`` (~26M parameters, byte vocabulary) is the GPU quality study's size
# (benchmarks/quality): the seed's base shape at d=512 and 16 layers, two GAUs per
# Transformer++-medium block, so the families compare at about equal parameters.
SIZES = {
    "tiny": (128, 4, 64, 64, BYTE_VOCAB, 512),
    "small": (256, 8, 128, 128, BYTE_VOCAB, 512),
    "medium": (512, 16, 128, 256, BYTE_VOCAB, 512),
    "base": (768, 24, 128, 256, SEED_VOCAB, 512),
    "large": (1024, 72, 128, 512, SEED_VOCAB, 1024),
}


def fail(where: str, msg: str) -> None:
    raise ValueError(f"{where}: {msg}")


def check_int(where: str, name: str, value, lo: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        fail(where, f"{name} must be an int >= {lo}, got {value!r}")


def check_bool(where: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, bool):
            fail(where, f"{name} must be a bool, got {value!r}")


def check_choice(where: str, name: str, value, choices) -> None:
    if value not in choices:
        fail(where, f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_rope_base(where: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 1:
        fail(where, f"rope_base must be a number > 1, got {value!r}")


def check_expansion(where: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        fail(where, f"expansion must be a positive number, got {value!r}")


def check_positive_int(where: str, name: str, v, none_ok: bool = False) -> None:
    if v is None and none_ok:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{where}: {name} must be a positive int{' or None' if none_ok else ''}, got {v!r}")


def check_heads(where: str, config: "ModelConfig", n_heads: int, head_dim: int | None) -> None:
    if head_dim is None and config.d_model % n_heads:
        raise ValueError(f"{where}: d_model={config.d_model} is not divisible by n_heads={n_heads}; "
                         f"change n_heads or set head_dim")


def gau_model(size: str, family: str, mixer, norm: str = "layernorm") -> "ModelConfig":
    """A FLASH-Quad / FLASH model of ``size`` (seed Tables 8-10 rows: GAU blocks, no separate FFN,
    ScaledSin absolute positions + RoPE, LayerNorm for LM / ScaleNorm for MLM, tied embeddings)."""
    from lintime.models.config import ModelConfig

    d, L, _, _, vocab, _ = SIZES[size]
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=L, family=family, mixer=mixer, ffn=None, norm=norm,
        position="scaled_sin", tie_embeddings=True,
    )
