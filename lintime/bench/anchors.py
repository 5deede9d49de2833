"""Other libraries' language models as ``lintime bench model`` presets, measured in the same process
as ours (anchors):

* ``hf:llama-<size>``: HF transformers' ``LlamaForCausalLM`` at the size of ``transformer-pp-<size>``
  (width, layers, heads, MLP width, vocabulary, tied embeddings), ``attn_implementation="sdpa"``,
  the library's defaults otherwise (RMSNorm, SwiGLU, RoPE, no biases);
* ``hf:llama-<size>+compile``: the same model under ``torch.compile`` (default settings): what a careful HF user
  trains with;
* ``fla:gla-<size>``: fla's ``GLAForCausalLM`` at the size of ``gla-<size>`` (width, layers, heads,
  key / value expansion, MLP width, vocabulary, tied embeddings), fla's defaults otherwise (its fused
  norms, SwiGLU and cross-entropy; ``attn_mode="chunk"``).  fla's kernels need CUDA.

An anchor whose library is not importable is a ``skipped: <why>`` row, never an error.

Training step (:func:`forward_backward_fn`): the library's own loss, ``model(input_ids=ids,
labels=ids, use_cache=False).loss`` (the model shifts the labels: ``T - 1`` predictions per row of
``T`` tokens), under the same autocast as ours; the bench wraps it in the same clip / fused AdamW /
``zero_grad`` as our rows and feeds the same random tokens.

Decoding (:func:`generate_measure`): the library's ``generate`` (greedy, its default cache:
transformers' ``DynamicCache``, fla's recurrent cache), eager, from a fresh random ``B x L`` prompt at
every context; for HF also with its static cache and the one-token forward compiled by ``generate``
(``static``).  A logits processor stamps the time after every step's forward (device synchronised),
so one call gives the prefill (prompt in, first logits out) and the per-token latencies of the
following steps.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable

import torch

from lintime.bench.measure import dist_version

# prefix -> (our preset whose size it copies, library)
_KINDS = {"hf:llama": ("transformer-pp", "transformers"), "fla:gla": ("gla", "fla")}
# bytes per prompt token and model width live at once in a no-grad forward of a whole prompt (an estimate for the
# memory rule, not measured: fp32 residual stream + the widest bf16 intermediates, a few tensors of each)
ACT_WIDTHS = 64


class SkipPreset(ValueError):
    """A preset that cannot run here (unknown name, library not importable, wrong device); the
    message is the row's reason."""


@dataclasses.dataclass
class AnchorSpec:
    """What the bench needs of an anchor preset (it stands where a lintime ``ModelConfig`` would)."""

    name: str
    family: str  # the family of the lintime preset it copies: "softmax" / "gla"
    impl: str  # library and version, e.g. "transformers 5.23.0"
    model_class: str
    vocab_size: int
    config: dict  # the library config's size fields (stored in the JSON)
    build: Callable[[torch.device], torch.nn.Module]
    # estimates for the bench's memory rule (lintime.bench.decode.memory_skip), bytes per prompt token: the cache
    # it leaves and the activations of the one forward ``generate`` runs over the whole prompt
    cache_bytes_per_token: float = 0.0
    act_bytes_per_token: float = 0.0


COMPILED = "+compile"  # an anchor name's suffix: the model under torch.compile


def is_anchor(name: str) -> bool:
    return ":" in name


def is_anchor_spec(cfg) -> bool:
    """Whether a preset's config (``lintime.bench.common.preset_config``) is an anchor's."""
    return isinstance(cfg, AnchorSpec)


def _split(name: str) -> tuple[str, str]:
    kind, _, size = name.removesuffix(COMPILED).rpartition("-")
    if kind not in _KINDS or not size:
        known = ", ".join(f"{k}-<size>" for k in _KINDS)
        raise SkipPreset(f"unknown anchor preset {name!r} (known: {known}, e.g. hf:llama-base)")
    return kind, size


def _import_error(lib: str, err: BaseException) -> SkipPreset:
    return SkipPreset(f"{lib} is not importable here ({type(err).__name__}: {str(err).splitlines()[0][:120]})")


def anchor_spec(name: str, max_tokens: int, device: torch.device) -> AnchorSpec:
    """The anchor ``name`` sized like its lintime preset, for contexts up to ``max_tokens``.
    :class:`SkipPreset` when it cannot run here."""
    from lintime.models import get_preset

    kind, size = _split(name)
    ours, lib = _KINDS[kind]
    try:
        cfg = get_preset(f"{ours}-{size}")
    except (KeyError, ValueError):
        raise SkipPreset(f"{name} takes its size from {ours}-{size}, which is no lintime preset") from None
    hidden = cfg.ffn.hidden_size(cfg.d_model)
    if kind == "hf:llama":
        spec = _llama(name, cfg, hidden, max_tokens)
    elif device.type != "cuda":
        raise SkipPreset(f"fla's kernels need CUDA (device {device})")
    else:
        spec = _fla_gla(name, cfg, hidden, max_tokens)
    if name.endswith(COMPILED):
        build = spec.build

        def compiled(device: torch.device) -> torch.nn.Module:
            return torch.compile(build(device))

        spec = dataclasses.replace(spec, build=compiled, impl=spec.impl + " + torch.compile",
                                   config={**spec.config, "torch_compile": True})
    return spec


def _llama(name, cfg, hidden, max_tokens) -> AnchorSpec:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        raise _import_error("transformers", e) from None
    sizes = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=hidden,
                 num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.mixer.n_heads,
                 num_key_value_heads=cfg.mixer.n_heads, tie_word_embeddings=cfg.tie_embeddings,
                 max_position_embeddings=max(max_tokens, 2048))
    hf_cfg = LlamaConfig(**sizes)

    def build(device: torch.device) -> torch.nn.Module:
        with torch.device(device):
            model = LlamaForCausalLM._from_config(hf_cfg, attn_implementation="sdpa")
        return model.to(device)

    return AnchorSpec(name, cfg.family, f"transformers {dist_version('transformers')}", "LlamaForCausalLM",
                      cfg.vocab_size, {**sizes, "attn_implementation": "sdpa"}, build,
                      cache_bytes_per_token=cfg.n_layers * 2 * cfg.d_model * 4,  # keys and values, fp32 at most
                      act_bytes_per_token=ACT_WIDTHS * cfg.d_model)


def _fla_gla(name, cfg, hidden, max_tokens) -> AnchorSpec:
    try:
        from fla.models import GLAConfig, GLAForCausalLM
    except Exception as e:  # noqa: BLE001 - any import failure is a skip
        raise _import_error("fla", e) from None
    import fla

    sizes = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
                 num_heads=cfg.mixer.n_heads, expand_k=cfg.mixer.expand_k, expand_v=cfg.mixer.expand_v,
                 intermediate_size=hidden, tie_word_embeddings=cfg.tie_embeddings,
                 max_position_embeddings=max(max_tokens, 2048))
    fla_cfg = GLAConfig(**sizes)

    def build(device: torch.device) -> torch.nn.Module:
        with torch.device(device):
            model = GLAForCausalLM(fla_cfg)
        return model.to(device)

    return AnchorSpec(name, cfg.family, f"fla {getattr(fla, '__version__', dist_version('fla-core'))}",
                      "GLAForCausalLM", cfg.vocab_size, {**sizes, "attn_mode": fla_cfg.attn_mode}, build,
                      act_bytes_per_token=ACT_WIDTHS * cfg.d_model)


def describe(name: str, max_tokens: int, device: torch.device) -> dict:
    """The anchor's record for the result JSON: library, class and sizes, or why it was skipped."""
    try:
        spec = anchor_spec(name, max_tokens, device)
    except SkipPreset as e:
        return {"status": f"skipped: {e}"}
    return {"status": "ok", "impl": spec.impl, "model": spec.model_class, "config": spec.config}


# ------------------------------------------------------------------------------------- training


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Our rule (``CausalLM.param_groups``): decay on matrices, none on 0-D / 1-D tensors."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def forward_backward_fn(model: torch.nn.Module, batch, amp: torch.dtype | None) -> Callable[[], float]:
    """Forward and backward of the whole batch with the library's own loss; returns the loss as a
    float (one host sync per step, as ours)."""
    ids = batch.input_ids  # [rows, T], one document per row
    device = ids.device

    def run() -> float:
        with autocast(device, amp):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return float(loss.detach())

    return run


def autocast(device: torch.device, dtype: torch.dtype | None):
    import contextlib

    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


# ------------------------------------------------------------------------------------- decoding


def nbytes(obj, _seen: set | None = None) -> int:
    """Bytes of every tensor reachable from a cache object (lists, tuples, dicts, attributes)."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, str, bytes, int, float, bool, type(None))):
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v, seen) for v in obj)
    return sum(nbytes(v, seen) for v in getattr(obj, "__dict__", {}).values())


def generate_measure(model: torch.nn.Module, spec: AnchorSpec, decode_steps: int, batch: int,
                     device: torch.device, amp: torch.dtype | None, reset_peak: Callable[[], None],
                     seed: int = 1, warmup_tokens: int = 2, static: bool = False) -> Callable:
    """``measure(row)`` fills one decoding row (context ``row.L``, ``batch`` sequences) from one ``generate``
    call: the prefill of a fresh ``batch x L`` prompt, then ``decode_steps`` timed tokens.  A short untimed
    ``generate`` of ``warmup_tokens`` runs first (first-call set-up, fla's kernel compilation,
    ``torch.compile``).

    ``static`` (HF): ``cache_implementation="static"`` with ``max_cache_len`` = the prompt + the new tokens
    (HF's static cache: every step attends over all its slots), so ``generate`` compiles the one-token forward
    (its rule: a compileable cache on CUDA) with ``CompileConfig(dynamic=True)``: one compilation for every
    cache length and batch size of the run, one CUDA graph recorded per shape (``mode="reduce-overhead"``,
    HF's default); the prefill stays eager."""
    from transformers import LogitsProcessor, LogitsProcessorList

    g = torch.Generator().manual_seed(seed)
    stamps: list[float] = []
    extra: dict = {}
    if static:
        from transformers import CompileConfig

        extra["cache_implementation"] = "static"
        extra["compile_config"] = CompileConfig(dynamic=True)
        if amp is not None:
            # HF sizes its static cache in the model's dtype: fp32 weights under autocast give bf16 keys for an
            # fp32 cache (index_copy_ refuses them), so this path runs a copy of the model
            # with its weights in the autocast dtype, without autocast -- how HF serves a bf16 model
            model, amp = copy.deepcopy(model).to(amp), None

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                reset_peak()  # the peak of the decoding steps, not of the prompt's forward
            return scores

    def generate(L: int, new: int):
        ids = torch.randint(0, spec.vocab_size, (batch, L), generator=g).to(device)
        if static:
            extra["max_cache_len"] = L + new + 1
            # generate sizes a static cache to at least the longest earlier one (kept on the model to avoid
            # recompiling); each context here gets its own length
            model._previous_max_cache_length = -1
        with torch.no_grad(), autocast(device, amp):
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False, pad_token_id=0,
                                  logits_processor=LogitsProcessorList([Clock()]), return_dict_in_generate=True,
                                  **extra)

    generate(8, warmup_tokens)  # untimed

    def measure(row) -> list[float]:
        stamps.clear()
        t0 = time.perf_counter()
        out = generate(row.L, decode_steps + 1)
        row.prefill_s = stamps[0] - t0
        row.prefill_tokens = row.L
        row.state_mib = nbytes(out.past_key_values) / batch / 2**20
        del out
        return [1e3 * (b - a) for a, b in zip(stamps, stamps[1:])]

    return measure
