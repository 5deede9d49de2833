"""What the training and decoding parts of ``lintime bench model`` share: the decoding row, the
autocast rule, presets (ours and the anchors) built on the device, and the OOM / error / memory
helpers.  :mod:`lintime.bench.model` (training, settings, the run) and :mod:`lintime.bench.decode`
(decoding) both import it."""

from __future__ import annotations

import dataclasses
import gc

import torch

from lintime.bench import anchors
from lintime.bench.anchors import AnchorSpec, SkipPreset


@dataclasses.dataclass
class DecodeRow:
    """One decoding context.  ``state_mib`` is per sequence; times are per decoding step (one
    token for each of the ``batch`` sequences)."""

    preset: str
    family: str | None
    L: int
    batch: int
    status: str = "ok"
    token_ms: float | None = None  # median latency of one decoding step
    token_p10_ms: float | None = None
    token_p90_ms: float | None = None
    tokens_per_s: float | None = None  # batch / token_ms
    state_mib: float | None = None
    peak_mib: float | None = None
    steps: int = 0
    prefill_s: float | None = None  # wall time to take prefill_tokens into the state
    prefill_tokens: int | None = None  # ours: L minus the previous context (the state is carried); anchors: L
    prefill_tokens_per_s: float | None = None
    params: int | None = None
    impl: str = "lintime"
    path: str | None = None  # "eager" (a Python call per token) | "graph" (CUDA-graph replay) | "static-compiled" (HF)
    note: str = ""


def autocast_for(dtype: str, device: torch.device) -> torch.dtype | None:
    """``auto``: bf16 on CUDA, none (fp32) on CPU -- the rule of ``lintime train``."""
    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if dtype not in table:
        raise ValueError(f"--dtype must be one of auto, bf16, fp16, fp32; got {dtype!r}")
    return table[dtype]


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower())


def one_line(err: BaseException, limit: int = 200) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def free_memory(device: torch.device) -> None:
    """Give back what a finished (or failed) case held: Python garbage, then CUDA's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def preset_config(name: str, max_tokens: int, device: torch.device | None = None):
    """``(config, note)`` of a preset for contexts up to ``max_tokens``: a lintime ``ModelConfig``, or
    an :class:`~lintime.bench.anchors.AnchorSpec` for an anchor (``hf:...`` / ``fla:...``).  The note
    says what had to change: a learned position table (linear GPT-2) is extended to ``max_tokens``
    positions (its parameter count grows with it; ``params`` in every row says by how much).
    :class:`~lintime.bench.anchors.SkipPreset` (a ``ValueError``) for a preset that cannot run here,
    its message the reason (an unknown name, an anchor's library not importable)."""
    from lintime.models import get_preset

    if anchors.is_anchor(name):
        return anchors.anchor_spec(name, max_tokens, device or torch.device("cpu")), ""
    try:
        cfg = get_preset(name)
    except ValueError:
        raise SkipPreset(f"unknown preset {name!r} (`lintime presets` lists them)") from None
    if cfg.position == "learned" and cfg.max_positions < max_tokens:
        note = f"position table {cfg.max_positions} -> {max_tokens}"
        return dataclasses.replace(cfg, max_positions=max_tokens), note
    return cfg, ""


def impl_name(cfg) -> str:
    return cfg.impl if isinstance(cfg, AnchorSpec) else "lintime"


def build_model(cfg, device: torch.device):
    """The model built directly on ``device`` (no CPU init of 110M weights): a
    :class:`~lintime.models.CausalLM`, or the anchor's library model."""
    from lintime.models import CausalLM

    if isinstance(cfg, AnchorSpec):
        return cfg.build(device)
    with torch.device(device):
        model = CausalLM(cfg)
    return model.to(device)


def num_parameters(model) -> int:
    from lintime.models import CausalLM

    if isinstance(model, CausalLM):
        return model.num_parameters()
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors once
