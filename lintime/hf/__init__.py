"""HF transformers integration (extra ``hf``): lintime models as ``transformers`` models.

* :class:`LintimeConfig` / :class:`LintimeForCausalLM` -- a ``PretrainedConfig`` wrapping the
  lintime :class:`~lintime.models.ModelConfig` and a ``PreTrainedModel`` + ``GenerationMixin``
  wrapping :class:`~lintime.models.CausalLM` (``model_type = "lintime"``).  ``import lintime``
  registers both with ``AutoConfig`` / ``AutoModelForCausalLM`` (lazily, see
  :mod:`lintime.hf._hook`), so ``save_pretrained`` / ``from_pretrained`` work offline without
  ``trust_remote_code``.
* :class:`LintimeCache` -- the decoding state carried through ``model.generate()``: constant
  size for the linear-time families, a KV cache for softmax attention; beam search reorders it
  with ``select``; left padding never enters it.
* :func:`hf_tokenizer` -- a lintime tokenizer as a ``PreTrainedTokenizerFast`` with the same ids.
* :func:`export_checkpoint` -- a training checkpoint -> an HF folder (``lintime export``), with
  :func:`write_remote_code` for machines without lintime (``trust_remote_code=True``).

This package imports transformers only when one of these names is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LintimeConfig": "lintime.hf.configuration",
    "LintimeForCausalLM": "lintime.hf.modeling",
    "LintimeCache": "lintime.hf.modeling",
    "hf_tokenizer": "lintime.hf.tokenization",
    "export_checkpoint": "lintime.hf.export",
    "write_remote_code": "lintime.hf.remote_code",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lintime.hf' has no attribute {name!r}")
