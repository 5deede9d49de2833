"""Decoding state of mixed chunk attention and the pieces its three forms share.

Notation: ``N`` sequences, ``C`` chunk size, ``H`` heads, ``S`` query/key width, ``E`` value width.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

LINEAR_NORMS = ("tokens", "chunk", "none")


@dataclass
class MixedChunkState:
    """What a causal mixed chunk attention needs to continue a sequence (docs/design/contract.md §2.3).

    A sequence that has seen ``P`` tokens (counted from its first token, across calls) has
    ``P // C`` completed chunks, summarised by ``kv`` and ``count``, and ``fill = P % C`` tokens of
    a partial chunk, kept verbatim because the next tokens attend to them quadratically.
    Memory per sequence is ``O(C)``, independent of ``P``.

    ``kv``     ``[N, H, S, E]`` ``sum_j k_lin_j^T v_j`` over the completed chunks, unnormalised,
               in the accumulation dtype (fp32; fp64 for fp64 inputs);
    ``count``  ``[N]`` int64, tokens summed in ``kv`` (``C * completed chunks``; the ``'tokens'``
               normaliser);
    ``k_quad`` ``[N, C, H, S]`` keys of the partial chunk (slots ``>= fill`` are zero);
    ``k_lin``  ``[N, C, H, S]`` linear keys of the partial chunk, added to ``kv`` when it completes;
    ``v``      ``[N, C, H, E]`` values of the partial chunk;
    ``fill``   ``[N]`` int64 in ``[0, C)``, tokens in the partial chunk.

    The buffers are in the inputs' dtype.  All float fields are differentiable.
    """

    kv: torch.Tensor
    count: torch.Tensor
    k_quad: torch.Tensor
    k_lin: torch.Tensor
    v: torch.Tensor
    fill: torch.Tensor

    @property
    def N(self) -> int:
        return self.kv.shape[0]

    @property
    def chunk_size(self) -> int:
        return self.k_quad.shape[1]

    @classmethod
    def zeros(cls, N: int, C: int, H: int, S: int, E: int, *, dtype=torch.float32, device=None) -> MixedChunkState:
        """Empty state (no token seen) for ``N`` sequences; buffers in ``dtype``, ``kv`` in fp32
        (fp64 when ``dtype`` is fp64)."""
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        return cls(
            kv=torch.zeros(N, H, S, E, dtype=acc, device=device),
            count=torch.zeros(N, dtype=torch.long, device=device),
            k_quad=torch.zeros(N, C, H, S, dtype=dtype, device=device),
            k_lin=torch.zeros(N, C, H, S, dtype=dtype, device=device),
            v=torch.zeros(N, C, H, E, dtype=dtype, device=device),
            fill=torch.zeros(N, dtype=torch.long, device=device),
        )

    def to(self, device) -> MixedChunkState:
        """The same state on ``device``."""
        return MixedChunkState(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def select(self, index) -> MixedChunkState:
        """Sequences ``index`` (int, list, int tensor or ``[N]`` bool mask) in that order, e.g. to
        reorder beams or drop finished sequences."""
        idx = torch.as_tensor(index, device=self.kv.device)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        idx = idx.long().reshape(-1)
        return MixedChunkState(**{f.name: getattr(self, f.name).index_select(0, idx) for f in fields(self)})

    def detach(self) -> MixedChunkState:
        """The same values cut from the autograd graph (truncated back-propagation)."""
        return MixedChunkState(**{f.name: getattr(self, f.name).detach() for f in fields(self)})


def check_state(op: str, state, N: int, C: int, H: int, S: int, E: int, device, values: bool = True) -> None:
    """``state`` fits ``N`` sequences of this call; raises ``TypeError`` / ``ValueError``.
    ``values``: also check ``fill`` / ``count`` values (a device->host read; shapes, dtypes and
    devices are always checked)."""
    if not isinstance(state, MixedChunkState):
        raise TypeError(f"{op}: initial_state must be a MixedChunkState, got {type(state).__name__}")
    want = {
        "kv": (N, H, S, E), "count": (N,), "k_quad": (N, C, H, S), "k_lin": (N, C, H, S),
        "v": (N, C, H, E), "fill": (N,),
    }
    for name, shape in want.items():
        x = getattr(state, name)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: initial_state.{name} must be a tensor, got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise ValueError(
                f"{op}: initial_state.{name} has shape {tuple(x.shape)}, expected {shape} "
                f"(N={N} sequences, chunk_size={C}, H={H}, S={S}, E={E})"
            )
        if x.device != device:
            raise ValueError(f"{op}: initial_state.{name} is on {x.device}, inputs on {device}")
    for name in ("count", "fill"):
        if getattr(state, name).dtype.is_floating_point:
            raise TypeError(f"{op}: initial_state.{name} must be an integer tensor")
    if not values:
        return
    fill = state.fill.tolist()
    if any(f < 0 or f >= C for f in fill):
        raise ValueError(f"{op}: initial_state.fill must lie in [0, {C}), got {fill}")
    if any(c < 0 for c in state.count.tolist()):
        raise ValueError(f"{op}: initial_state.count must be >= 0")


def clean_buffers(state: MixedChunkState, dtype: torch.dtype):
    """The state's buffers in ``dtype`` with the slots ``>= fill`` zeroed (they hold no token, so
    whatever a caller left there must not reach the output, the gradients or the next state)."""
    C = state.chunk_size
    keep = torch.arange(C, device=state.fill.device)[None, :] < state.fill[:, None]  # [N, C]
    keep = keep[:, :, None, None]
    return tuple(
        torch.where(keep, b.to(dtype), torch.zeros((), dtype=dtype, device=b.device))
        for b in (state.k_quad, state.k_lin, state.v)
    )


def normalize_linear(lin: torch.Tensor, n_tokens: torch.Tensor, linear_norm: str, C: int) -> torch.Tensor:
    """Divide the linear part by its normaliser ``N``.

    ``lin`` ``[..., E]``; ``n_tokens`` (broadcastable to ``lin``) number of tokens in its sum.
    ``'tokens'``: ``N = n_tokens``, an empty sum gives 0 (seed Code 8's ``divide_no_nan``);
    ``'chunk'``: ``N = C``; ``'none'``: ``N = 1`` (seed Code 1).
    """
    if linear_norm == "none":
        return lin
    if linear_norm == "chunk":
        return lin / C
    n = n_tokens.to(lin.dtype)
    # clamp keeps the unused branch (and its gradient) finite for an empty sum
    return torch.where(n > 0, lin / n.clamp(min=1), torch.zeros((), dtype=lin.dtype, device=lin.device))
