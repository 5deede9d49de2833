"""Attention operations, ``[B, T, H, D]`` layout (SPEC section 2).

Each family lives in its own folder with ``naive.py`` (textbook reference), ``chunk.py``
(chunked PyTorch, any device) and, where the op carries a state, ``recurrent.py``; the
public function dispatches through :func:`lintime.ops.dispatch.select`.
"""

from lintime.ops.gau import gau_attention
from lintime.ops.gla import gated_linear_attention
from lintime.ops.linear import linear_attention
from lintime.ops.mixed_chunk import MixedChunkState, mixed_chunk_attention
from lintime.ops.softmax import softmax_attention
from lintime.ops.vq import VQState, vq_attention

__all__ = [
    "softmax_attention",
    "gau_attention",
    "mixed_chunk_attention",
    "MixedChunkState",
    "linear_attention",
    "gated_linear_attention",
    "vq_attention",
    "VQState",
]
