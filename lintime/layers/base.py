"""The token-mixer protocol and the decoding-state base class.

Every token mixer (softmax multi-head attention, GAU, FLASH, linear attention, GLA, VQ, ...)
is an ``nn.Module`` that a model block calls the same way, so blocks and models never know
which mixer they hold (``docs/design/conventions.md`` §3, §4, §6).

Mixer protocol
--------------
A mixer is a subclass of :class:`Mixer` (an ``nn.Module``) with::

    forward(x, state=None, *, positions, cu_seqlens=None, aux_losses=None) -> (y, new_state)
    init_state(batch_size, device, dtype) -> state

* ``x``: ``[B, T, d_model]``, already normalised by the block (blocks are pre-norm
  residual: ``x + mixer(norm(x))``; the mixer owns neither the norm nor the residual).
  ``y``: ``[B, T, d_model]`` in ``x``'s dtype.
* ``positions``: ``[B, T]`` int64, the position of every token *inside its own sequence*:
  it restarts at 0 at every ``cu_seqlens`` boundary and continues from the number of tokens
  already consumed when decoding from a state.  The model computes it once
  (:func:`lintime.layers.positional.token_positions`) and every mixer and absolute embedding
  reads the same tensor, so RoPE, relative biases and chunk boundaries agree.
* ``cu_seqlens``: ``[N + 1]`` int offsets of packed sequences (``B == 1``), FlashAttention
  convention (docs/design/contract.md §1).  No token may see another sequence.
* ``state``: ``None`` (training / full-sequence: the mixer allocates no cache and returns
  ``new_state = None``) or the object returned by ``init_state`` / a previous call.  With a
  state the mixer continues each sequence where the state stopped and returns the state
  after the new tokens.  Row ``n`` of the state belongs to sequence ``n``: batch row ``n``
  without packing, packed sequence ``n`` with ``cu_seqlens`` (so the state has ``N`` rows).
  Continuing from a state must give what one long call gives, at any split point (docs/design/contract.md §1).
  States are values: a call never modifies the state it was given (old states stay valid,
  e.g. for beam search), it returns a new one.
* ``aux_losses``: ``None`` or a caller-owned ``dict[str, Tensor]``.  A mixer with a
  training-side auxiliary loss (Transformer-VQ's commitment loss) *adds* its scalar to
  ``aux_losses[name]`` when the dict is given; every other mixer ignores it.  No loss is
  stored on the module.
* ``init_state(batch_size, device, dtype)`` returns the empty state (nothing consumed) for
  ``batch_size`` sequences.
* ``deferrable_bias() -> Tensor | None`` (optional, default ``None``): the output projection's bias ``[d_model]``
  when the mixer can leave adding it to the caller.  A fused block (:class:`lintime.models.backbone.Block`) that
  gets one calls ``forward(..., defer_bias=True)``, receives ``y`` without it, and hands the bias to the norm that
  adds ``y`` to the stream (:func:`lintime.modules.add_normalize`'s ``branch_bias``), whose backward kernel gives its
  gradient.  Only a mixer that offers a bias takes the ``defer_bias`` keyword (FLASH, GAU).

State protocol
--------------
A state is a small dataclass whose docstring gives every field's shape, with

* ``select(index) -> state``: the state of rows ``index`` (``[B']`` int64), e.g. to reorder
  beams; rows may repeat;
* ``to(device) -> state``;
* ``batch_size`` (property).

:class:`BatchState` implements these for a dataclass whose tensors all have the batch as
dimension 0 (non-tensor fields are copied, nested dataclasses and lists are recursed into).
The model reaches layer states only through :func:`select_state` / :func:`state_to`, which
also accept a bare batch-first tensor (the ``[N, H, K, V]`` state of linear attention / GLA)
or a batch-first dataclass without methods (``MixedChunkState``; ``VQState`` brings its own
``select`` / ``to``), so a layer may return an op's state as it is or wrap it in a
``BatchState`` with extra fields.

Static states (in-place decoding, CUDA graphs)
----------------------------------------------
:func:`static_state` turns a state into fixed-size buffers that a decoding step of one token
updates without changing any shape, and :func:`copy_state_` writes a step's result back into
them, so the step is a fixed-shape function of ``(token, buffers)`` that a CUDA graph can capture
(``lintime.generation.static``).  Constant-size states (linear attention, GLA, FLASH's mixed chunk
state, VQ) only need fresh buffers.  A state that grows (a KV cache, Combiner's row summaries)
has a ``with_capacity(capacity)`` method returning its *static* form: a fixed capacity of
``capacity`` tokens, a ``static = True`` flag, and the layer writes the growing part in place.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn as nn


def map_state(state: Any, fn) -> Any:
    """Apply ``fn`` to every tensor of a state: tensors, lists / tuples and dataclasses
    (recursively, so op states such as ``MixedChunkState`` / ``VQState`` work as they are);
    anything else (ints, strings, ``None``) is copied."""
    if isinstance(state, torch.Tensor):
        return fn(state)
    if isinstance(state, (list, tuple)):
        return type(state)(map_state(v, fn) for v in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {f.name: map_state(getattr(state, f.name), fn) for f in dataclasses.fields(state) if f.init}
        return dataclasses.replace(state, **changes)
    return state


def select_state(state: Any, index: torch.Tensor) -> Any:
    """Rows ``index`` of any state: its own ``select`` if it has one, else every tensor's
    dimension 0 (the batch-first convention of all lintime states)."""
    if state is not None and not isinstance(state, torch.Tensor) and hasattr(state, "select"):
        return state.select(index)
    return map_state(state, lambda t: t.index_select(0, index.to(t.device)))


def state_to(state: Any, device: torch.device | str) -> Any:
    if state is not None and not isinstance(state, torch.Tensor) and hasattr(state, "to"):
        return state.to(device)
    return map_state(state, lambda t: t.to(device))


def static_state(state: Any, capacity: int) -> Any:
    """A copy of ``state`` in fixed-size buffers for up to ``capacity`` tokens per sequence (see
    the module docstring): every tensor is a fresh buffer; a state with ``with_capacity`` (the
    growing caches) gives its static form; dataclasses, lists and tuples are recursed into."""
    if isinstance(state, torch.Tensor):
        return state.clone(memory_format=torch.contiguous_format)
    if state is not None and hasattr(state, "with_capacity"):
        return state.with_capacity(capacity)
    if isinstance(state, (list, tuple)):
        return type(state)(static_state(v, capacity) for v in state)
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        changes = {f.name: static_state(getattr(state, f.name), capacity) for f in dataclasses.fields(state) if f.init}
        return dataclasses.replace(state, **changes)
    return state


def copy_state_(dst: Any, src: Any, where: str = "state") -> None:
    """Copy every tensor of ``src`` into the tensor at the same place of ``dst`` (same structure,
    same shapes; a tensor that is already ``dst``'s own buffer is skipped).  Non-tensor fields of
    ``dst`` are left as they are.  Raises ``ValueError`` naming the field whose shape differs (a
    decoding step that is not fixed-shape)."""
    if isinstance(dst, torch.Tensor):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"{where}: expected a tensor, got {type(src).__name__}")
        if src is dst:
            return
        if src.shape != dst.shape:
            raise ValueError(f"{where}: shape {tuple(src.shape)} does not fit the static buffer "
                             f"{tuple(dst.shape)} (this state is not fixed-shape)")
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        if len(dst) != len(src):
            raise ValueError(f"{where}: {len(src)} entries for {len(dst)}")
        for i, (d, s) in enumerate(zip(dst, src)):
            copy_state_(d, s, f"{where}[{i}]")
    elif dataclasses.is_dataclass(dst) and not isinstance(dst, type):
        if type(src) is not type(dst):
            raise TypeError(f"{where}: a {type(src).__name__} for a {type(dst).__name__}")
        for f in dataclasses.fields(dst):
            copy_state_(getattr(dst, f.name), getattr(src, f.name), f"{where}.{f.name}")


@dataclasses.dataclass
class BatchState:
    """Base for decoding states: every tensor field, at any depth (nested dataclasses such as
    the ops' states, lists), has the batch as dimension 0; other fields are copied as they are.
    Subclasses are dataclasses; they document their fields' shapes."""

    def select(self, index: torch.Tensor) -> "BatchState":
        """State of the rows ``index`` (``[B']`` int64; may reorder and repeat rows)."""
        return map_state(self, lambda t: t.index_select(0, index.to(t.device)))

    def to(self, device: torch.device | str) -> "BatchState":
        return map_state(self, lambda t: t.to(device))

    @property
    def batch_size(self) -> int:
        found = []
        map_state(self, lambda t: found.append(t.shape[0]) or t)
        if not found:
            raise ValueError(f"{type(self).__name__} has no tensor field to read the batch size from")
        return found[0]


class Mixer(nn.Module, ABC):
    """A token mixer (see the module docstring for the full protocol).

    Subclasses set ``self.causal`` and implement :meth:`forward` and :meth:`init_state`;
    :meth:`init_weights` and :meth:`no_weight_decay` are optional hooks.  Parameters that must
    not get weight decay although they are matrices (e.g. GAU's per-dimension scale/offset
    ``[2, s]``) are named by :meth:`no_weight_decay`.
    """

    causal: bool
    # the training forward writes buffers (VQ's codebook statistics): data parallelism must keep them in step
    updates_buffers: bool = False

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        state: Any | None = None,
        *,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        aux_losses: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, Any | None]:
        ...

    @abstractmethod
    def init_state(self, batch_size: int, device: torch.device | str, dtype: torch.dtype) -> Any:
        ...

    def static_packing(self) -> bool:
        """Whether :meth:`forward` takes a static ``cu_seqlens`` (:func:`lintime.ops.utils.mark_static`) on CUDA with
        no host read of its values, so a CUDA graph can capture a step on documents packed anew every batch."""
        return False

    def init_weights(self, std: float) -> None:
        """Called by the model after its blanket init (every ``nn.Linear`` / ``nn.Embedding``
        weight ``N(0, std)``, biases 0).  Mixers whose parameters need another init (gates,
        codebooks, per-dim scales) override it; the default keeps the blanket init."""

    def no_weight_decay(self) -> set[str]:
        """Names (relative to this module) of parameters to exclude from weight decay, on top
        of the model-wide rule (every 0-D / 1-D parameter: norms, biases, scalar scales)."""
        return set()

    def deferrable_bias(self) -> torch.Tensor | None:
        """The output projection's bias ``[d_model]`` if this mixer can return ``y`` without it (``forward``'s
        ``defer_bias=True``) for the caller to add, else ``None`` (the default: the mixer adds its own)."""
        return None

