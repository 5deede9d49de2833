"""Generation: sampling text from a causal LM through its constant-size decoding state.

* :mod:`~lintime.generation.decode` -- :func:`prefill` (the prompt, in chunks, through the
  state) and :func:`decode_one_token`: the two small model calls, compilable from outside
  (STYLE 8, gpt-fast);
* :mod:`~lintime.generation.sampling` -- temperature, top-k, nucleus (top-p), seeded draws;
* :mod:`~lintime.generation.text` -- incremental detokenisation (partial UTF-8) and stop strings;
* :mod:`~lintime.generation.generate` -- the loop: :func:`generate` / :func:`stream`.

``lintime generate`` (:mod:`lintime.cli.generate`) is the command line over :func:`stream`.
See ``docs/cli_eval.md``.
"""

from lintime.generation.decode import (
    compiled_decode_one_token,
    decode_one_token,
    prefill,
)
from lintime.generation.generate import (
    GenerationConfig,
    Sample,
    TextPiece,
    generate,
    stream,
)
from lintime.generation.sampling import (
    filtered_probs,
    sample,
    top_k_filter,
    top_p_filter,
)
from lintime.generation.text import Detokenizer, StopMatcher

__all__ = [
    "Detokenizer",
    "GenerationConfig",
    "Sample",
    "StopMatcher",
    "TextPiece",
    "compiled_decode_one_token",
    "decode_one_token",
    "filtered_probs",
    "generate",
    "prefill",
    "sample",
    "stream",
    "top_k_filter",
    "top_p_filter",
]
