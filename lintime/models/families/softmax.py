"""Family ``softmax``: multi-head softmax attention, the Transformer baselines of the FLASH seed.

* Transformer:   no RoPE, learned absolute positions, MLP (GELU)       (seed Tables 8-9)
* Transformer+:  RoPE, ScaledSin absolute positions, MLP (GELU)        (Tables 8-10)
* Transformer++: RoPE, ScaledSin absolute positions, GLU (GELU)        (Tables 8-10)

The three differ only in this sub-config's ``rope`` and in model-level fields (``position``,
``ffn``); see :mod:`lintime.models.presets`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.attention import MultiHeadAttention
from lintime.models.registry import register_family
from lintime.models.shared import SEED_VOCAB
from lintime.models.config import BYTE_VOCAB

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class SoftmaxConfig:
    """``n_heads`` heads of width ``head_dim`` (``None``: ``d_model // n_heads``); ``rope``
    rotates q and k (seed Code 3) with base ``rope_base``; ``bias`` on the q/k/v/out projections."""

    n_heads: int = 12
    head_dim: int | None = None
    rope: bool = False
    rope_base: float = 10000.0
    bias: bool = True

    def __post_init__(self):
        w = "SoftmaxConfig"
        if not isinstance(self.n_heads, int) or isinstance(self.n_heads, bool) or self.n_heads < 1:
            raise ValueError(f"{w}: n_heads must be a positive int, got {self.n_heads!r}")
        if self.head_dim is not None and (not isinstance(self.head_dim, int) or self.head_dim < 1):
            raise ValueError(f"{w}: head_dim must be a positive int or None, got {self.head_dim!r}")
        if not isinstance(self.rope, bool) or not isinstance(self.bias, bool):
            raise ValueError(f"{w}: rope and bias must be bools, got rope={self.rope!r}, bias={self.bias!r}")
        if not isinstance(self.rope_base, (int, float)) or self.rope_base <= 1:
            raise ValueError(f"{w}: rope_base must be a number > 1, got {self.rope_base!r}")

    def head_size(self, d_model: int) -> int:
        return self.head_dim if self.head_dim is not None else d_model // self.n_heads

    def check(self, config: "ModelConfig") -> None:
        if self.head_dim is None and config.d_model % self.n_heads:
            raise ValueError(
                f"SoftmaxConfig: d_model={config.d_model} is not divisible by n_heads={self.n_heads}; "
                f"change n_heads or set head_dim"
            )
        if self.rope and self.head_size(config.d_model) % 2:
            raise ValueError(f"SoftmaxConfig: RoPE needs an even head size, got {self.head_size(config.d_model)}")


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> MultiHeadAttention:
    m: SoftmaxConfig = config.mixer
    return MultiHeadAttention(
        config.d_model, m.n_heads, head_dim=m.head_dim, causal=causal, rope=m.rope,
        rope_base=m.rope_base, bias=m.bias,
    )


# ---------------------------------------------------------------------------- presets
# size -> (d_model, n_layers, n_heads, vocab, learned-position table); n_layers counts blocks
# (the seed's "12+12 layers" = 12 attention + 12 FFN layers = 12 blocks)
_SIZES = {
    "tiny": (64, 2, 4, BYTE_VOCAB, 1024),
    "small": (256, 4, 4, BYTE_VOCAB, 1024),
    # the GPU quality study's size (benchmarks/quality, ~26M parameters): head width 64 as in the seed's
    # base models; the learned table (vanilla Transformer only) covers the study's longest context
    "medium": (512, 8, 8, BYTE_VOCAB, 8192),
    "base": (768, 12, 12, SEED_VOCAB, 512),  # seed Tables 8-9
    "large": (1024, 36, 16, SEED_VOCAB, 1024),  # seed Table 10
}


def _preset(size: str, model: str, norm: str = "layernorm") -> "ModelConfig":
    from lintime.models.config import FFNConfig, ModelConfig

    d, L, H, vocab, max_pos = _SIZES[size]
    rope = model != "transformer"
    return ModelConfig(
        vocab_size=vocab,
        d_model=d,
        n_layers=L,
        family="softmax",
        mixer=SoftmaxConfig(n_heads=H, rope=rope),
        # Tables 8-10: MLP for Transformer / +, GLU for ++, GELU, expansion rate 4
        ffn=FFNConfig(kind="glu" if model == "transformer-pp" else "mlp", expansion=4, activation="gelu"),
        norm=norm,
        # Tables 8-10: learned absolute positions for Transformer, ScaledSin for + / ++
        position="scaled_sin" if rope else "learned",
        max_positions=0 if rope else max_pos,
        tie_embeddings=True,
    )


def presets() -> dict[str, "ModelConfig"]:
    out = {}
    for model in ("transformer", "transformer-p", "transformer-pp"):
        for size in _SIZES:
            if model == "transformer" and size == "large":
                continue  # Table 10 has no vanilla Transformer
            out[f"{model}-{size}"] = _preset(size, model)
    # Table 8 (MLM on C4): ScaleNorm for Transformer+ / ++, LayerNorm for the vanilla Transformer
    out["transformer-base-mlm"] = _preset("base", "transformer", "layernorm")
    out["transformer-p-base-mlm"] = _preset("base", "transformer-p", "scalenorm")
    out["transformer-pp-base-mlm"] = _preset("base", "transformer-pp", "scalenorm")
    return out


FAMILY = register_family(
    "softmax", SoftmaxConfig, build,
    seed="flash-transformer-quality-in-linear-time.txt",
    description="multi-head softmax attention (Transformer / Transformer+ / Transformer++)",
    presets=presets,
)
