"""The shared backbone: token embedding (+ absolute positions), pre-norm residual blocks, final
norm.  One block class for every family: the mixer comes from the family's builder (share the
block, vary the mixer: ``docs/design/conventions.md`` §4).

Notation: ``B`` batch, ``T`` tokens, ``d`` = ``d_model``, ``N`` sequences (``B``, or the number
of packed sequences with ``cu_seqlens``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from lintime.layers.base import Mixer, select_state, state_to
from lintime.layers.ffn import GLU, MLP
from lintime.layers.norms import Norm, build_norm
from lintime.layers.positional import LearnedPositionEmbedding, ScaledSinEmbedding, token_positions
from lintime.models.config import FFNConfig, ModelConfig
from lintime.models.registry import get_family
from lintime.ops.utils import is_static, num_seqs


@dataclasses.dataclass
class ModelState:
    """Decoding state of a whole model.

    ``layers``  one mixer state per block (the mixer's own state class, e.g. ``KVCache``);
    ``offset``  ``[N]`` int64 tokens each sequence has consumed (its next position);
    ``max_offset`` python int, an upper bound of ``offset`` kept on the host (``None``: unknown),
                so that a decoding step can bound its positions without a device->host read.
    """

    layers: list[Any]
    offset: torch.Tensor
    max_offset: int | None = None

    @property
    def batch_size(self) -> int:
        return self.offset.shape[0]

    def select(self, index: torch.Tensor) -> "ModelState":
        """Rows ``index`` of every layer's state (beam reordering; rows may repeat)."""
        index = index.to(self.offset.device)
        return ModelState([select_state(s, index) for s in self.layers], self.offset.index_select(0, index),
                          self.max_offset)

    def to(self, device: torch.device | str) -> "ModelState":
        return ModelState([state_to(s, device) for s in self.layers], self.offset.to(device), self.max_offset)


def build_ffn(cfg: FFNConfig, d_model: int) -> nn.Module:
    hidden = cfg.hidden_size(d_model)
    if cfg.kind == "mlp":
        return MLP(d_model, hidden, activation_name=cfg.activation, bias=cfg.bias, dropout=cfg.dropout)
    return GLU(d_model, hidden, activation_name=cfg.activation, value_activation=cfg.value_activation,
               bias=cfg.bias, dropout=cfg.dropout)


class Block(nn.Module):
    """``x = x + drop(mixer(norm(x)))``; then, with an FFN, ``x = x + drop(ffn(norm(x)))``.

    Fused (``fuse``: the backbone's choice, :attr:`Backbone.fused`), every residual add happens in the pass of
    the norm that reads its result (:meth:`lintime.layers.norms.Norm.add_forward`): the mixer's output is added
    by the FFN norm, and the block's last output is handed on unadded (``branch``) for the next block's mixer norm
    or the final norm to add.  The function is the same; the fp32 add passes over the stream (forward, and the
    gradient sums and casts backward) disappear.  With ``defer_bias`` too, a mixer that offers its output
    projection's bias (:meth:`lintime.layers.Mixer.deferrable_bias`: FLASH, GAU) returns its output without it and
    the bias travels with the branch (``branch_bias``) to the norm that adds the branch, whose backward kernel gives
    its gradient (no GEMV over the output gradient).
    """

    def __init__(self, config: ModelConfig, layer_idx: int, *, causal: bool):
        super().__init__()
        self.mixer_norm = build_norm(config.norm, config.d_model, config.norm_eps)
        self.mixer = get_family(config.family).build_mixer(config, layer_idx, causal)
        if not isinstance(self.mixer, Mixer):
            raise TypeError(
                f"family {config.family!r} built a {type(self.mixer).__name__}, which is not a "
                f"lintime.layers.Mixer"
            )
        if config.ffn is not None:
            self.ffn_norm = build_norm(config.norm, config.d_model, config.norm_eps)
            self.ffn = build_ffn(config.ffn, config.d_model)
        else:
            self.ffn_norm = self.ffn = None
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x, state=None, *, positions, cu_seqlens=None, aux_losses=None, branch=None, branch_bias=None,
                fuse=False, defer_bias=False):
        """``x [B, T, d]`` -> ``(x, branch, branch_bias, state)``: the residual stream is ``x + (branch +
        branch_bias)`` (``branch [B, T, d]`` with ``fuse``, else ``None`` and ``x`` is the stream; ``branch_bias
        [d]`` or ``None``).  ``branch``, ``branch_bias``: the previous block's unadded output and its bias.
        ``defer_bias`` (with ``fuse``): take the mixer's output without its bias where it offers one."""
        if branch is None:
            h = self.mixer_norm(x)
        else:
            x, h = self.mixer_norm.add_forward(x, branch, branch_bias)
        # (``fuse`` holds only without active dropout, which would drop a deferred bias with the output)
        y_bias = self.mixer.deferrable_bias() if fuse and defer_bias else None
        kw = {} if y_bias is None else {"defer_bias": True}
        y, state = self.mixer(h, state, positions=positions, cu_seqlens=cu_seqlens, aux_losses=aux_losses, **kw)
        y = self.drop(y)
        if self.ffn is not None:
            if fuse:
                x, h = self.ffn_norm.add_forward(x, y, y_bias)
            else:
                x = x + y
                h = self.ffn_norm(x)
            y, y_bias = self.drop(self.ffn(h)), None
        return (x, y, y_bias, state) if fuse else (x + y, None, None, state)


class Backbone(nn.Module):
    """Token ids ``[B, T]`` -> hidden states ``[B, T, d]`` (after the final norm)."""

    def __init__(self, config: ModelConfig, *, causal: bool):
        super().__init__()
        self.config, self.causal = config, causal
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        if config.position == "scaled_sin":
            self.pos = ScaledSinEmbedding(config.d_model)
        elif config.position == "learned":
            self.pos = LearnedPositionEmbedding(config.max_positions, config.d_model)
        else:
            self.pos = None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i, causal=causal) for i in range(config.n_layers))
        self.norm = build_norm(config.norm, config.d_model, config.norm_eps) if config.final_norm else nn.Identity()
        # each residual add inside the norm after it (Block); False: the plain adds.  Dropout between a branch and
        # its add keeps the plain path while training.
        self.fused = True
        # with the fused adds, FLASH / GAU's output bias added by the next norm too (Block); False: by the mixers.
        # An FSDP2 unit that frees its gathered parameters after its forward would free the bias before the next
        # block reads it: lintime.training.parallel.wrap_model turns this off then.
        self.defer_bias = True

    def static_packing(self) -> bool:
        """Whether a packed call with a static ``cu_seqlens`` reads none of its values on the host (CUDA): every
        mixer plans it on the device, and no learned position table needs the largest position."""
        return not isinstance(self.pos, LearnedPositionEmbedding) and all(b.mixer.static_packing() for b in self.blocks)

    def fuses_residual(self) -> bool:
        """Whether this call takes the blocks' fused form: :attr:`fused`, and no dropout active."""
        return self.fused and (self.config.dropout == 0 or not self.training)

    def forward(
        self,
        input_ids: torch.Tensor,
        state: ModelState | None = None,
        *,
        cu_seqlens: torch.Tensor | None = None,
        aux_losses: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, ModelState | None]:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if cu_seqlens is not None:
            _check_cu_seqlens(cu_seqlens, B, T)
        N = num_seqs(B, cu_seqlens)
        if state is not None:
            if state.batch_size != N:
                raise ValueError(f"the state holds {state.batch_size} sequences but the input has {N}")
            if len(state.layers) != len(self.blocks):
                raise ValueError(f"the state has {len(state.layers)} layers, the model {len(self.blocks)}")
        offset = None if state is None else state.offset
        positions = token_positions(B, T, offset=offset, cu_seqlens=cu_seqlens, device=input_ids.device)

        # host-side bound of the positions of this call: the largest offset + the new tokens
        max_offset = 0 if state is None else state.max_offset
        max_position = None if max_offset is None else max_offset + T - 1

        x = self.embed(input_ids)  # [B, T, d]
        if isinstance(self.pos, LearnedPositionEmbedding):
            x = x + self.pos(positions, dtype=x.dtype, max_position=max_position)
        elif self.pos is not None:
            x = x + self.pos(positions, dtype=x.dtype)
        x = self.drop(x)
        layer_states = [None] * len(self.blocks) if state is None else state.layers
        new_states = []
        fuse, branch, branch_bias = self.fuses_residual(), None, None
        for block, s in zip(self.blocks, layer_states):
            x, branch, branch_bias, s = block(x, s, positions=positions, cu_seqlens=cu_seqlens, aux_losses=aux_losses,
                                              branch=branch, branch_bias=branch_bias, fuse=fuse,
                                              defer_bias=self.defer_bias)
            new_states.append(s)
        if branch is None:
            x = self.norm(x)
        elif isinstance(self.norm, Norm):
            x = self.norm.add_forward(x, branch, branch_bias)[1]
        else:  # no final norm: the plain adds
            x = x + (branch if branch_bias is None else branch + branch_bias.to(branch.dtype))

        if state is None:
            return x, None
        if cu_seqlens is None:
            consumed = torch.full((B,), T, dtype=torch.long, device=input_ids.device)
        else:
            consumed = cu_seqlens.to(device=input_ids.device, dtype=torch.long).diff()
        return x, ModelState(new_states, state.offset + consumed, None if max_offset is None else max_offset + T)

    def init_state(self, batch_size: int, device=None, dtype=None) -> ModelState:
        """Empty state for ``batch_size`` sequences (default device / dtype: the embedding's)."""
        device = self.embed.weight.device if device is None else device
        dtype = self.embed.weight.dtype if dtype is None else dtype
        layers = [blk.mixer.init_state(batch_size, device, dtype) for blk in self.blocks]
        return ModelState(layers, torch.zeros(batch_size, dtype=torch.long, device=device), 0)


def _check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> None:
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into one row (B == 1), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1], got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if torch.compiler.is_compiling() or is_static(cu_seqlens):
        # inside a compiled graph (or a captured one: a static cu_seqlens, lintime.ops.utils.mark_static) a host
        # read would break it: the same check as an op on the device (an error on the CPU, a device-side assert on
        # CUDA, no sync); the ops skip their own value checks then
        cu = cu_seqlens.long()
        ok = (cu[0] == 0) & (cu[-1] == T) & (cu.diff() >= 0).all()
        torch._assert_async(ok, f"cu_seqlens must start at 0, be non-decreasing and end at T={T}")
        return
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at T={T}, got {cu}")
