"""Generation: sampling text from a causal LM through its constant-size decoding state.

* :mod:`~lintime.generation.decode` -- :func:`prefill` (the prompt, in chunks, through the
  state) and :func:`decode_one_token`: the two small model calls, compilable from outside
  (``docs/design/conventions.md`` §6);
* :mod:`~lintime.generation.static` -- :class:`StaticDecoder`: the state in preallocated buffers,
  updated in place (fixed shapes per step);
* :mod:`~lintime.generation.graphs` -- :class:`DecodeLoop`: sampling + one step, captured in a CUDA
  graph and replayed per token;
* :mod:`~lintime.generation.sampling` -- temperature, top-k, nucleus (top-p), seeded draws;
* :mod:`~lintime.generation.text` -- incremental detokenisation (partial UTF-8) and stop strings;
* :mod:`~lintime.generation.loop` -- the loop: :func:`generate` / :func:`stream`.

``lintime generate`` (:mod:`lintime.cli.generate`) is the command line over :func:`stream`.
See ``docs/cli_eval.md``.
"""

from lintime.generation.decode import (
    compiled_decode_one_token,
    decode_one_token,
    prefill,
)
from lintime.generation.loop import (
    GenerationConfig,
    Sample,
    TextPiece,
    generate,
    stream,
)
from lintime.generation.graphs import DecodeLoop, build_loop
from lintime.generation.sampling import (
    filtered_probs,
    sample,
    sample_seeded,
    top_k_filter,
    top_p_filter,
)
from lintime.generation.static import StaticDecoder
from lintime.generation.text import Detokenizer, StopMatcher

__all__ = [
    "DecodeLoop",
    "Detokenizer",
    "GenerationConfig",
    "Sample",
    "StaticDecoder",
    "StopMatcher",
    "TextPiece",
    "build_loop",
    "compiled_decode_one_token",
    "decode_one_token",
    "filtered_probs",
    "generate",
    "prefill",
    "sample",
    "sample_seeded",
    "stream",
    "top_k_filter",
    "top_p_filter",
]
