"""Context parallelism for the state-carrying mixers (process layout:
:mod:`lintime.training.parallel`).

Every mixer of a causal model is a recurrence over its decoding state (``lintime.layers.base``:
continuing from a state gives what one long call gives, at any split point).  So a sequence split in slices is exact when each rank runs its
slice from the state the earlier slices end in.  Forward hooks on every mixer (the layers know
nothing of ranks) do, per layer:

* context rank ``p > 0`` receives from rank ``p - 1`` the state each row's last sequence ends
  in, and starts the row's first local sequence from it when that sequence continues across
  the slice boundary (else from the empty state);
* the mixer runs its slice with that state (positions continue: the model is called with a
  ``ModelState`` whose ``offset`` is each first sequence's tokens on earlier ranks);
* rank ``p < P - 1`` sends the final state of each row's last sequence to rank ``p + 1``.

Backward runs the same chain in reverse (autograd functions around the send / receive): the
gradient of the received state goes back to rank ``p - 1`` and enters its mixer as the gradient
of its final state, so parameter gradients equal the single-process ones (up to fp32 rounding:
the chunked ops sum the same terms in another order).  The hand-off is sequential over ranks,
but only the mixer's recurrence waits: each rank's layer ``l`` waits for rank ``p - 1``'s layer
``l``, so the ranks run as a pipeline over layers and everything else (projections, FFN,
logits, the loss) runs in parallel.  Mixers whose state grows with the sequence (softmax
attention and GAU keep every earlier key) are refused: shipping the whole KV cache is not
context parallelism.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lintime.layers.attention import KVCache
from lintime.models.backbone import ModelState
from lintime.training.parallel import DistEnv, to_device


# ---------------------------------------------------------------------------------------------
# context parallelism: states as flat lists of tensors


def _flatten(state: Any) -> tuple[list[torch.Tensor], Any]:
    """Tensor leaves of a mixer state (tensor, tuple / list, dataclass, None) and a spec to rebuild it."""
    if isinstance(state, torch.Tensor):
        return [state], "T"
    if state is None or isinstance(state, (int, float, str, bool)):
        return [], ("C", state)
    if isinstance(state, (tuple, list)):
        leaves, specs = [], []
        for s in state:
            lv, sp = _flatten(s)
            leaves += lv
            specs.append((len(lv), sp))
        return leaves, (type(state), specs)
    if dataclasses.is_dataclass(state):
        leaves, specs = [], {}
        for f in dataclasses.fields(state):
            lv, sp = _flatten(getattr(state, f.name))
            leaves += lv
            specs[f.name] = (len(lv), sp)
        return leaves, ("D", state, specs)
    raise TypeError(f"context parallelism: cannot ship a mixer state of type {type(state).__name__}")


def _unflatten(leaves: list[torch.Tensor], spec: Any) -> Any:
    if spec == "T":
        return leaves[0]
    kind = spec[0]
    if kind == "C":
        return spec[1]
    if kind == "D":
        _, proto, specs = spec
        out, i = {}, 0
        for name, (n, sp) in specs.items():
            out[name] = _unflatten(leaves[i : i + n], sp)
            i += n
        return dataclasses.replace(proto, **out)
    typ, specs = spec
    out, i = [], 0
    for n, sp in specs:
        out.append(_unflatten(leaves[i : i + n], sp))
        i += n
    return typ(out)


def _wire_meta(mixer: nn.Module, n: int, x: torch.Tensor) -> list[tuple[torch.Size, torch.dtype]]:
    """``(shape, dtype)`` of every tensor of the state hand-off of ``n`` rows: the leaves of the
    mixer's empty state for ``n`` sequences in the dtype of the mixer input ``x``.

    Sender and receiver both derive the messages from this (never from what the mixer happened to
    return), so every send has a receive of the same shape and dtype on the peer.  A mixer's final
    state need not be in that dtype: under bf16 autocast the mixed chunk state (FLASH, MC-TFM) and
    the VQ state keep their buffers in the activations' bf16 while the residual stream ``x`` is
    fp32; a bf16 send against an fp32 receive is a size mismatch that NCCL does not detect: the
    receiver waits for bytes that never come (how FLASH's context-parallel training once hung)."""
    proto, _ = _flatten(mixer.init_state(n, x.device, x.dtype))
    return [(t.shape, t.dtype) for t in proto]


def _to_wire(mixer: nn.Module, leaves: list[torch.Tensor], meta: list[tuple[torch.Size, torch.dtype]]
             ) -> list[torch.Tensor]:
    """The final-state ``leaves`` cast (differentiably) to the hand-off's dtypes, the dtypes the
    receiver starts its slice from anyway (bf16 buffers widen to fp32 losslessly);
    raises ``RuntimeError`` before anything is sent when their number or shapes differ from
    ``meta`` (a mixer whose final state is not laid out like its ``init_state``)."""
    shapes = [tuple(t.shape) for t in leaves]
    want = [tuple(s) for s, _ in meta]
    if shapes != want:
        raise RuntimeError(f"context parallelism: {type(mixer).__name__}'s final state has tensors of shapes {shapes}, "
                           f"its init_state {want}: the ranks cannot exchange it")
    return [t if t.dtype == dt else t.to(dt) for t, (_, dt) in zip(leaves, meta)]


class _SendState(torch.autograd.Function):
    """Forward: send the tensors to ``peer``; returns a zero scalar that the caller adds to its
    output, so that the backward reaches this node.  Backward: receive the gradients of the
    floating tensors from ``peer`` (they are the gradients of this rank's final state)."""

    @staticmethod
    def forward(ctx, peer: int, group, like: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        for t in tensors:
            dist.send(t.detach().contiguous(), group_dst=peer, group=group)
        ctx.peer, ctx.group = peer, group
        ctx.meta = [(t.shape, t.dtype, t.device, t.is_floating_point()) for t in tensors]
        return like.new_zeros(())

    @staticmethod
    def backward(ctx, _grad):
        grads = []
        for shape, dtype, device, floating in ctx.meta:
            if floating:
                g = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(g, group_src=ctx.peer, group=ctx.group)
                grads.append(g)
            else:
                grads.append(None)
        return (None, None, None, *grads)


class _RecvState(torch.autograd.Function):
    """Forward: receive tensors of the given ``meta`` from ``peer``.  Backward: send the
    gradients of the floating ones back (zeros where a tensor did not influence the loss)."""

    @staticmethod
    def forward(ctx, peer: int, group, meta, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = []
        for shape, dtype in meta:
            t = torch.empty(shape, dtype=dtype, device=anchor.device)
            dist.recv(t, group_src=peer, group=group)
            out.append(t)
        ctx.peer, ctx.group = peer, group
        ctx.floating = [t.is_floating_point() for t in out]
        ctx.mark_non_differentiable(*[t for t in out if not t.is_floating_point()])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        for g, floating in zip(grads, ctx.floating):
            if floating:
                dist.send(g.contiguous(), group_dst=ctx.peer, group=ctx.group)
        return None, None, None, None


@dataclasses.dataclass
class _Slice:
    """The layout of the armed forward: local ``cu_seqlens``, which local sequences start each
    row (``first [b]``) and end it (``last [b]``), and which first sequences continue a sequence
    of the previous rank (``continues [b]`` bool)."""

    first: torch.Tensor
    last: torch.Tensor
    continues: torch.Tensor
    n_local: int


class ContextParallel:
    """Context parallelism over the ranks of ``env.cp_group`` (see the module docstring).

    ``ContextParallel(model, env)`` checks that every mixer can be split (causal model, a
    fixed-size state) and installs forward hooks on the mixers; they act only inside
    :meth:`forward`, so evaluation and sampling use the plain model.

    :meth:`shard` cuts a packed micro-batch (``input_ids [1, b*T]``, ``cu_seqlens``) into this
    rank's slice; :meth:`forward` runs the model on it and returns the slice's logits.
    """

    def __init__(self, model: nn.Module, env: DistEnv, chunk_multiple: int | None = None):
        self.env, self.model = env, model
        self.P, self.p, self.group = env.cp_size, env.cp_rank, env.cp_group
        cfg = model.config
        if not getattr(model, "causal", True) or not model.backbone.causal:
            raise ValueError("context parallelism needs a causal model (a masked LM sees its whole sequence)")
        self.multiple = chunk_multiple or _chunk_multiple(cfg)
        self.mixers = [blk.mixer for blk in model.backbone.blocks]
        for m in self.mixers:
            st = m.init_state(1, "cpu", torch.float32)
            if isinstance(st, KVCache) or any(isinstance(getattr(st, f.name, None), KVCache)
                                              for f in (dataclasses.fields(st) if dataclasses.is_dataclass(st) else ())):
                raise ValueError(
                    f"context parallelism: the {cfg.family!r} mixer ({type(m).__name__}) keeps a cache of every earlier "
                    "key (quadratic attention): passing it between ranks is not cheap. Use a linear-time family "
                    "(flash, linear, gla, vq, mc_tfm) or --context-parallel 1")
        self._slice: _Slice | None = None
        self._handles = []
        for m in self.mixers:
            self._handles.append(m.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
            self._handles.append(m.register_forward_hook(self._post_hook, with_kwargs=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ layout
    def check_length(self, T: int) -> None:
        """Each rank's slice must be a whole number of chunks (chunk boundaries and the mixers'
        block structure then agree with the single-process run's)."""
        if T % self.P or (T // self.P) % self.multiple:
            raise ValueError(f"context parallelism: context_len {T} / {self.P} ranks must be a multiple of "
                             f"{self.multiple} (the mixers' chunk size) per rank")

    def shard(self, ids: torch.Tensor, targets: torch.Tensor, cu: torch.Tensor, rows: int,
              device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's slice of a packed micro-batch of ``rows`` rows of ``T`` tokens:
        ``ids [1, b*T/P]``, ``targets [b*T/P]``, local ``cu_seqlens`` and the ``offset [N_local]``
        of each local sequence (tokens of it on earlier ranks), on ``device`` (default: ``ids``'
        device).  The layout is worked out on the host: given host tensors, no host sync."""
        T = ids.shape[1] // rows
        self.check_length(T)
        L, lo = T // self.P, self.p * (T // self.P)
        ids_l = ids.view(rows, T)[:, lo : lo + L].reshape(1, -1)
        tg_l = targets.view(rows, T)[:, lo : lo + L].reshape(-1)
        cu = cu.long().cpu()
        starts = cu[:-1]
        cu_l, offset, first, last, cont = [], [], [], [], []
        for b in range(rows):
            a, e = b * T + lo, b * T + lo + L  # global range of this slice in row b
            inner = starts[(starts > a) & (starts < e)]
            first.append(len(cu_l))
            cu_l.append(b * L)
            # the sequence holding token a started at the last boundary <= a
            s0 = int(starts[starts <= a].max())
            cont.append(s0 < a)
            offset.append(a - s0)
            for s in inner.tolist():
                cu_l.append(b * L + (s - a))
                offset.append(0)
            last.append(len(cu_l) - 1)
        cu_l.append(rows * L)
        dev = ids.device if device is None else torch.device(device)
        first, last, cont = (to_device(torch.tensor(x), dev) for x in (first, last, cont))
        self._slice = _Slice(first=first, last=last, continues=cont, n_local=len(offset))
        return (to_device(ids_l.contiguous(), dev), to_device(tg_l.contiguous(), dev),
                to_device(torch.tensor(cu_l, dtype=torch.int32), dev), to_device(torch.tensor(offset, dtype=torch.long), dev))

    def forward(self, model: nn.Module, ids: torch.Tensor, cu: torch.Tensor, offset: torch.Tensor,
                aux_losses: dict | None, **kwargs) -> torch.Tensor:
        """Logits ``[1, b*T/P, V]`` of this rank's slice (after :meth:`shard`), or what the model
        returns for ``kwargs`` (``targets=``: the slice's summed loss)."""
        if self._slice is None:
            raise RuntimeError("ContextParallel.forward needs shard() first")
        state = ModelState([None] * len(self.mixers), offset)
        try:
            return model(ids, state=state, cu_seqlens=cu, aux_losses=aux_losses, **kwargs)
        finally:
            self._slice = None

    # ------------------------------------------------------------------ hooks
    def _pre_hook(self, mixer, args, kwargs):
        if self._slice is None:
            return None
        x = args[0]
        sl = self._slice
        init = mixer.init_state(sl.n_local, x.device, x.dtype)
        if self.p > 0:
            meta = _wire_meta(mixer, len(sl.first), x)
            anchor = x.new_zeros((), requires_grad=torch.is_grad_enabled())
            recv = _RecvState.apply(self.p - 1, self.group, meta, anchor)
            leaves, spec_init = _flatten(init)
            keep = sl.continues
            merged = []
            for leaf, got in zip(leaves, recv):
                k = keep.view(-1, *([1] * (got.dim() - 1)))
                got = torch.where(k, got, torch.zeros_like(got)) if got.is_floating_point() else torch.where(k, got, 0)
                merged.append(leaf.index_copy(0, sl.first, got.to(leaf.dtype)))
            init = _unflatten(merged, spec_init)
        args = (x, init) + tuple(args[2:])
        kwargs = dict(kwargs)
        kwargs.pop("state", None)
        return args, kwargs

    def _post_hook(self, mixer, args, kwargs, output):
        if self._slice is None:
            return None
        y, new_state = output
        if self.p < self.P - 1:
            leaves, _ = _flatten(new_state)
            out = [t.index_select(0, self._slice.last) for t in leaves]
            out = _to_wire(mixer, out, _wire_meta(mixer, len(self._slice.last), args[0]))
            token = _SendState.apply(self.p + 1, self.group, y, *out)
            y = y + token.to(y.dtype)
        return y, None


def _chunk_multiple(cfg) -> int:
    """The length each rank's slice must be a multiple of: the mixer's chunk (FLASH, MC-TFM,
    linear, GLA) or block length (VQ); 1 when the family has none."""
    sub = cfg.mixer
    for name in ("chunk_size", "block_len", "block_size"):
        v = getattr(sub, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 1
