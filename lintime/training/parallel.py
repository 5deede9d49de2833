"""Parallelism, applied from outside the single-device model code: the process groups, data parallel
(DDP / FSDP2) and the gradient reductions and clipping they need.

Process layout.  ``lintime train`` under ``torchrun`` gets ``W = WORLD_SIZE`` processes; with
``--context-parallel P`` they form ``D = W / P`` data-parallel replicas of ``P`` consecutive
ranks each (rank ``r``: data rank ``r // P``, context rank ``r % P``).  The ``P`` ranks of a
replica read the same rows and each holds one contiguous slice of every row's ``T`` tokens.

Gradients.  DDP and FSDP2 reduce over all ``W`` ranks and divide by ``W``; the trainer scales
each rank's loss by ``W`` and divides by the *global* number of predicted tokens (all ranks,
all micro-batches of the step), so the reduced gradient is exactly the single-process gradient
of the same global batch (:func:`lintime.training.step.forward_backward`).  Gradient
accumulation skips the reduction on all but the last micro-batch (:func:`grad_sync`).

Host cost.  Nothing here reads a number on the host during a step (:func:`global_count`,
:func:`finish_grads`, :func:`clip_grad_norm` with ``to_host=False``), and FSDP2's ``DTensor`` s
are handled through their local shards where DTensor's per-op Python dispatch would cost a
host-bound step its time (:func:`clip_grad_norm`, :class:`ShardStep`).

Context parallelism itself (the hand-off of mixer states between the ranks of a replica) is
:mod:`lintime.training.context_parallel`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lintime.utils.device import pick_device

PARALLEL_MODES = ("none", "ddp", "fsdp")
TIMEOUT_S = int(os.environ.get("LINTIME_DIST_TIMEOUT_S", "600"))


# ---------------------------------------------------------------------------------------------
# process groups


@dataclasses.dataclass
class DistEnv:
    """Where this process stands.  Single process: ``world = 1``, every rank 0, no groups."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    cp_group: Any = None
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_name: str, parallel: str, context_parallel: int) -> DistEnv:
    """Start the process group from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR`` / ``MASTER_PORT``): NCCL for CUDA, gloo for CPU; each process
    on ``cuda:LOCAL_RANK``.  Without torchrun (or with ``WORLD_SIZE=1``) returns the
    single-process environment on ``device_name``.  Raises ``ValueError`` (one line) for a
    layout that cannot work."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    world = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else 1
    if world == 1:
        if context_parallel > 1:
            raise ValueError(f"--context-parallel {context_parallel} needs {context_parallel} processes: run under "
                             f"torchrun --nproc-per-node {context_parallel}")
        return DistEnv(device=pick_device(device_name))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if world % context_parallel:
        raise ValueError(f"--context-parallel {context_parallel} must divide the number of processes ({world})")
    if parallel == "none" and world // context_parallel > 1:
        raise ValueError(f"{world} processes with --context-parallel {context_parallel} leave "
                         f"{world // context_parallel} data-parallel replicas: pass --parallel ddp or fsdp")
    if device_name == "cpu" or (device_name == "auto" and not torch.cuda.is_available()):
        device, backend = torch.device("cpu"), "gloo"
    else:
        if not torch.cuda.is_available():
            raise ValueError(f"device {device_name!r} asked for, but CUDA is not available here (use --device cpu)")
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=TIMEOUT_S), **kw)
    P = context_parallel
    cp_group = None
    if P > 1:
        # every rank creates every group, in the same order (new_group is collective)
        for start in range(0, world, P):
            g = dist.new_group(list(range(start, start + P)))
            if start <= rank < start + P:
                cp_group = g
    return DistEnv(rank=rank, world=world, local_rank=local_rank, dp_rank=rank // P, dp_size=world // P,
                   cp_rank=rank % P, cp_size=P, cp_group=cp_group, device=device)


def shutdown(failed: bool) -> None:
    """Leave the process group.  After an error the other ranks may sit in a collective that
    will never complete, so a failing rank aborts the group (NCCL) instead of waiting in a
    barrier; torchrun then stops the remaining ranks (and the collective timeout bounds any
    wait on backends without abort)."""
    if not dist.is_initialized():
        return
    if failed:
        from torch.distributed import distributed_c10d as c10d

        abort = getattr(dist, "abort_process_group", None) or getattr(c10d, "_abort_process_group", None)
        with contextlib.suppress(Exception):
            if abort is not None:
                abort()
        return
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


@contextlib.contextmanager
def main_first(env: DistEnv) -> Iterator[None]:
    """Rank 0 runs the block first, the others after it (e.g. building a shared cache)."""
    if env.distributed and not env.is_main:
        dist.barrier()
    yield
    if env.distributed and env.is_main:
        dist.barrier()


def broadcast_str(value: str, env: DistEnv) -> str:
    """Rank 0's ``value`` on every rank."""
    if not env.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: a copy from pageable memory waits for every
    kernel queued on the stream, one from pinned memory is queued like a kernel (the pinned buffer
    is PyTorch's cached one, kept until the copy is done)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


# ---------------------------------------------------------------------------------------------
# data parallel wrappers


def wrap_model(model: nn.Module, env: DistEnv, parallel: str, autocast: torch.dtype | None, *,
               blocks_per_unit: int = 1, reshard_after_forward: bool = True, prefetch: bool = True) -> nn.Module:
    """The module the training step calls.  ``ddp``: ``DistributedDataParallel`` over all ranks.
    ``fsdp``: FSDP2 ``fully_shard`` on every ``blocks_per_unit`` consecutive blocks (a unit costs one
    all-gather and one reduce-scatter, and FSDP's host work, per direction), then the root
    (parameters sharded over all ranks; with bf16 autocast the policy computes in bf16 and reduces
    gradients in fp32).  ``reshard_after_forward``: free a unit's gathered parameters after its
    forward and gather them again in the backward (``False``: keep them from forward to backward,
    no all-gather in the backward, one more bf16 copy of the model per rank).  The last unit is
    never resharded (the backward starts with it), nor the root (FSDP2's rule).  Where a unit is
    resharded, the mixers add their output bias themselves (``Backbone.defer_bias = False``: the next
    unit's norm would read it after its unit freed it).  ``prefetch``: the
    root's and each unit's forward issue the next unit's all-gather (FSDP2 otherwise issues it when
    the host reaches the next unit: a host-bound step then waits for it).  ``none``: the model itself.
    Returns the module to call; ``model`` keeps its names (for FSDP it *is* the returned module,
    now holding ``DTensor`` shards)."""
    if not env.distributed or parallel == "none":
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [env.device.index] if env.device.type == "cuda" else None
        # buffers (VQ's EMA codebook, updated in the forward pass) follow rank 0's copy: DDP
        # broadcasts them before every forward
        return DDP(model, device_ids=ids)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit must be >= 1, got {blocks_per_unit}")
    mp = MixedPrecisionPolicy(param_dtype=autocast, reduce_dtype=torch.float32) if autocast is not None else None
    # FSDP2 shards only tensors with a dimension; 0-D parameters (the ScaledSin scale) stay
    # replicated and finish_grads averages their gradients
    scalars = {p for p in model.parameters() if p.dim() == 0}
    kw = {"mp_policy": mp} if mp is not None else {}
    blocks = list(model.backbone.blocks)
    groups = [blocks[i : i + blocks_per_unit] for i in range(0, len(blocks), blocks_per_unit)]
    if reshard_after_forward and len(groups) > 1:
        # a unit's output bias would be read by the next unit's norm after the unit freed its gathered parameters
        model.backbone.defer_bias = False
    units = []
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        unit = group[0] if len(group) == 1 else group
        fully_shard(unit, ignored_params=scalars, reshard_after_forward=reshard_after_forward and not last, **kw)
        units.append(group[0])  # the modules of a unit share one FSDP state
    fully_shard(model, ignored_params=scalars, **kw)
    if prefetch:
        for unit, nxt in zip([model] + units, units):
            unit.set_modules_to_forward_prefetch([nxt])
    model._lintime_replicated = sorted(scalars, key=id)
    return model


def reshard(model: nn.Module) -> None:
    """Put every FSDP2 module of ``model`` back in its sharded state (a no-op without FSDP).
    The root module stays unsharded after a forward that no backward follows (validation), and
    an unsharded module's ``parameters()`` are its full tensors, not the ``DTensor`` shards the
    optimizer steps; resharding also frees that full copy."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def finish_grads(model: nn.Module, env: DistEnv, parallel: str) -> None:
    """After the step's last backward: the reductions the wrapper does not do.  Context
    parallelism alone (no wrapper): sum every gradient over the ranks.  FSDP2: average the
    replicated 0-D parameters' gradients (the wrapper averages the sharded ones) in one
    all-reduce.  No host read."""
    if not env.distributed:
        return
    if parallel == "none":
        all_reduce_grads(model, env)
        return
    grads = [p.grad for p in getattr(model, "_lintime_replicated", ()) if p.grad is not None]
    if grads:
        _all_reduce_flat(grads)
        torch._foreach_div_(grads, float(env.world))


@contextlib.contextmanager
def grad_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """Reduce gradients in this backward only when ``sync`` (the last micro-batch of a step):
    ``DDP.no_sync`` / FSDP2 ``set_requires_gradient_sync``; a no-op for a plain module."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(module, DDP) and not sync:
        with module.no_sync():
            yield
        return
    setter = getattr(module, "set_requires_gradient_sync", None)
    if setter is None:
        yield
        return
    setter(sync)
    try:
        yield
    finally:
        setter(True)


def all_reduce_grads(model: nn.Module, env: DistEnv) -> None:
    """Sum the gradients over all ranks (context parallelism without a data-parallel wrapper:
    each rank's gradient is that of its slices' share of the loss)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads:
        _all_reduce_flat(grads)


def _all_reduce_flat(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` over all ranks in place: one flat all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.all_reduce(flat)
        torch._foreach_copy_(group, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in group]), group)])


def global_count(n_local: int, env: DistEnv) -> torch.Tensor:
    """The predicted tokens of the global batch from this rank's count ``n_local`` of its rows: a
    0-d fp64 tensor on ``env.device``, summed over the ranks without a host read (the ``cp_size``
    context ranks of a replica hold the same rows: counted once)."""
    t = torch.full((1,), float(n_local), dtype=torch.float64, device=env.device)  # a fill: no host-to-device copy
    if env.distributed:
        dist.all_reduce(t)
    return (t / env.cp_size if env.cp_size > 1 else t).reshape(())


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, *, to_host: bool = True) -> float | torch.Tensor:
    """Global gradient norm over all ranks, the gradients scaled by ``min(1, max_norm / (norm +
    1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` does (``inf`` = only measure).  Returns the norm
    as a float (``to_host``: one host read), else as a 0-d fp32 tensor on the device (no read).

    Plain gradients (one process, DDP, context parallelism: the same on every rank) take
    ``clip_grad_norm_`` itself.  FSDP2's gradients are ``DTensor`` shards: their squared norm is
    summed over the local shards and the ranks in one all-reduce, the replicated 0-D parameters'
    added once, and the clip scales the local shards -- not DTensor's per-op dispatch (norm,
    stack, reduction, mul over every parameter), host time a host-bound step waits for."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if _is_sharded(g)]
    if not sharded:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
    else:
        local = [_local(g) for g in sharded]
        plain = [g for g in grads if not _is_sharded(g)]
        sq = _squared_norm(local).reshape(1)
        dist.all_reduce(sq, group=sharded[0].device_mesh.get_group())
        if plain:
            sq = sq + _squared_norm(plain)
        norm = sq.sqrt().reshape(())
        if math.isfinite(max_norm):
            torch._foreach_mul_(local + plain, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return float(norm) if to_host else norm


class ShardStep:
    """``optimizer.step()`` for FSDP2's ``DTensor`` parameters, run on their local shards.

    DTensor dispatches every op over its lists in Python (sharding propagation per call): a fused
    AdamW step over a model's few hundred shards costs host time a host-bound step waits for,
    while the update is elementwise: the same kernel on each rank's shards gives the same numbers
    bit for bit.  So after ``optimizer``'s first step has made its state (on the ``DTensor`` s), a
    second optimizer of the same type holds plain parameters that alias the shards' storage, with
    the same state tensors' local storage; :meth:`step` copies the groups' settings (the rate) to
    it, points its gradients at the local gradient shards and steps it.  ``optimizer`` itself
    keeps its ``DTensor`` state (sharded checkpoints read it), updated in place; a state replaced
    since (a loaded checkpoint) is noticed and the aliases made again.  Plain parameters (no FSDP,
    or FSDP's replicated 0-D ones) are stepped as they are."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._local: torch.optim.Optimizer | None = None
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its local alias)
        self._aliased: list[tuple[torch.Tensor, dict]] = []  # (parameter, the state tensors aliased)

    def step(self) -> None:
        if self._local is None or not self._current():
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            if any(p.grad is not None and not self.optimizer.state.get(p) for p in params):
                self._local = None
                self.optimizer.step()  # the first step makes the state
                return
            self._alias()
        for main, local in zip(self.optimizer.param_groups, self._local.param_groups):
            local.update({k: v for k, v in main.items() if k != "params"})
        for p, lp in self._pairs:
            if lp is not p:
                lp.grad = None if p.grad is None else _local(p.grad)
        self._local.step()
        for p, lp in self._pairs:
            if lp is not p:
                lp.grad = None

    def _current(self) -> bool:
        """The optimizer's state tensors are still the ones aliased (not replaced by a load)."""
        state = self.optimizer.state
        return all(state.get(p, {}).get(k) is v for p, tensors in self._aliased for k, v in tensors.items())

    def _alias(self) -> None:
        groups, self._pairs, self._aliased = [], [], []
        for g in self.optimizer.param_groups:
            params = []
            for p in g["params"]:
                lp = nn.Parameter(_local(p), requires_grad=p.requires_grad) if _local(p) is not p else p
                self._pairs.append((p, lp))
                params.append(lp)
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
        self._local = type(self.optimizer)(groups)
        for p, lp in self._pairs:
            state = self.optimizer.state.get(p)
            if state:
                self._local.state[lp] = {k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
                self._aliased.append((p, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local shard itself (``to_local()`` is an autograd call per tensor), else ``t``."""
    return getattr(t, "_local_tensor", t)


def _squared_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of ``tensors``' entries, in fp32 or wider (fp64 for fp64 tensors)."""
    norms = torch.stack(torch._foreach_norm(tensors))
    return norms.to(torch.promote_types(norms.dtype, torch.float32)).square().sum()


def _is_sharded(g: torch.Tensor) -> bool:
    """A ``DTensor`` sharded on a one-dimensional mesh (no replicated or partial dimension): the sum
    of its local shards' squares is its global squared norm."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(g, DTensor) and g.device_mesh.ndim == 1 and all(isinstance(p, Shard) for p in g.placements)
