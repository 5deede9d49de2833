"""``LintimeForCausalLM``: a lintime :class:`~lintime.models.CausalLM` as an HF ``PreTrainedModel``
with ``GenerationMixin`` (``model.generate()``: greedy, sampling, top-k / top-p, beam search).

Decoding state.  ``generate()`` carries a :class:`LintimeCache` (the model's own decoding state,
:class:`~lintime.models.ModelState`) in ``past_key_values``: constant size per sequence for the
linear-time families (FLASH, linear attention, GLA, VQ, ...), a KV cache for softmax attention.
No HF ``DynamicCache`` is ever created.  Beam search reorders it with ``ModelState.select``.
Greedy search and sampling skip HF's loop where they can: :meth:`LintimeForCausalLM.generate`
decodes through lintime's static state, a CUDA graph per token on CUDA (:mod:`lintime.hf.generation`).

Padding.  ``attention_mask`` is honoured in every call: the tokens of a call whose mask is not all
ones are packed (``cu_seqlens``, one sequence per row) before they reach the model, so a masked
position never enters any state, and every row's positions count only its real tokens (a
left-padded prompt is computed exactly as the same prompt alone).  The logits of masked positions
are 0.  ``position_ids`` are ignored: positions always come from the state's per-row offset.

Notation: ``B`` rows, ``T`` tokens in this call, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from lintime.hf.configuration import LintimeConfig
from lintime.models import CausalLM, ModelState


class LintimeCache:
    """The decoding state of a batch inside HF generation.

    ``state``         :class:`~lintime.models.ModelState` with one row per sequence (its
                      ``offset [B]`` counts the real tokens each row consumed);
    ``seen_tokens``   columns of ``input_ids`` consumed so far, padding included (what HF calls
                      the sequence length of the cache: the next call starts at this column).
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, state: ModelState, seen_tokens: int):
        self.state = state
        self.seen_tokens = int(seen_tokens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def select(self, index: torch.Tensor) -> "LintimeCache":
        """Rows ``index`` (``[B']`` int64; rows may repeat)."""
        return LintimeCache(self.state.select(index), self.seen_tokens)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """In place, as HF beam search expects: keep rows ``beam_idx``."""
        self.state = self.state.select(beam_idx.to(torch.long))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """In place: every row ``repeats`` times (HF expands a given cache for ``num_return_sequences``)."""
        idx = torch.arange(self.state.batch_size, device=self.state.offset.device).repeat_interleave(repeats)
        self.state = self.state.select(idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.state = self.state.select(indices.to(torch.long))

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    def nbytes(self) -> int:
        """Bytes held by the state's tensors (all rows)."""
        from lintime.generation.decode import state_nbytes

        return state_nbytes(self.state)

    def __repr__(self) -> str:
        return f"LintimeCache(rows={self.batch_size}, seen_tokens={self.seen_tokens}, bytes={self.nbytes()})"


class LintimePreTrainedModel(PreTrainedModel):
    config_class = LintimeConfig
    base_model_prefix = "lintime"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    # the state cannot be rolled back: assisted / speculative generation is refused by HF
    _is_stateful = True

    def _init_weights(self, module):
        """lintime initialises its modules itself (CausalLM.reset_parameters, seed init); HF
        calls this only for weights a checkpoint lacks, which a strict lintime load never has."""

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the state lives in LintimeCache, never in a DynamicCache


class LintimeForCausalLM(LintimePreTrainedModel, GenerationMixin):
    """HF causal LM over a lintime :class:`~lintime.models.CausalLM` (``self.lintime``).

    ``forward(input_ids [B, T], attention_mask [B, S] (S >= T: past + current columns) = None,
    past_key_values: LintimeCache = None, labels [B, T] = None, use_cache = None,
    logits_to_keep = 0)`` -> ``CausalLMOutputWithPast(loss, logits [B, T or logits_to_keep, V],
    past_key_values)``.  ``use_cache`` defaults to ``config.use_cache`` without labels, False with
    them (training).  ``labels`` use HF's convention (shifted inside, -100 ignored).
    """

    def __init__(self, config: LintimeConfig, model: CausalLM | None = None):
        super().__init__(config)
        self.lintime = model if model is not None else CausalLM(config.model_config)
        self.post_init()

    @classmethod
    def from_lintime(cls, model: CausalLM, **config_kwargs) -> "LintimeForCausalLM":
        """Wrap an existing lintime ``CausalLM`` (weights shared, not copied).  ``config_kwargs``:
        HF config fields such as ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``."""
        if not isinstance(model, CausalLM):
            raise TypeError(f"LintimeForCausalLM wraps a lintime CausalLM, got {type(model).__name__}")
        config = LintimeConfig(model.config.to_dict(), **config_kwargs)
        dtype = next(model.parameters()).dtype
        out = cls(config, model=model)
        out.config.dtype = dtype
        return out

    # ------------------------------------------------------------------ HF plumbing
    def get_input_embeddings(self):
        return self.lintime.backbone.embed

    def set_input_embeddings(self, value):
        self.lintime.backbone.embed = value

    def get_output_embeddings(self):
        return self.lintime.lm_head  # None when tied (lintime ties inside its forward)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: LintimeCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        if inputs_embeds is not None:
            raise ValueError("LintimeForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("LintimeForCausalLM needs input_ids [B, T]")
        if output_attentions or output_hidden_states:
            raise ValueError("LintimeForCausalLM returns logits and the decoding state only "
                             "(output_attentions / output_hidden_states are not available)")
        if past_key_values is not None and not isinstance(past_key_values, LintimeCache):
            raise ValueError(f"past_key_values must be a LintimeCache (returned by this model), "
                             f"got {type(past_key_values).__name__}")
        if use_cache is None:
            use_cache = labels is None and getattr(self.config, "use_cache", True)
        B, T = input_ids.shape
        state = past_key_values.state if past_key_values is not None else None
        if state is None and use_cache:
            state = self.lintime.init_state(B, device=input_ids.device)
        mask = None
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(f"attention_mask must be [B, S] with S >= T (past + current columns); got "
                                 f"{tuple(attention_mask.shape)} for input_ids {tuple(input_ids.shape)}")
            mask = attention_mask[:, -T:].to(torch.bool)
            if bool(mask.all()):
                mask = None
        logits, new_state = _run(self.lintime, input_ids, mask, state, return_state=use_cache)

        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        cache = None
        if use_cache:
            seen = (past_key_values.seen_tokens if past_key_values is not None else 0) + T
            cache = LintimeCache(new_state, seen)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, *, lintime_decode: str = "auto",
                 lintime_stats: dict | None = None, **kwargs):
        """HF's ``generate``; greedy search and sampling run lintime's static-state loop (a CUDA graph
        replayed per token on CUDA) -- ``lintime_decode``: ``auto`` (``graph`` on CUDA, ``hf``
        elsewhere), ``graph``, ``static`` or ``hf`` (HF's loop through :class:`LintimeCache`); other
        arguments (beams, logits processors, ...) run HF's loop after a one-line warning.
        ``lintime_stats``: a dict filled with ``decode_path`` and timings.  See
        :mod:`lintime.hf.generation`."""
        from lintime.hf.generation import lintime_generate

        with torch.no_grad():
            out = lintime_generate(self, inputs, generation_config, lintime_decode, lintime_stats, kwargs)
        if out is not None:
            return out
        return super().generate(inputs, generation_config, **kwargs)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: LintimeCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> dict:
        """The columns the state has not consumed yet (all of them before the first call)."""
        if inputs_embeds is not None:
            raise ValueError("LintimeForCausalLM generates from input_ids, not inputs_embeds")
        if past_key_values is not None:
            input_ids = input_ids[:, past_key_values.seen_tokens:]
        inputs = {"input_ids": input_ids.contiguous(), "attention_mask": attention_mask,
                  "past_key_values": past_key_values}
        for key, value in kwargs.items():  # use_cache, logits_to_keep, return_dict, ...
            if key not in ("position_ids", "cache_position", "next_sequence_length", "is_first_iteration",
                           "token_type_ids", "labels"):
                inputs[key] = value
        return inputs


def _run(model: CausalLM, ids: torch.Tensor, mask: torch.Tensor | None, state: ModelState | None,
         return_state: bool):
    """``model`` on ``ids [B, T]``; with ``mask [B, T]`` (bool, False = padding) only the real
    tokens run, packed one sequence per row, and padded positions get logits 0."""
    if mask is None:
        if return_state:
            return model(ids, state, return_state=True)
        return model(ids), None
    B, T = ids.shape
    lengths = mask.sum(1)  # [B]
    cu = torch.zeros(B + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = lengths.cumsum(0)
    packed = ids[mask][None]  # [1, sum lengths]: row-major, so each row's tokens stay in order
    if return_state:
        out, new_state = model(packed, state, return_state=True, cu_seqlens=cu)
    else:
        out, new_state = model(packed, cu_seqlens=cu), None
    logits = out.new_zeros(B, T, out.shape[-1])
    logits[mask] = out[0]
    return logits, new_state
