"""Family ``performer``: the FLASH seed's linear-attention baseline, Performer with the ReLU
kernel (Section 4 "Baselines": "the ReLU-kernel variant of Performer ... augmented with RoPE";
Tables 8-9: 12 heads, kernel relu, attention type Linear, MLP + GELU, expansion 4, ScaledSin
absolute positions, LayerNorm for LM / ScaleNorm for MLM, 12+12 layers, d=768, 110M).

The mixer is :class:`~lintime.layers.performer.PerformerAttention`; the block, FFN, norms and
positions are the softmax family's Transformer+ (the random features are a buffer, so a Performer
has exactly Transformer+'s parameters).  Vocabulary 32,000, tied embeddings: the convention of
the softmax family that reproduces the seed's tables (``docs/models.md``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.performer import FEATURES, PerformerAttention
from lintime.models.shared import check_heads, check_positive_int
from lintime.models.registry import register_family
from lintime.models.config import BYTE_VOCAB

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class PerformerConfig:
    """``n_heads`` heads of width ``head_dim`` (``None``: ``d_model // n_heads``);
    ``features``: ``random`` (fixed Gaussian orthogonal projection, a buffer), ``learned``
    (trainable projection) or ``none`` (``relu`` of the head itself); ``num_features`` ``M``
    (Performer's default 256; ignored by ``none``); ``feature_eps`` the kernel's numerical
    stabiliser (Performer: 1e-3); ``feature_seed`` seeds the random projection (layer ``i`` uses
    ``feature_seed + i``); ``rope`` on q, k before the feature map; ``chunk_size`` of the linear op."""

    n_heads: int = 12
    head_dim: int | None = None
    features: str = "random"
    num_features: int = 256
    feature_eps: float = 1e-3
    feature_seed: int = 0
    rope: bool = True
    rope_base: float = 10000.0
    chunk_size: int = 64
    bias: bool = True

    def __post_init__(self):
        w = "PerformerConfig"
        check_positive_int(w, "n_heads", self.n_heads)
        check_positive_int(w, "head_dim", self.head_dim, none_ok=True)
        check_positive_int(w, "num_features", self.num_features)
        check_positive_int(w, "chunk_size", self.chunk_size)
        if self.features not in FEATURES:
            raise ValueError(f"{w}: features must be one of {FEATURES}, got {self.features!r}")
        if isinstance(self.feature_eps, bool) or not isinstance(self.feature_eps, (int, float)) \
                or not self.feature_eps > 0:
            raise ValueError(f"{w}: feature_eps must be > 0 (relu features + eps keep the normaliser "
                             f"positive), got {self.feature_eps!r}")
        if not isinstance(self.feature_seed, int) or isinstance(self.feature_seed, bool) or self.feature_seed < 0:
            raise ValueError(f"{w}: feature_seed must be an int >= 0, got {self.feature_seed!r}")
        if not isinstance(self.rope, bool) or not isinstance(self.bias, bool):
            raise ValueError(f"{w}: rope and bias must be bools, got rope={self.rope!r}, bias={self.bias!r}")
        if isinstance(self.rope_base, bool) or not isinstance(self.rope_base, (int, float)) or self.rope_base <= 1:
            raise ValueError(f"{w}: rope_base must be a number > 1, got {self.rope_base!r}")

    def check(self, config: "ModelConfig") -> None:
        check_heads("PerformerConfig", config, self.n_heads, self.head_dim)
        hd = self.head_dim if self.head_dim is not None else config.d_model // self.n_heads
        if self.rope and hd % 2:
            raise ValueError(f"PerformerConfig: RoPE needs an even head size, got {hd}")


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> PerformerAttention:
    m: PerformerConfig = config.mixer
    return PerformerAttention(
        config.d_model, m.n_heads, head_dim=m.head_dim, features=m.features, num_features=m.num_features,
        feature_eps=m.feature_eps, feature_seed=m.feature_seed + layer_idx, rope=m.rope, rope_base=m.rope_base,
        causal=causal, chunk_size=m.chunk_size, bias=m.bias,
    )


# ---------------------------------------------------------------------------- presets
SEED_VOCAB = 32_000  # the softmax family's reading of the FLASH tables (docs/models.md)

# size -> (d_model, n_layers, n_heads, vocab, num_features)
_SIZES = {
    "tiny": (64, 2, 4, BYTE_VOCAB, 32),
    "small": (256, 4, 4, BYTE_VOCAB, 64),
    "medium": (512, 8, 8, BYTE_VOCAB, 128),  # the GPU quality study's size (benchmarks/quality)
    "base": (768, 12, 12, SEED_VOCAB, 256),  # Tables 8-9
    # Table 10 (PG-19) has no Performer row: Transformer+'s large shape (36 blocks, d=1024, 16 heads)
    "large": (1024, 36, 16, SEED_VOCAB, 256),
}


def _preset(size: str, norm: str = "layernorm") -> "ModelConfig":
    from lintime.models.config import FFNConfig, ModelConfig

    d, L, H, vocab, M = _SIZES[size]
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=L, family="performer",
        mixer=PerformerConfig(n_heads=H, num_features=M),
        ffn=FFNConfig(kind="mlp", expansion=4, activation="gelu"),
        norm=norm, position="scaled_sin", tie_embeddings=True,
    )


def presets() -> dict[str, "ModelConfig"]:
    out = {f"performer-{size}": _preset(size) for size in _SIZES}
    out["performer-base-mlm"] = _preset("base", "scalenorm")  # Table 8 (MLM on C4): ScaleNorm
    return out


FAMILY = register_family(
    "performer", PerformerConfig, build,
    seed="flash-transformer-quality-in-linear-time.txt",
    description="Performer, ReLU kernel (FLASH seed baseline), RoPE",
    presets=presets,
)
