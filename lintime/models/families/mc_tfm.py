"""Family ``mc_tfm``: MC-TFM++, Transformer++ with mixed chunk attention (FLASH seed Section 4.4,
Figure 7, Table 5).

"We apply the same idea of mixed chunk attention to Transformer++ ... MC-TFM++ uses quadratic MHSA
within each chunk and multi-head linear attention across chunks."  So the model is
Transformer++ (RoPE, ScaledSin, GEGLU FFN with expansion 4, LayerNorm; seed Tables 8-9) whose
attention is :class:`lintime.layers.mc_attention.MixedChunkMHA`, with FLASH's chunk size (256).
The seed gives MC-TFM++ no parameter count; its Figure 7 / Table 5 compare it at the ~110M scale
of Transformer++, which ``mc-tfm-pp-base`` matches (Transformer++ plus ``4 d`` per layer).
Table 10 (PG-19, ~500M) has no MC-TFM++, so there is no ``-large`` preset.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.mc_attention import MixedChunkMHA
from lintime.models.config import BYTE_VOCAB
from lintime.models.shared import check_bool, check_choice, check_int, check_rope_base, fail
from lintime.models.shared import SEED_VOCAB
from lintime.models.registry import register_family

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class MCConfig:
    """``n_heads`` heads of width ``head_dim`` (``None``: ``d_model // n_heads``); ``chunk_size``
    ``C``; ``linear_norm`` of the linear part (``'tokens'`` | ``'chunk'`` | ``'none'``, as FLASH);
    ``rope`` on q, k and the linear heads (Transformer++: yes); ``bias`` on the projections."""

    n_heads: int = 12
    head_dim: int | None = None
    chunk_size: int = 256
    linear_norm: str = "tokens"
    rope: bool = True
    rope_base: float = 10000.0
    bias: bool = True

    def __post_init__(self):
        w = "MCConfig"
        check_int(w, "n_heads", self.n_heads)
        if self.head_dim is not None:
            check_int(w, "head_dim", self.head_dim)
        check_int(w, "chunk_size", self.chunk_size)
        check_choice(w, "linear_norm", self.linear_norm, ("tokens", "chunk", "none"))
        check_bool(w, rope=self.rope, bias=self.bias)
        check_rope_base(w, self.rope_base)

    def head_size(self, d_model: int) -> int:
        return self.head_dim if self.head_dim is not None else d_model // self.n_heads

    def check(self, config: "ModelConfig") -> None:
        if self.head_dim is None and config.d_model % self.n_heads:
            fail("MCConfig", f"d_model={config.d_model} is not divisible by n_heads={self.n_heads}; "
                             f"change n_heads or set head_dim")
        if self.rope and self.head_size(config.d_model) % 2:
            fail("MCConfig", f"RoPE needs an even head size, got {self.head_size(config.d_model)}")


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> MixedChunkMHA:
    m: MCConfig = config.mixer
    return MixedChunkMHA(
        config.d_model, m.n_heads, head_dim=m.head_dim, chunk_size=m.chunk_size, causal=causal,
        linear_norm=m.linear_norm, rope=m.rope, rope_base=m.rope_base, bias=m.bias,
    )


# size -> (d_model, blocks, heads, chunk size, vocab).  A block is attention + GLU, i.e. two GAUs
# worth of parameters (seed Section 2), so tiny / small have half the FLASH presets' depth.
_SIZES = {
    "tiny": (128, 2, 4, 64, BYTE_VOCAB),
    "small": (256, 4, 4, 128, BYTE_VOCAB),
    "base": (768, 12, 12, 256, SEED_VOCAB),  # Transformer++ of Tables 8-9 + C = 256
}


def _preset(size: str, norm: str = "layernorm") -> "ModelConfig":
    from lintime.models.config import FFNConfig, ModelConfig

    d, L, H, C, vocab = _SIZES[size]
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=L, family="mc_tfm", mixer=MCConfig(n_heads=H, chunk_size=C),
        ffn=FFNConfig(kind="glu", expansion=4, activation="gelu"),  # Transformer++: GLU, GELU, rate 4
        norm=norm, position="scaled_sin", tie_embeddings=True,
    )


def presets() -> dict[str, "ModelConfig"]:
    out = {f"mc-tfm-pp-{size}": _preset(size) for size in _SIZES}
    out["mc-tfm-pp-base-mlm"] = _preset("base", "scalenorm")  # as Transformer++ in Table 8
    return out


FAMILY = register_family(
    "mc_tfm", MCConfig, build,
    seed="flash-transformer-quality-in-linear-time.txt",
    description="MC-TFM++: Transformer++ with mixed chunk attention (local softmax + global linear)",
    presets=presets,
)
