"""Family ``combiner``: the FLASH seed's chunked softmax baseline, Combiner in its row-major axial
form (Section 4 "Baselines", Appendix A; Tables 8-10: softmax, "Rowmajor-Axial", MLP + GELU,
expansion 4, ScaledSin + RoPE, LayerNorm for LM / ScaleNorm for MLM, chunk size 256 (base) /
512 (large), 124M / 562M).

The mixer is :class:`~lintime.layers.combiner.CombinerAttention`; the block is Transformer+'s.
Vocabulary 32,000 and tied embeddings, the softmax family's reading of the tables
(``docs/models.md``).  The ``'proj'`` row summary's two ``d x d`` projections are what puts
Combiner 2d^2 per layer above Transformer+ (124M vs 110M, 562M vs 486M).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.combiner import ROW_SUMMARIES, CombinerAttention
from lintime.models.shared import check_heads, check_positive_int
from lintime.models.registry import register_family
from lintime.models.config import BYTE_VOCAB

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class CombinerConfig:
    """``n_heads`` heads of width ``head_dim`` (``None``: ``d_model // n_heads``);
    ``chunk_size`` the row length ``C`` (the tables' "chunk size"); ``row_summary`` how a row's
    summary key is made: ``proj`` (the reference's LM setting, ``2 d^2`` parameters), ``wsum``,
    ``none``; ``rope`` on q, k (and on the ``proj`` summary keys); ``bias`` on every projection."""

    n_heads: int = 12
    head_dim: int | None = None
    chunk_size: int = 256
    row_summary: str = "proj"
    rope: bool = True
    rope_base: float = 10000.0
    bias: bool = True

    def __post_init__(self):
        w = "CombinerConfig"
        check_positive_int(w, "n_heads", self.n_heads)
        check_positive_int(w, "head_dim", self.head_dim, none_ok=True)
        check_positive_int(w, "chunk_size", self.chunk_size)
        if self.row_summary not in ROW_SUMMARIES:
            raise ValueError(f"{w}: row_summary must be one of {ROW_SUMMARIES}, got {self.row_summary!r}")
        if not isinstance(self.rope, bool) or not isinstance(self.bias, bool):
            raise ValueError(f"{w}: rope and bias must be bools, got rope={self.rope!r}, bias={self.bias!r}")
        if isinstance(self.rope_base, bool) or not isinstance(self.rope_base, (int, float)) or self.rope_base <= 1:
            raise ValueError(f"{w}: rope_base must be a number > 1, got {self.rope_base!r}")

    def check(self, config: "ModelConfig") -> None:
        check_heads("CombinerConfig", config, self.n_heads, self.head_dim)
        hd = self.head_dim if self.head_dim is not None else config.d_model // self.n_heads
        if self.rope and hd % 2:
            raise ValueError(f"CombinerConfig: RoPE needs an even head size, got {hd}")


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> CombinerAttention:
    m: CombinerConfig = config.mixer
    return CombinerAttention(
        config.d_model, m.n_heads, head_dim=m.head_dim, chunk_size=m.chunk_size, row_summary=m.row_summary,
        rope=m.rope, rope_base=m.rope_base, causal=causal, bias=m.bias, norm_eps=config.norm_eps,
    )


# ---------------------------------------------------------------------------- presets
SEED_VOCAB = 32_000

# size -> (d_model, n_layers, n_heads, vocab, row length C)
_SIZES = {
    "tiny": (64, 2, 4, BYTE_VOCAB, 8),
    "small": (256, 4, 4, BYTE_VOCAB, 32),
    "base": (768, 12, 12, SEED_VOCAB, 256),  # Tables 8-9
    "large": (1024, 36, 16, SEED_VOCAB, 512),  # Table 10
}


def _preset(size: str, norm: str = "layernorm") -> "ModelConfig":
    from lintime.models.config import FFNConfig, ModelConfig

    d, L, H, vocab, C = _SIZES[size]
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=L, family="combiner",
        mixer=CombinerConfig(n_heads=H, chunk_size=C),
        ffn=FFNConfig(kind="mlp", expansion=4, activation="gelu"),
        norm=norm, position="scaled_sin", tie_embeddings=True,
    )


def presets() -> dict[str, "ModelConfig"]:
    out = {f"combiner-{size}": _preset(size) for size in _SIZES}
    out["combiner-base-mlm"] = _preset("base", "scalenorm")  # Table 8 (MLM on C4): ScaleNorm
    return out


FAMILY = register_family(
    "combiner", CombinerConfig, build,
    seed="flash-transformer-quality-in-linear-time.txt",
    description="Combiner, row-major axial (FLASH seed baseline), RoPE",
    presets=presets,
)
