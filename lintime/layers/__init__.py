"""Layers (``nn.Module``s) built on :mod:`lintime.ops`: norms, positional pieces, feed-forward
blocks and token mixers.  The mixer / state protocol is written down in
:mod:`lintime.layers.base`.  Nothing here imports :mod:`lintime.models` or anything higher.

Mixers (each a :class:`Mixer`; its decoding state in brackets):

* :class:`MultiHeadAttention` -- softmax multi-head attention (:class:`KVCache`);
* :class:`GAU` -- gated attention unit, quadratic (:class:`KVCache`);
* :class:`FLASH` -- GAU with mixed-chunk linear attention (:class:`FLASHState`);
* :class:`MixedChunkMHA` -- multi-head mixed-chunk attention (``lintime.ops.MixedChunkState``);
* :class:`LinearAttention` -- kernelised linear attention (:class:`LinearAttentionState`);
* :class:`GatedLinearAttention` -- GLA, data-dependent decay (a ``[N, H, K, V]`` tensor);
* :class:`PerformerAttention` -- FAVOR+ random features (:class:`LinearAttentionState`);
* :class:`CombinerAttention` -- Combiner's row-major axial attention (:class:`CombinerState`);
* :class:`VQAttention` -- Transformer-VQ (:class:`VQAttentionState`).
"""

from lintime.layers.attention import KVCache, MultiHeadAttention
from lintime.layers.base import BatchState, Mixer, map_state, select_state, state_to
from lintime.layers.combiner import CombinerAttention, CombinerState
from lintime.layers.ffn import GLU, MLP
from lintime.layers.flash import FLASH, FLASHState
from lintime.layers.gau import GAU, ScaleOffset
from lintime.layers.gla import GatedLinearAttention
from lintime.layers.linear_attention import LinearAttention, LinearAttentionState
from lintime.layers.mc_attention import MixedChunkMHA
from lintime.layers.norms import LayerNorm, RMSNorm, ScaleNorm, build_norm
from lintime.layers.performer import PerformerAttention
from lintime.layers.positional import (
    LearnedPositionEmbedding,
    RoPE,
    ScaledSinEmbedding,
    ToeplitzRelativeBias,
    apply_rope,
    token_positions,
)
from lintime.layers.vq import VQAttention, VQAttentionState

__all__ = [
    # the mixer / state protocol
    "Mixer",
    "BatchState",
    "map_state",
    "select_state",
    "state_to",
    # mixers and their states
    "MultiHeadAttention",
    "KVCache",
    "GAU",
    "ScaleOffset",
    "FLASH",
    "FLASHState",
    "MixedChunkMHA",
    "LinearAttention",
    "LinearAttentionState",
    "GatedLinearAttention",
    "PerformerAttention",
    "CombinerAttention",
    "CombinerState",
    "VQAttention",
    "VQAttentionState",
    # feed-forward, norms, positions
    "MLP",
    "GLU",
    "LayerNorm",
    "ScaleNorm",
    "RMSNorm",
    "build_norm",
    "ScaledSinEmbedding",
    "LearnedPositionEmbedding",
    "RoPE",
    "apply_rope",
    "ToeplitzRelativeBias",
    "token_positions",
]
