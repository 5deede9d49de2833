"""Family ``linear``: the linear-self-attention GPT-2 of the seed
``linear-self-attention-is-faster.txt`` -- "an exact replica of GPT-2 with the exponentials of the
attention removed" (plus a positive feature map and the normaliser, seed footnote 1 and "TODO:
the normalization factor is actually important ... the experiments we show include it").

The block is GPT-2's: pre-norm LayerNorm, this mixer, a GELU MLP of width 4d (GPT-2's tanh
GELU), biases everywhere, learned absolute positions (1024), tied embeddings, vocabulary 50,257
(GPT-2's BPE).  Only the mixer changes (:class:`~lintime.layers.linear_attention.LinearAttention`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.linear_attention import (
    FEATURE_MAPS,
    LinearAttention,
    check_feature_map,
)
from lintime.models.registry import register_family
from lintime.models.shared import check_heads, check_positive_int
from lintime.models.config import BYTE_VOCAB

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    """``n_heads`` heads of width ``head_dim`` (``None``: ``d_model // n_heads``);
    ``feature_map`` one of ``elu`` (``elu + 1``, default), ``relu`` (``relu + feature_eps``),
    ``identity`` (needs ``normalize=False``); ``normalize``: divide by ``phi(q) . z`` (the seed's
    experiments include it); ``chunk_size``: chunk of the chunked training form (the seed's
    "hybrid" mode); ``bias`` on the q/k/v/out projections (GPT-2: yes)."""

    n_heads: int = 12
    head_dim: int | None = None
    feature_map: str = "elu"
    feature_eps: float = 1e-3
    normalize: bool = True
    chunk_size: int = 64
    bias: bool = True

    def __post_init__(self):
        w = "LinearConfig"
        check_positive_int(w, "n_heads", self.n_heads)
        check_positive_int(w, "head_dim", self.head_dim, none_ok=True)
        check_positive_int(w, "chunk_size", self.chunk_size)
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"{w}: feature_map must be one of {FEATURE_MAPS}, got {self.feature_map!r}")
        check_feature_map(w, self.feature_map, self.normalize, self.feature_eps)
        if not isinstance(self.bias, bool):
            raise ValueError(f"{w}: bias must be a bool, got {self.bias!r}")

    def check(self, config: "ModelConfig") -> None:
        check_heads("LinearConfig", config, self.n_heads, self.head_dim)


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> LinearAttention:
    m: LinearConfig = config.mixer
    return LinearAttention(
        config.d_model, m.n_heads, head_dim=m.head_dim, feature_map=m.feature_map, feature_eps=m.feature_eps,
        normalize=m.normalize, causal=causal, chunk_size=m.chunk_size, bias=m.bias,
    )


# ---------------------------------------------------------------------------- presets
GPT2_VOCAB = 50_257  # GPT-2's byte-level BPE (the seed trains "an exact replica of GPT2")

# name -> (d_model, n_layers, n_heads, vocab, learned-position table)
_SIZES = {
    "linear-tiny": (64, 2, 4, BYTE_VOCAB, 1024),
    "linear-small": (256, 4, 4, BYTE_VOCAB, 1024),
    # the GPU quality study's size (benchmarks/quality, ~29M parameters with the table): GPT-2's layout
    # at d=512; the learned table covers the study's longest context (8k), so evaluating a model
    # trained at 1k at 2k-8k reads positions it never trained (what learned positions give)
    "linear-medium": (512, 8, 8, BYTE_VOCAB, 8192),
    # the four GPT-2 shapes of the seed's first plot ("120 million to 1.5 billion parameters");
    # 1024 positions like GPT-2 (the seed's "TODO: GPT2 is not suited for sampling for arbitrarily
    # long context due to the positional encodings": decoding past 1024 tokens raises)
    "linear-gpt2-124m": (768, 12, 12, GPT2_VOCAB, 1024),
    "linear-gpt2-355m": (1024, 24, 16, GPT2_VOCAB, 1024),
    "linear-gpt2-774m": (1280, 36, 20, GPT2_VOCAB, 1024),
    "linear-gpt2-1.5b": (1600, 48, 25, GPT2_VOCAB, 1024),
}


def _preset(name: str) -> "ModelConfig":
    from lintime.models.config import FFNConfig, ModelConfig

    d, L, H, vocab, max_pos = _SIZES[name]
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=L, family="linear",
        mixer=LinearConfig(n_heads=H),
        ffn=FFNConfig(kind="mlp", expansion=4, activation="gelu_tanh"),  # GPT-2's MLP ("gelu_new")
        norm="layernorm", position="learned", max_positions=max_pos, tie_embeddings=True,
    )


def presets() -> dict[str, "ModelConfig"]:
    return {name: _preset(name) for name in _SIZES}


FAMILY = register_family(
    "linear", LinearConfig, build,
    seed="linear-self-attention-is-faster.txt",
    description="linear self-attention GPT-2 (softmax's exponential removed, positive feature map)",
    presets=presets,
)
