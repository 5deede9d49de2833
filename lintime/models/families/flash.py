"""Family ``flash``: FLASH, GAUs with mixed chunk attention (FLASH seed Section 3, Code 8, Tables
4, 8-10).

Same model layout as FLASH-Quad (mixer-only blocks, ScaledSin + RoPE, see
:mod:`lintime.models.families.gau`); the mixer is :class:`lintime.layers.flash.FLASH`.
``flash-base`` is Table 9's 24 layers at d=768, e=1536, s=128, C=256; ``flash-large`` Table 10's 72
layers at d=1024 with C=512.  ``flash-tiny`` is the default model of ``lintime train``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.flash import FLASH
from lintime.models.shared import (
    SIZES,
    check_bool,
    check_choice,
    check_expansion,
    check_int,
    check_rope_base,
    gau_model,
)
from lintime.models.registry import register_family

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """One FLASH layer per block (see :class:`lintime.layers.flash.FLASH` for the math).

    ``s``             shared key width (128);
    ``expansion``     ``e = round(expansion * d_model)`` (2);
    ``chunk_size``    ``C`` (seed: 256; Table 10 / PG-19: 512);
    ``linear_norm``   normaliser of the linear part: ``'tokens'`` (Code 8 with its segment mask, the
                      commentary's "divide by t") | ``'chunk'`` (``/C``, Code 8 without the mask) |
                      ``'none'`` (Code 1);
    ``scaling``       quadratic part: ``'n'`` = Code 8 ``relu(qk/C + b)^2`` | ``'ns'`` = commentary
                      ``relu(qk/sqrt(s) + b)^2 / C``;
    ``first_to_all``  Table 4: every chunk's first token also attends, with single-head softmax, to
                      all earlier tokens of its sequence (decoding memory becomes O(T));
    ``rel_bias``      chunk-local Toeplitz bias (``False``: RoPE only);
    ``rope_base``, ``bias`` (dense biases).
    """

    s: int = 128
    expansion: float = 2.0
    chunk_size: int = 256
    linear_norm: str = "tokens"
    scaling: str = "n"
    first_to_all: bool = False
    rel_bias: bool = True
    rope_base: float = 10000.0
    bias: bool = True

    def __post_init__(self):
        w = "FlashConfig"
        check_int(w, "s", self.s)
        if self.s % 2:
            raise ValueError(f"{w}: RoPE needs an even s, got {self.s}")
        check_expansion(w, self.expansion)
        check_int(w, "chunk_size", self.chunk_size)
        check_choice(w, "linear_norm", self.linear_norm, ("tokens", "chunk", "none"))
        check_choice(w, "scaling", self.scaling, ("n", "ns"))
        check_bool(w, first_to_all=self.first_to_all, rel_bias=self.rel_bias, bias=self.bias)
        check_rope_base(w, self.rope_base)

    def expansion_dim(self, d_model: int) -> int:
        return max(1, round(self.expansion * d_model))


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> FLASH:
    m: FlashConfig = config.mixer
    return FLASH(
        config.d_model, expansion_dim=m.expansion_dim(config.d_model), key_dim=m.s, chunk_size=m.chunk_size,
        causal=causal, linear_norm=m.linear_norm, scaling=m.scaling, first_to_all=m.first_to_all,
        rel_bias=m.rel_bias, rope_base=m.rope_base, bias=m.bias,
    )


def presets() -> dict[str, "ModelConfig"]:
    out = {}
    for size, (_, _, s, C, _, _) in SIZES.items():
        out[f"flash-{size}"] = gau_model(size, "flash", FlashConfig(s=s, chunk_size=C))
    # chunk-size ablation of the quality study (benchmarks/quality; seed Figure 8): flash-medium with
    # C = 64, 128, 512 (flash-medium itself has the seed's default C = 256)
    for C in (64, 128, 512):
        out[f"flash-medium-c{C}"] = gau_model("medium", "flash", FlashConfig(s=SIZES["medium"][2], chunk_size=C))
    # Table 8 (MLM on C4): ScaleNorm
    out["flash-base-mlm"] = gau_model("base", "flash", FlashConfig(chunk_size=256), norm="scalenorm")
    return out


FAMILY = register_family(
    "flash", FlashConfig, build,
    seed="flash-transformer-quality-in-linear-time.txt",
    description="FLASH: GAU with mixed chunk attention (linear time, constant decoding memory)",
    presets=presets,
)
