"""``lintime train --compile``: which compiled form a run takes (:func:`choose_compile`), and the compiled model.

``model``: :class:`CompiledModel`, the model compiled as one graph where it traces, else with graph breaks.  Which
families trace in one graph depends on the device: on CUDA the ops' Triton paths are opaque custom ops, on the CPU
some chunked PyTorch forms read ``cu_seqlens`` on the host (docs/models.md, "Compiling").  Rather than a table that
could drift, the first call tries ``fullgraph=True`` and falls back once, with a one-line notice.

``graph``: the whole step captured in one CUDA graph (:class:`lintime.training.graphed.GraphedStep`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


# Where the step cannot be captured, ``auto`` runs eager steps: the compiled model is slower than them (docs/models.md,
# "Compiling").
AUTO_FALLBACK = "off"


def graph_obstacle(*, device: torch.device, distributed: bool, packing: str, static_packing: bool = False,
                   parallel: str = "none", cp_size: int = 1, updates_buffers: bool = False) -> str | None:
    """Why this run's step cannot be captured in a CUDA graph, or ``None`` when it can.  ``static_packing``: the
    model plans documents packed anew every batch on the device (``backbone.static_packing()``); ``parallel`` and
    ``cp_size``: the run's data and context parallelism; ``updates_buffers``: the training forward writes buffers
    (``Mixer.updates_buffers``)."""
    if device.type != "cuda":
        return f"a CUDA graph needs a CUDA device, this run is on {device.type}"
    if distributed and (parallel != "ddp" or cp_size > 1):
        return ("the captured step runs one process or DDP; FSDP2 and context parallelism communicate inside the "
                "forward and backward")
    if distributed and updates_buffers:
        return "the forward updates buffers (VQ's codebook statistics), which DDP broadcasts before every forward"
    if packing != "rows" and not static_packing:
        return ("documents are packed anew every batch and this model's ops plan packed calls on the host "
                "(--packing rows gives the static layout a graph replays)")
    return None


def choose_compile(mode: str, *, device: torch.device, distributed: bool, packing: str,
                   static_packing: bool = False, parallel: str = "none", cp_size: int = 1,
                   updates_buffers: bool = False) -> tuple[str, str | None]:
    """The form a run with ``--compile mode`` takes -- ``off`` (eager), ``model`` (:class:`CompiledModel`) or
    ``graph`` (the captured step) -- and the one line that says so (``None``: nothing to say).

    ``auto``: ``graph`` where the step can be captured (:func:`graph_obstacle`), else :data:`AUTO_FALLBACK`;
    ``graph`` where it cannot: eager, with the reason.  ``off`` and ``model`` are taken as asked."""
    if mode in ("off", "model"):
        return mode, None
    if mode not in ("graph", "auto"):
        raise ValueError(f"unknown compile mode {mode!r}")
    why = graph_obstacle(device=device, distributed=distributed, packing=packing, static_packing=static_packing,
                         parallel=parallel, cp_size=cp_size, updates_buffers=updates_buffers)
    if why is None:
        layout = "rows" if packing == "rows" else "documents packed anew every batch"
        if distributed:
            return "graph", (f"lintime train: --compile {mode}: the training step is captured in two CUDA graphs per "
                             f"rank, the gradients summed over the ranks between them ({layout})")
        return "graph", f"lintime train: --compile {mode}: the training step is captured in one CUDA graph ({layout})"
    if mode == "auto" and device.type != "cuda":
        return AUTO_FALLBACK, None  # nothing to say: graphs are a CUDA matter
    fallback = AUTO_FALLBACK if mode == "auto" else "off"
    what = {"off": "eager steps", "model": "the compiled model"}[fallback]
    return fallback, f"lintime train: --compile {mode}: no CUDA graph ({why}); {what}"


class CompiledModel(nn.Module):
    """``module`` under ``torch.compile(fullgraph=True)``; if its first call cannot trace as one graph, compiled
    again with graph breaks (``say`` gets one line).  Attributes other than ``forward`` are the module's;
    ``backend`` is ``torch.compile``'s (tests use ``"aot_eager"``)."""

    def __init__(self, module: nn.Module, say: Callable[[str], None], what: str = "the model", *,
                 backend: str = "inductor"):
        super().__init__()
        self.module = module
        # not a submodule: its parameters are the module's
        compiled = torch.compile(module, fullgraph=True, backend=backend)
        self.__dict__.update(_compiled=compiled, _say=say, _what=what, _backend=backend, _tried=False)
        self.fullgraph = True

    def forward(self, *args, **kwargs):
        if self._tried:
            return self._compiled(*args, **kwargs)
        try:
            out = self._compiled(*args, **kwargs)  # dynamo traces before anything runs: a failure has no effects
        except torch._dynamo.exc.TorchDynamoException as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            self._say(f"lintime train: --compile: {self._what} does not trace as one graph ({reason}); "
                      f"compiling it with graph breaks")
            self.__dict__["_compiled"] = torch.compile(self.module, backend=self._backend)
            self.fullgraph = False
            out = self._compiled(*args, **kwargs)
        self._tried = True
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)
