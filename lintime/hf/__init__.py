"""HF transformers integration (extra ``hf``): lintime models as ``transformers`` models.

``import lintime.hf`` imports transformers and registers :class:`LintimeConfig` with
``AutoConfig`` and :class:`LintimeForCausalLM` with ``AutoModelForCausalLM``, so
``save_pretrained`` / ``from_pretrained`` work offline without ``trust_remote_code``.
``import lintime`` alone imports no transformers and registers nothing.

* :class:`LintimeConfig` / :class:`LintimeForCausalLM` -- a ``PretrainedConfig`` wrapping the
  lintime :class:`~lintime.models.ModelConfig` and a ``PreTrainedModel`` + ``GenerationMixin``
  wrapping :class:`~lintime.models.CausalLM` (``model_type = "lintime"``).
* :class:`LintimeCache` -- the decoding state carried through ``model.generate()``: constant
  size for the linear-time families, a KV cache for softmax attention; beam search reorders it
  with ``select``; left padding never enters it.  Greedy search and sampling decode through
  lintime's static state instead (a CUDA graph per token on CUDA): :mod:`lintime.hf.generation`.
* :func:`hf_tokenizer` -- a lintime tokenizer as a ``PreTrainedTokenizerFast`` with the same ids.
* :func:`export_checkpoint` -- a training checkpoint -> an HF folder (``lintime export``), with
  :func:`write_remote_code` for machines without lintime (``trust_remote_code=True``).
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from lintime.hf.configuration import LintimeConfig
from lintime.hf.export import export_checkpoint
from lintime.hf.modeling import LintimeCache, LintimeForCausalLM
from lintime.hf.remote_code import write_remote_code
from lintime.hf.tokenization import hf_tokenizer

# exist_ok: the remote-code modules of an exported folder import this package as well
AutoConfig.register(LintimeConfig.model_type, LintimeConfig, exist_ok=True)
AutoModelForCausalLM.register(LintimeConfig, LintimeForCausalLM, exist_ok=True)

__all__ = [
    "LintimeCache",
    "LintimeConfig",
    "LintimeForCausalLM",
    "export_checkpoint",
    "hf_tokenizer",
    "write_remote_code",
]
