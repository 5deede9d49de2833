"""Family ``gau``: FLASH-Quad, a stack of Gated Attention Units (FLASH seed Section 2, Code 6,
Tables 1, 8-10).

Blocks are mixer-only (``ffn=None``: the GAU is its own feed-forward), pre-norm, with a ScaledSin
absolute embedding (``position='scaled_sin'``) and RoPE + a Toeplitz relative bias inside the
layer.  ``flash-quad-base`` is Table 9's 24 GAU layers at d=768, e=1536, s=128; ``-large`` Table
10's 72 layers at d=1024.  The sizes below are shared with the ``flash`` family.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.gau import GAU
from lintime.models.registry import register_family
from lintime.models.shared import (  # noqa: F401  (SIZES, gau_model: the flash family reads them here too)
    SIZES,
    check_bool,
    check_choice,
    check_expansion,
    check_int,
    check_rope_base,
    fail,
    gau_model,
)

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig

@dataclasses.dataclass(frozen=True)
class GAUConfig:
    """One GAU per block (see :class:`lintime.layers.gau.GAU` for the math).

    ``s``            shared key width (seed footnote 4: 128);
    ``expansion``    ``e = round(expansion * d_model)`` (seed: 2);
    ``max_len``      the fixed ``n`` of the ``1/n`` scalings and the relative-bias table size
                     (``< 512``: a direct table, sequences may not be longer; ``>= 512``: the
                     RoPE-built bias of seed Code 4, any length);
    ``kernel``       ``'relu2'`` (seed) | ``'softmax'`` (Table 1 "relu^2 -> softmax", scale ``1/sqrt(s)``);
    ``scaling``      relu2 only: ``'n'`` = seed Code 6 ``relu(qk/n + b)^2`` | ``'ns'`` = commentary
                     ``relu(qk/sqrt(s) + b)^2 / n``; ``None`` = ``'n'`` (and must be ``None`` for softmax);
    ``causal_norm``  relu2 only: ``n`` becomes the number of keys a query sees (commentary,
                     "divide by t"; non-causal: the sequence length);
    ``n_heads``      Table 1 "single-head -> multi-head" (``s`` and ``e`` split across heads);
    ``gating``       ``False``: Table 1 "no gating" (``y = dense(A V)``, no ``u``);
    ``rel_bias``     the Toeplitz bias (``False``: RoPE only, the commentary's choice);
    ``rope_base``, ``bias`` (dense biases, the seed's default).
    """

    s: int = 128
    expansion: float = 2.0
    max_len: int = 512
    kernel: str = "relu2"
    scaling: str | None = None
    causal_norm: bool = False
    n_heads: int = 1
    gating: bool = True
    rel_bias: bool = True
    rope_base: float = 10000.0
    bias: bool = True

    def __post_init__(self):
        w = "GAUConfig"
        check_int(w, "s", self.s)
        check_expansion(w, self.expansion)
        check_int(w, "max_len", self.max_len)
        check_choice(w, "kernel", self.kernel, ("relu2", "softmax"))
        check_bool(w, causal_norm=self.causal_norm, gating=self.gating, rel_bias=self.rel_bias, bias=self.bias)
        if self.kernel == "softmax":
            if self.scaling is not None:
                fail(w, f"kernel='softmax' scales scores by 1/sqrt(s) and normalises itself; "
                        f"leave scaling=None (got {self.scaling!r})")
            if self.causal_norm:
                fail(w, "causal_norm applies to the relu2 kernel (softmax normalises itself)")
        else:
            check_choice(w, "scaling", self.scaling, (None, "n", "ns"))
        check_int(w, "n_heads", self.n_heads)
        if self.s % self.n_heads or (self.s // self.n_heads) % 2:
            fail(w, f"n_heads={self.n_heads} must split s={self.s} into heads of even width (RoPE)")
        check_rope_base(w, self.rope_base)

    @property
    def resolved_scaling(self) -> str:
        return self.scaling or "n"

    def expansion_dim(self, d_model: int) -> int:
        return max(1, round(self.expansion * d_model))

    def check(self, config: "ModelConfig") -> None:
        e = self.expansion_dim(config.d_model)
        if e % self.n_heads:
            fail("GAUConfig", f"n_heads={self.n_heads} does not divide e = expansion * d_model = {e}")


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> GAU:
    m: GAUConfig = config.mixer
    return GAU(
        config.d_model, expansion_dim=m.expansion_dim(config.d_model), key_dim=m.s, max_len=m.max_len,
        causal=causal, kernel=m.kernel, scaling=m.resolved_scaling, causal_norm=m.causal_norm,
        n_heads=m.n_heads, gating=m.gating, rel_bias=m.rel_bias, rope_base=m.rope_base, bias=m.bias,
    )


def presets() -> dict[str, "ModelConfig"]:
    out = {}
    for size, (_, _, s, _, _, n) in SIZES.items():
        out[f"flash-quad-{size}"] = gau_model(size, "gau", GAUConfig(s=s, max_len=n))
    # Table 8 (MLM on C4): ScaleNorm
    out["flash-quad-base-mlm"] = gau_model("base", "gau", GAUConfig(max_len=512), norm="scalenorm")
    return out


FAMILY = register_family(
    "gau", GAUConfig, build,
    seed="flash-transformer-quality-in-linear-time.txt",
    description="Gated Attention Unit, quadratic (FLASH-Quad)",
    presets=presets,
)
