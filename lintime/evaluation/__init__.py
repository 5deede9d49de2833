"""Evaluation: held-out bits per byte / perplexity at several context lengths
(:func:`evaluate`, rules in :mod:`lintime.evaluation.lm`), and :func:`load_split` to find a
checkpoint's held-out data; :mod:`lintime.evaluation.tasks` (MQAR recall, passkey retrieval,
length extrapolation by position) and :mod:`lintime.evaluation.units` (per-token / per-byte
conversion, mean ± spread).  ``lintime eval`` (:mod:`lintime.cli.eval`) is the command line.
See ``docs/cli_eval.md``."""

from lintime.evaluation.data import HELD_OUT, load_split
from lintime.evaluation.lm import (
    ContextResult,
    EvalReport,
    count_bytes,
    evaluate,
    score_context,
    select_documents,
)

__all__ = [
    "HELD_OUT",
    "ContextResult",
    "EvalReport",
    "count_bytes",
    "evaluate",
    "load_split",
    "score_context",
    "select_documents",
]
