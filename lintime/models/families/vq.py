"""Family ``vq``: Transformer-VQ, a stack of single-head gated VQ-attention units (seed
``transformer-vq.txt``: Section 3, Appendix C Table 10, Code 1).

Blocks are mixer-only (``ffn=None``: like a GAU, the gated unit is its own feed-forward; two of them
replace one Transformer layer, Remark 3.2), pre-norm with RMS LayerNorm (App. C: "pre-norm
placement ... always used the RMS LayerNorm variant"), no absolute positions on text (the
Transformer-XL bias inside the layer carries position).  The mixer is
:class:`lintime.layers.vq.VQAttention`.

``vq-190m`` is the seed's 190M model (Enwik8 column of Table 10; the ImageNet64 190M model has the
same architecture): 48 gated units (the authors' 24 "layers" of two units) at ``D_m = 768``,
``D_k = 128``, ``D_v = 1536``, ``S = 512`` codes, ``L = 512``; "the classifier layer omits LayerNorm
and is independently parameterized" (App. C.2: ``final_norm=False``, ``tie_embeddings=False``).
Vocabulary: **260**, Enwik8's 256 bytes plus the 4 specials of lintime's byte tokenizer
(``<pad> <bos> <eos> <mask>``).  Regularisation of the Enwik8 column: residual dropout 0.5
(``dropout``; lintime also applies it to the embedding output), relative-sinusoid dropout 0.2;
LayerDrop 0.3 is not implemented.  ``vq-tiny`` / ``vq-small`` are byte-level CPU models, ``vq-medium``
(~29M) the byte-level model of the GPU quality study (``benchmarks/quality``), ``vq-base`` the ~110M
size of the other ``-base`` presets (vocabulary 32,000).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lintime.layers.vq import REDUCTIONS, VQAttention
from lintime.models.config import BYTE_VOCAB
from lintime.models.shared import SEED_VOCAB
from lintime.models.shared import (
    check_bool,
    check_choice,
    check_expansion,
    check_int,
    fail,
)
from lintime.models.registry import register_family

if TYPE_CHECKING:
    from lintime.models.config import ModelConfig

# size -> (d_model, gated units, D_k, codes S, block length L, model dropout, sinusoid dropout, vocab)
SIZES = {
    "tiny": (128, 4, 64, 64, 64, 0.0, 0.0, BYTE_VOCAB),
    "small": (256, 8, 128, 256, 128, 0.0, 0.0, BYTE_VOCAB),
    # the GPU quality study's size (benchmarks/quality, ~27M parameters): 16 units at d=512 like
    # flash-medium; L = 256 so that the compressive cache is in use from the study's shortest
    # context (512) on; no dropout (the study trains less than one epoch)
    "medium": (512, 16, 128, 512, 256, 0.0, 0.0, BYTE_VOCAB),
    "190m": (768, 48, 128, 512, 512, 0.5, 0.2, BYTE_VOCAB),  # seed Table 10, Enwik8 column
    # the ~110M size of the other ``-base`` presets (d=768, vocabulary 32,000): the 190M model's
    # units (D_k=128, D_v=1536, S=512, L=512), 16 of them, with its separate classifier (untied:
    # 2 x 24.6M of embeddings; 110.6M in all); no dropout, like the other base presets
    "base": (768, 16, 128, 512, 512, 0.0, 0.0, SEED_VOCAB),
}


@dataclasses.dataclass(frozen=True)
class VQConfig:
    """One VQ-attention unit per block (see :class:`lintime.layers.vq.VQAttention` for the math).

    ``n_codes``      ``S``, codewords per head (seed: 512; Table 1 ablates 256 / 1024);
    ``block_len``    ``L`` (seed: 512); a query attends exactly to its own and the previous block,
                     and through the compressed cache to everything older;
    ``d_k``          key width per head (seed: 128);
    ``expansion``    ``D_v = round(expansion * d_model)``, the value and gate width (seed: 2);
    ``n_heads``      heads (seed: 1, single-head gated attention; the value width is split across
                     heads, each head has its own ``d_k`` keys and codebook);
    ``gamma``        EMA rate of the k-means codebook (seed App. C: 0.99);
    ``rel_bias``     Transformer-XL relative bias within the window (seed Code 1 ``XLBiasProducer``);
    ``sin_dropout``  dropout on its sinusoids (seed App. C ``p_dropsin``);
    ``sin_base``     maximum angular wavelength of the sinusoids (seed App. C: 1e5);
    ``reduction``    cross-block cache reduction of the op: ``serial`` | ``matmul`` | ``assoc``
                     (seed App. E Codes 2-4; all give the same result);
    ``bias``         biases on the dense projections (the authors' code: none).

    The commitment-loss weight ``beta`` (1e-4) is not a model field: the layer reports the
    unweighted loss in ``aux_losses["vq_commit"]`` and the training recipe weights it
    (``TrainConfig.aux_weight``), so it is applied exactly once.
    """

    n_codes: int = 512
    block_len: int = 512
    d_k: int = 128
    expansion: float = 2.0
    n_heads: int = 1
    gamma: float = 0.99
    rel_bias: bool = True
    sin_dropout: float = 0.0
    sin_base: float = 1e5
    reduction: str = "serial"
    bias: bool = False

    def __post_init__(self):
        w = "VQConfig"
        check_int(w, "n_codes", self.n_codes)
        check_int(w, "block_len", self.block_len)
        check_int(w, "d_k", self.d_k)
        check_expansion(w, self.expansion)
        check_int(w, "n_heads", self.n_heads)
        if not isinstance(self.gamma, (int, float)) or isinstance(self.gamma, bool) or not 0 <= self.gamma < 1:
            fail(w, f"gamma must be a number in [0, 1), got {self.gamma!r}")
        check_bool(w, rel_bias=self.rel_bias, bias=self.bias)
        if not isinstance(self.sin_dropout, (int, float)) or isinstance(self.sin_dropout, bool) \
                or not 0 <= self.sin_dropout < 1:
            fail(w, f"sin_dropout must be in [0, 1), got {self.sin_dropout!r}")
        if not isinstance(self.sin_base, (int, float)) or isinstance(self.sin_base, bool) or self.sin_base <= 1:
            fail(w, f"sin_base must be a number > 1, got {self.sin_base!r}")
        check_choice(w, "reduction", self.reduction, REDUCTIONS)

    def value_dim(self, d_model: int) -> int:
        return max(1, round(self.expansion * d_model))

    def check(self, config: "ModelConfig") -> None:
        e = self.value_dim(config.d_model)
        if e % self.n_heads:
            fail("VQConfig", f"n_heads={self.n_heads} does not divide D_v = expansion * d_model = {e}")
        if self.rel_bias and config.d_model % 2:
            fail("VQConfig", f"rel_bias needs an even d_model (sinusoids of width d_model), got {config.d_model}")


def build(config: "ModelConfig", layer_idx: int, causal: bool) -> VQAttention:
    m: VQConfig = config.mixer
    if not causal:
        fail("VQConfig", "Transformer-VQ is a decoder (causal attention only); it cannot build a MaskedLM")
    return VQAttention(
        config.d_model, key_dim=m.d_k, value_dim=m.value_dim(config.d_model), n_codes=m.n_codes,
        block_len=m.block_len, n_heads=m.n_heads, gamma=m.gamma, rel_bias=m.rel_bias,
        sin_dropout=m.sin_dropout, sin_base=m.sin_base, reduction=m.reduction, bias=m.bias,
        norm_eps=config.norm_eps,
    )


def vq_model(size: str) -> "ModelConfig":
    """A Transformer-VQ of ``size`` (see the module docstring)."""
    from lintime.models.config import ModelConfig

    d, n, d_k, S, L, drop, sin_drop, vocab = SIZES[size]
    return ModelConfig(
        vocab_size=vocab, d_model=d, n_layers=n, family="vq",
        mixer=VQConfig(n_codes=S, block_len=L, d_k=d_k, sin_dropout=sin_drop),
        ffn=None, norm="rmsnorm", position="none", final_norm=False, tie_embeddings=False, dropout=drop,
    )


def presets() -> dict[str, "ModelConfig"]:
    return {f"vq-{size}": vq_model(size) for size in SIZES}


FAMILY = register_family(
    "vq", VQConfig, build,
    seed="transformer-vq.txt",
    description="Transformer-VQ: softmax attention over vector-quantised keys in linear time (compressive cache)",
    presets=presets,
)
