"""``LintimeForCausalLM.generate``: greedy and sampled generation through lintime's static state
(a CUDA graph replayed per token on CUDA) when HF's arguments allow it, HF's own loop otherwise.

``lintime_decode`` (a keyword of ``generate``):

* ``auto`` (default) -- ``graph`` on CUDA, ``hf`` elsewhere (the CPU keeps the eager path);
* ``graph`` / ``static`` -- :func:`lintime.generation.tokens.generate_tokens`: the prompts (padding
  removed) prefilled into the state, the state copied into fixed buffers, one step (sampling
  included) per token, captured in a CUDA graph on CUDA (``static``: the same step, eagerly);
* ``hf`` -- HF's loop: one ``forward`` per token through :class:`~lintime.hf.modeling.LintimeCache`.

The lintime loop takes what greedy search and multinomial sampling need: ``max_new_tokens`` /
``max_length``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``num_return_sequences``
(sampling), ``eos_token_id`` (one or several), ``pad_token_id``, ``attention_mask`` (any padding)
and ``prefill_chunk_size``.  Anything else (beam search, logits processors, stopping criteria,
streamers, penalties, ``return_dict_in_generate``, ...) runs HF's loop after a one-line
``RuntimeWarning`` naming the argument.  The output is HF's: ``[R, T + n]`` ids, ``n`` the
longest continuation, rows that ended earlier filled with ``pad_token_id`` after their eos.
Sampled draws come from lintime's seeded hash (seed taken from torch's global generator, so
``torch.manual_seed`` makes a call reproducible), not from ``torch.multinomial``: the same
distribution as HF's loop, other draws.

``lintime_stats`` (a dict, optional) is filled with ``decode_path`` (``graph``, ``static`` or
``hf``), and on the lintime loop ``prompt_tokens``, ``new_tokens``, ``prefill_s``, ``decode_s``;
``fallback``: why HF's loop ran where the lintime loop was asked for.
"""

from __future__ import annotations

import warnings

import torch

DECODE_CHOICES = ("auto", "graph", "static", "hf")
# generate() arguments outside the generation config; any of them given -> HF's loop
_EXPLICIT = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
             "streamer", "negative_prompt_ids", "negative_prompt_attention_mask", "custom_generate", "assistant_tokenizer",
             "tokenizer")
# generation-config fields the lintime loop reads (any other field away from its default -> HF's loop)
_READ = {"max_length", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "num_return_sequences",
         "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", "use_cache", "prefill_chunk_size",
         "output_attentions", "output_hidden_states", "_from_model_config", "transformers_version"}
PREFILL_CHUNK = 0  # automatic, as lintime.generation.GenerationConfig.prefill_chunk


def resolve_decode(decode: str, device: torch.device) -> str:
    """The path ``decode`` (one of :data:`DECODE_CHOICES`) resolves to on ``device``."""
    if decode not in DECODE_CHOICES:
        raise ValueError(f"lintime_decode must be one of {DECODE_CHOICES}, got {decode!r}")
    if decode == "auto":
        return "graph" if device.type == "cuda" else "hf"
    return decode


def _reference_config(config_cls):
    ref = config_cls()
    ref.update(**ref._get_default_generation_params(), defaults_only=True)
    return ref


def _at_default(value, default) -> bool:
    return value == default or (not value and not default)  # None / 0 / False / {} alike


def _why_not(model, inputs, generation_config, kwargs) -> tuple[str | None, tuple]:
    """``(None, (input_ids, attention_mask, gc))`` when the lintime loop can run these arguments,
    else ``(reason, ())``."""
    for name in _EXPLICIT:
        value = kwargs.get(name)
        if value is not None and not (isinstance(value, (list, tuple)) and not value):
            return f"{name} is given", ()
    try:
        gc, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
        ref = _reference_config(type(gc))
    except Exception as e:  # noqa: BLE001 -- HF's own loop reports bad arguments its way
        return f"HF's generation settings could not be read ({type(e).__name__})", ()
    for key, value in gc.to_dict().items():
        if key not in _READ and not _at_default(value, getattr(ref, key, None)):
            return f"{key}={value!r}", ()
    ids = inputs if inputs is not None else model_kwargs.pop("input_ids", None)
    mask = model_kwargs.pop("attention_mask", None)
    extra = [k for k, v in model_kwargs.items() if v is not None and v is not False]
    if extra:
        return f"{extra[0]} is given", ()
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] == 0:
        return "the input is not input_ids [B, T] (int64, T >= 1)", ()
    if not gc.use_cache:
        return "use_cache=False", ()
    if gc.do_sample and not (gc.temperature or 0) > 0:
        return f"temperature={gc.temperature!r}", ()
    if not gc.do_sample and (gc.num_return_sequences or 1) > 1:
        return "num_return_sequences > 1 without sampling", ()
    new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 0) - ids.shape[1]
    if new < 1:
        return f"{new} new tokens", ()
    if mask is None and gc.pad_token_id is not None and bool((ids == gc.pad_token_id).any()):
        return "no attention_mask and the prompt holds pad tokens", ()
    if mask is not None and (mask.shape != ids.shape or not bool(mask.to(torch.bool).any(1).all())):
        return "attention_mask is not [B, T] with a real token in every row", ()
    return None, (ids, mask, gc, new)


def _ids_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def lintime_generate(model, inputs, generation_config, decode: str, stats: dict | None, kwargs: dict):
    """The output of the lintime loop, or ``None`` when HF's loop must run (after a one-line
    warning where the lintime loop was asked for).  ``model``: a ``LintimeForCausalLM``."""
    from lintime.generation.tokens import generate_tokens

    info = stats if stats is not None else {}
    path = resolve_decode(decode, model.device)
    if path == "hf":
        info["decode_path"] = "hf"
        return None
    why, args = _why_not(model, inputs, generation_config, kwargs)
    if why is not None:
        info.update(decode_path="hf", fallback=why)
        warnings.warn(f"lintime.hf: generate() runs HF's own loop ({why}; the lintime {path} loop takes greedy "
                      f"search and sampling only)", RuntimeWarning, stacklevel=3)
        return None
    ids, mask, gc, new = args
    rows = ids.tolist() if mask is None else [
        [t for t, m in zip(r, ms) if m] for r, ms in zip(ids.tolist(), mask.to(torch.bool).tolist())]
    repeats = (gc.num_return_sequences or 1) if gc.do_sample else 1
    eos = _ids_list(gc.eos_token_id)
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    sampling = dict(temperature=float(gc.temperature), top_k=int(gc.top_k or 0), top_p=float(gc.top_p or 1.0),
                    seed=int(torch.randint(0, 2**62, ()).item())) if gc.do_sample else dict(temperature=0.0)
    drawn = generate_tokens(model.lintime, rows, new, repeats=repeats, eos_ids=tuple(eos), graph=path == "graph",
                            prefill_chunk=gc.prefill_chunk_size or PREFILL_CHUNK, stats=info, **sampling)
    width = max(len(d) for d in drawn)
    out = torch.full((len(drawn), width), pad, dtype=torch.long)
    for r, d in enumerate(drawn):
        out[r, : len(d)] = torch.tensor(d, dtype=torch.long)
    prompt = ids.repeat_interleave(repeats, 0) if repeats > 1 else ids
    return torch.cat([prompt, out.to(ids.device)], 1)


__all__ = ["DECODE_CHOICES", "lintime_generate", "resolve_decode"]
