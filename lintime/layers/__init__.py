"""Layers (``nn.Module``s) built on :mod:`lintime.ops`: norms, positional pieces, feed-forward
blocks and token mixers.  The mixer / state protocol is written down in
:mod:`lintime.layers.base`.  Nothing here imports :mod:`lintime.models` or anything higher."""

from lintime.layers.attention import KVCache, MultiHeadAttention
from lintime.layers.base import BatchState, Mixer, map_state, select_state, state_to
from lintime.layers.ffn import GLU, MLP
from lintime.layers.norms import LayerNorm, RMSNorm, ScaleNorm, build_norm
from lintime.layers.positional import (
    LearnedPositionEmbedding,
    RoPE,
    ScaledSinEmbedding,
    ToeplitzRelativeBias,
    apply_rope,
    token_positions,
)

__all__ = [
    "Mixer",
    "BatchState",
    "map_state",
    "select_state",
    "state_to",
    "MultiHeadAttention",
    "KVCache",
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
