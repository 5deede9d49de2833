"""Family ``gla``: the GLA Transformer of the seed ``gated-linear-attention-zh.txt`` (§4.4).

Block: pre-norm RMSNorm (LLaMA-style, the seed's Transformer++ recipe), the multi-head GLA
mixer (:class:`~lintime.layers.gla.GatedLinearAttention`), a SwiGLU FFN
(``FFNConfig(kind='glu', activation='silu', value_activation='identity', bias=False)``: the
framework's GLU expresses it as is), no absolute or relative position embedding (the gated
recurrence orders the tokens), tied embeddings.

Seed-scale presets ``gla-340m`` / ``gla-1.3b``: the seed names the two sizes (340M / 1.3B,
Mistral tokenizer: vocabulary 32,000) and fixes 4 heads, ``d_k = d/2``, ``d_v = d``, gate rank 16,
``tau = 16``; it does not print the widths.  ``d_model`` 1024 / 2048, 24 layers and the SwiGLU
width (``2/3 * 4d`` rounded up to a multiple of 256: 2816 / 5632) are the GLA authors' released
configurations.  With tied embeddings they give 341.7M / 1.299B (see ``docs/models_linear.md``).
``gla-medium`` (~25M, byte vocabulary) is the GPU quality study's size (``benchmarks/quality``),
``gla-base`` (~110M, vocabulary 32,000) the size of the other ``-base`` presets.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.gla import HEAD_NORMS, GatedLinearAttention
from lintime.models.shared import check_positive_int
from lintime.models.registry import register_family
from lintime.models.config import BYTE_VOCAB
from lintime.models.shared import SEED_VOCAB

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig


def _pos_num(where: str, name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{where}: {name} must be a number > 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class GLAConfig:
    """``n_heads`` (seed: 4); key / value widths ``expand_k * d`` / ``expand_v * d`` in total
    (seed: ``d/2``, ``d``); ``gate_rank`` of ``W_a1 W_a2`` (16); ``gate_temperature`` ``tau``
    (16: ``g = logsigmoid(.) / tau``); ``head_norm`` ``layernorm`` (seed) | ``rmsnorm``;
    ``output_gate`` the SiLU gate ``r``; ``chunk_size`` of the op's chunked form."""

    n_heads: int = 4
    expand_k: float = 0.5
    expand_v: float = 1.0
    gate_rank: int = 16
    gate_temperature: float = 16.0
    head_norm: str = "layernorm"
    output_gate: bool = True
    chunk_size: int = 64

    def __post_init__(self):
        w = "GLAConfig"
        check_positive_int(w, "n_heads", self.n_heads)
        check_positive_int(w, "gate_rank", self.gate_rank)
        check_positive_int(w, "chunk_size", self.chunk_size)
        for name in ("expand_k", "expand_v", "gate_temperature"):
            _pos_num(w, name, getattr(self, name))
        if self.head_norm not in HEAD_NORMS:
            raise ValueError(f"{w}: head_norm must be one of {HEAD_NORMS}, got {self.head_norm!r}")
        if not isinstance(self.output_gate, bool):
            raise ValueError(f"{w}: output_gate must be a bool, got {self.output_gate!r}")

    def check(self, config: "ModelConfig") -> None:
        d, H = config.d_model, self.n_heads
        for name, e in (("expand_k", self.expand_k), ("expand_v", self.expand_v)):
            width = e * d
            if width != round(width) or round(width) % H:
                raise ValueError(f"GLAConfig: {name} * d_model = {width:g} must be an integer divisible by "
                                 f"n_heads={H}")


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> GatedLinearAttention:
    m: GLAConfig = config.mixer
    return GatedLinearAttention(
        config.d_model, m.n_heads, expand_k=m.expand_k, expand_v=m.expand_v, gate_rank=m.gate_rank,
        gate_temperature=m.gate_temperature, head_norm=m.head_norm, norm_eps=config.norm_eps,
        output_gate=m.output_gate, causal=causal, chunk_size=m.chunk_size,
    )


# ---------------------------------------------------------------------------- presets
MISTRAL_VOCAB = 32_000  # seed A4: "Mistral tokenizer"

# name -> (d_model, n_layers, n_heads, vocab, SwiGLU width or None for 2/3 * 4d)
_SIZES = {
    "gla-tiny": (64, 2, 4, BYTE_VOCAB, None),
    "gla-small": (256, 4, 4, BYTE_VOCAB, None),
    "gla-medium": (512, 8, 4, BYTE_VOCAB, None),  # the GPU quality study's size (benchmarks/quality)
    # the ~110M size of the other ``-base`` presets (d=768, 12 layers, vocabulary 32,000) with the
    # seed's GLA block: 4 heads, d_k = d/2, SwiGLU width 2/3 * 4d = 2048 (a multiple of 256, like
    # the released 340M / 1.3B configurations)
    "gla-base": (768, 12, 4, SEED_VOCAB, 2048),
    "gla-340m": (1024, 24, 4, MISTRAL_VOCAB, 2816),
    "gla-1.3b": (2048, 24, 4, MISTRAL_VOCAB, 5632),
}


def _preset(name: str) -> "ModelConfig":
    from lintime.models.config import FFNConfig, ModelConfig

    d, L, H, vocab, hidden = _SIZES[name]
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=L, family="gla",
        mixer=GLAConfig(n_heads=H),
        # seed §4.4: "the FFN uses the SwiGLU variant"
        ffn=FFNConfig(kind="glu", expansion=4, hidden=hidden, activation="silu", value_activation="identity",
                      bias=False),
        norm="rmsnorm", position="none", tie_embeddings=True,
    )


def presets() -> dict[str, "ModelConfig"]:
    return {name: _preset(name) for name in _SIZES}


FAMILY = register_family(
    "gla", GLAConfig, build,
    seed="gated-linear-attention-zh.txt",
    description="gated linear attention Transformer (data-dependent decay, SwiGLU)",
    presets=presets,
)
