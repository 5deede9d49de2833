"""Offline tasks that judge a model beyond perplexity, deterministic by seed, nothing downloaded:

* :mod:`~lintime.evaluation.tasks.mqar` -- multi-query associative recall (Zoology);
* :mod:`~lintime.evaluation.tasks.passkey` -- a number hidden in filler text, retrieved by greedy
  decoding, against its depth and the context length;
* :mod:`~lintime.evaluation.tasks.extrapolation` -- bits per byte by position bucket, up to many
  times the trained length.

``lintime eval RUN --task NAME`` runs them (see docs/cli_eval.md)."""

from lintime.evaluation.tasks.extrapolation import ExtrapolationReport, evaluate_extrapolation
from lintime.evaluation.tasks.mqar import MQARConfig, MQARResult, evaluate_mqar, mqar_examples
from lintime.evaluation.tasks.passkey import PasskeyReport, evaluate_passkey, write_lm_eval_task

TASKS = ("lm", "mqar", "passkey", "extrapolation")

__all__ = [
    "TASKS",
    "ExtrapolationReport",
    "MQARConfig",
    "MQARResult",
    "PasskeyReport",
    "evaluate_extrapolation",
    "evaluate_mqar",
    "evaluate_passkey",
    "mqar_examples",
    "write_lm_eval_task",
]
