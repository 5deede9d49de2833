"""``lintime train --compile``: which compiled form a run takes (:func:`choose_compile`), and the compiled model.

``model``: :class:`CompiledModel`, the model compiled as one graph where it traces, else with graph breaks.  Which
families trace in one graph depends on the device: on CUDA the ops' Triton paths are opaque custom ops, on the CPU
some chunked PyTorch forms read ``cu_seqlens`` on the host (docs/models.md, "Compiling").  Rather than a table that
could drift, a call tries ``fullgraph=True`` and falls back once, with a one-line notice.  Under FSDP2 ``model`` is
:func:`compile_blocks`: every block compiled on its own after sharding, FSDP2's hooks run eagerly between them.

``graph``: the whole step captured in one CUDA graph (:class:`lintime.training.graphed.GraphedStep`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


# Where the step cannot be captured, ``auto`` runs eager steps: the compiled model is slower than them (docs/models.md,
# "Compiling").
AUTO_FALLBACK = "off"
# torch.compile's backend for the training forward (tests take "aot_eager": the same graphs, no code generation)
BACKEND = "inductor"


def graph_obstacle(*, device: torch.device, distributed: bool, packing: str, static_packing: bool = False,
                   parallel: str = "none", cp_size: int = 1, updates_buffers: bool = False) -> str | None:
    """Why this run's step cannot be captured in a CUDA graph, or ``None`` when it can.  ``static_packing``: the
    model plans documents packed anew every batch on the device (``backbone.static_packing()``); ``parallel`` and
    ``cp_size``: the run's data and context parallelism; ``updates_buffers``: the training forward writes buffers
    (``Mixer.updates_buffers``)."""
    if device.type != "cuda":
        return f"a CUDA graph needs a CUDA device, this run is on {device.type}"
    if distributed and cp_size > 1:
        return "context parallelism hands the mixers' states between the ranks inside the forward and backward"
    if distributed and parallel == "fsdp":
        return ("FSDP2 all-gathers every block's parameters and reduce-scatters its gradients inside the forward and "
                "backward")
    if distributed and parallel != "ddp":
        return "the captured step runs one process or DDP"
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
    ``graph`` where it cannot: eager, with the reason.  ``off`` and ``model`` are taken as asked (``model`` under
    FSDP2: the blocks compiled, :func:`compile_blocks`, which its line says; the line of ``auto`` under FSDP2 on
    CUDA points to it)."""
    fsdp = distributed and parallel == "fsdp" and cp_size == 1
    if mode == "off" or (mode == "model" and not fsdp):
        return mode, None
    if mode == "model":
        return "model", f"lintime train: --compile model: {_BLOCKS}"
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
    if mode == "auto" and fsdp:
        # eager until the compiled blocks are measured against it on GPUs (docs/design/training_step.md)
        return AUTO_FALLBACK, (f"lintime train: --compile auto: no CUDA graph ({why}); eager steps "
                               f"(--compile model: each block compiled after sharding)")
    fallback = AUTO_FALLBACK if mode == "auto" else "off"
    what = {"off": "eager steps", "model": "the compiled model"}[fallback]
    return fallback, f"lintime train: --compile {mode}: no CUDA graph ({why}); {what}"


_BLOCKS = ("each block compiled on its own after sharding (torch.compile); FSDP2's all-gathers and reduce-scatters, "
           "the embedding, the loss and the optimizer step run eagerly around them")


class _Compiled:
    """``fn`` under ``torch.compile(fullgraph=True)``; at the first call that does not trace as one graph, compiled
    again with graph breaks, after ``on_break(reason)``.  Dynamo traces a call before any of it runs, so a failed trace
    has no effects and the call is made again."""

    def __init__(self, fn: Callable, on_break: Callable[[str], None], backend: str):
        self.fn, self.on_break, self.backend = fn, on_break, backend
        self.compiled = torch.compile(fn, fullgraph=True, backend=backend)
        self.fullgraph = True

    def __call__(self, *args, **kwargs):
        if not self.fullgraph:
            return self.compiled(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as err:
            self.on_break(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)
            self.compiled = torch.compile(self.fn, backend=self.backend)
            self.fullgraph = False
            return self.compiled(*args, **kwargs)


class CompiledModel(nn.Module):
    """``module`` under ``torch.compile(fullgraph=True)``; if a call cannot trace as one graph, compiled again with
    graph breaks (``say`` gets one line).  Attributes other than ``forward`` are the module's; ``backend`` is
    ``torch.compile``'s (default :data:`BACKEND`)."""

    def __init__(self, module: nn.Module, say: Callable[[str], None], what: str = "the model", *,
                 backend: str | None = None):
        super().__init__()
        self.module = module

        def on_break(reason: str) -> None:
            say(f"lintime train: --compile: {what} does not trace as one graph ({reason}); compiling it with graph "
                f"breaks")

        # not a submodule: its parameters are the module's
        self.__dict__["_call"] = _Compiled(module, on_break, backend or BACKEND)

    @property
    def fullgraph(self) -> bool:
        return self._call.fullgraph

    def forward(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)


def compile_blocks(model: nn.Module, say: Callable[[str], None], *, backend: str | None = None) -> list[_Compiled]:
    """``--compile model`` under FSDP2: every block of ``model`` (``model.backbone.blocks``, each an FSDP2 unit after
    :func:`lintime.training.parallel.wrap_model`) runs its forward under ``torch.compile``, in place.

    FSDP2's hooks sit in each block's ``__call__`` around ``forward`` (the all-gather before it, the reshard after,
    the pre-backward gather and post-backward reduce-scatter on its output and inputs); dynamo does not trace them
    (torch marks them so), and a compiled whole model breaks its graph at every block (a break inside the loop over
    the blocks leaves the backbone eager).  So each block's forward is compiled on its own, and the hooks run
    between the blocks' graphs as in the eager step; the code around the blocks (embedding, positions, final norm,
    loss) stays eager.  The blocks share one compiled code (a graph for the first block, one for the others, per
    shape and grad mode).  A block that does not trace as one graph is compiled with graph breaks; ``say`` gets one
    line for the model.  Returns the compiled forwards, in block order."""
    said: list[str] = []

    def on_break(i: int, reason: str) -> None:
        if not said:
            said.append(reason)
            say(f"lintime train: --compile: block {i} does not trace as one graph ({reason}); compiling the blocks "
                f"that do not with graph breaks")

    forms = []
    for i, block in enumerate(model.backbone.blocks):
        form = _Compiled(block.forward, lambda reason, i=i: on_break(i, reason), backend or BACKEND)
        block.forward = form  # an instance attribute: the block's __call__, hooks and all, calls it
        forms.append(form)
    return forms
