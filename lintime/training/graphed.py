"""``lintime train --compile graph``: the whole training step captured in one CUDA graph.

One replay runs what the trainer's eager step runs (:func:`lintime.training.step.forward_backward`, clipping, AdamW),
in the same order: for each micro-batch the forward with its loss (fused with the output projection unless
``fused_loss=False``) under autocast, ``loss / n_targets`` (+ the weighted auxiliary losses) and its backward into
``.grad`` (the first micro-batch writes the gradients, the others add to them: accumulation is captured); the global
gradient norm, clipped (``clip_grad_norm_``'s foreach form: no host read); the fused AdamW step with
``capturable=True`` and the learning rate as a device tensor written before each replay, so the schedule goes on
inside the graph.  The loss, auxiliary loss and gradient norm stay on the device; the caller reads them when it needs
them.  Per step the host copies the batch into the static input buffers, writes ``n_targets`` and the rate, and
launches one replay: no per-kernel launch cost.

Layouts.  ``rows``: every row one sequence (``cu_seqlens=None``), the same every step.  ``documents`` (``doc_capacity``
given): the batch packed by documents, none attending to another, positions restarting at each -- new boundaries
every batch.  The graph then holds one static ``cu_seqlens`` buffer per micro-batch, ``[doc_capacity + 1]`` int32
marked by :func:`lintime.ops.utils.mark_static`: before each replay the host writes the batch's boundaries into it
(its trailing entries repeat the total: empty documents), and every op plans the packed call on the device from it
with sizes bounded by shapes, reading no value on the host (a model whose mixers can: ``backbone.static_packing()``).
A batch with more documents in a micro-batch than the capacity is captured anew with a capacity that fits it (twice
its count, a power of two), so the capacity settles after a few batches.

Capture: a few warm-up steps on a side stream (Triton compiles, cuBLAS workspaces, the optimizer's state), then the
parameters, buffers, optimizer state and RNG states are put back as they were, the gradients set to ``None`` (the
graph's private pool then holds them), and one step captured; so the first replay is the run's first step.
Data parallel (``data_parallel``: the run's :class:`~lintime.training.parallel.DistEnv` under DDP): each rank
holds its own rows of the global batch and the same model.  The step is then two graphs with one collective between
them: the forward and backward of the rank's rows (its loss normalised by the *global* number of targets, summed
over the ranks on the device before the replay), the gradients summed over the ranks in one flat all-reduce
(:func:`lintime.training.parallel.all_reduce_grads`), then clipping and AdamW -- the same update DDP's averaged
gradients of ``world x`` the share give, without DDP's hooks (its wrapper is left for the eager step).  The loss
and auxiliary loss returned are this rank's shares.  FSDP2 and context parallelism communicate inside the step and
are not captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Callable

import numpy as np
import torch

from lintime.data import IGNORE_INDEX, Batch
from lintime.ops.utils import mark_static
from lintime.training import parallel as par
from lintime.training.step import micro_boundaries

WARMUP_STEPS = 3  # eager steps on the side stream before the capture (PyTorch's recipe uses 3; 1 may leave lazy init)


@dataclasses.dataclass
class StepOutput:
    """One step's results, 0-D fp32 tensors on the device (read them with ``float``)."""

    loss: torch.Tensor  # mean cross-entropy per predicted token of the batch
    aux: torch.Tensor  # weighted auxiliary losses (0 when the mixers add none)
    grad_norm: torch.Tensor  # global gradient norm before clipping


def one_sequence_per_row(batch: Batch) -> Batch:
    """``batch`` with every row one sequence: ``cu_seqlens`` = the row starts (the ``rows`` packing).  Targets stay
    those of the documents (a document's last token predicts nothing), positions restart at each row."""
    B, T = batch.input_ids.shape
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    pos = torch.arange(T, dtype=torch.long).expand(B, T).clone()
    return dataclasses.replace(batch, cu_seqlens=cu, position_ids=pos)


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Let a fused Adam / AdamW step inside a graph: ``capturable=True`` on every group.  The fused step keeps its
    step counts on the device either way, so the flag only lifts the capture check; a loaded state dict (which
    brings the saved groups' flags) may have turned it off."""
    for group in optimizer.param_groups:
        if not group.get("fused", False):
            raise ValueError("the graph step needs a fused optimizer: torch.optim.AdamW(..., fused=True)")
        group["capturable"] = True


class GraphedStep:
    """The training step of ``model`` and ``optimizer`` on ``rows x context_len`` batches, captured in one CUDA graph
    on the first call of :meth:`step` (see the module docstring).

    ``micro_rows`` rows per forward / backward (dividing ``rows``), ``clip`` the max global gradient norm (0 = no
    clipping), ``aux_weight`` the weight of the mixers' auxiliary losses, ``autocast`` the autocast dtype (``None``:
    none), ``fused_loss`` as in :func:`lintime.training.step.forward_backward`.  The optimizer's learning rate becomes
    one device tensor shared by its groups (``optimizer.param_groups[i]["lr"]``); :meth:`step` writes it.
    ``doc_capacity``: the documents layout (module docstring) with static ``cu_seqlens`` buffers of this many
    documents per micro-batch to start with (``None``: the rows layout); :meth:`step` then takes the batch's
    ``cu_seqlens``.  ``capture=False`` runs the same step eagerly every call (the reference the captured one is
    checked against).  ``data_parallel``: a DDP run's :class:`~lintime.training.parallel.DistEnv` (module docstring);
    ``rows`` are then this rank's.
    A step that does not capture (a host read inside it, say) leaves the model and optimizer as they were, gives
    ``notice`` one line and makes :meth:`step` return ``None`` from then on: the caller takes its eager step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, rows: int, context_len: int,
                 micro_rows: int | None = None, clip: float = 0.0, aux_weight: float = 0.0,
                 autocast: torch.dtype | None = None, fused_loss: bool = True, capture: bool = True,
                 warmup: int = WARMUP_STEPS, notice: Callable[[str], None] | None = None,
                 doc_capacity: int | None = None, data_parallel: par.DistEnv | None = None):
        device = next(model.parameters()).device
        micro_rows = rows if micro_rows is None else micro_rows
        if micro_rows < 1 or rows % micro_rows:
            raise ValueError(f"micro_rows ({micro_rows}) must divide the batch's {rows} rows")
        if capture:
            if device.type != "cuda":
                raise ValueError(f"a CUDA graph needs a CUDA model, this one is on {device}")
            make_capturable(optimizer)
        self.model, self.optimizer, self.device = model, optimizer, device
        self.rows, self.T, self.micro_rows = rows, context_len, micro_rows
        self.clip, self.aux_weight, self.autocast, self.fused_loss = clip, aux_weight, autocast, fused_loss
        self.capture, self.warmup, self.notice = capture, warmup, notice
        self.env = data_parallel if data_parallel is not None and data_parallel.distributed else None
        self.replicas = self.env.world if self.env is not None else 1
        self.failed: str | None = None  # why the capture failed
        # static inputs: the graph reads these addresses on every replay
        self.input_ids = torch.zeros(rows, context_len, dtype=torch.long, device=device)
        self.targets = torch.full((rows, context_len), IGNORE_INDEX, dtype=torch.long, device=device)
        self.n_targets = torch.ones((), dtype=torch.float32, device=device)
        first_lr = optimizer.param_groups[0]["lr"]
        self.lr = torch.tensor(float(first_lr), dtype=torch.float32, device=device)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        self.graph: torch.cuda.CUDAGraph | None = None
        self.update_graph: torch.cuda.CUDAGraph | None = None  # data parallel: clipping + AdamW after the reduction
        self._out: StepOutput | None = None
        self.packed = doc_capacity is not None
        self.cu: list[torch.Tensor] = []
        if self.packed:
            self._make_buffers(max(int(doc_capacity), micro_rows))

    def _make_buffers(self, capacity: int) -> None:
        """One static ``cu_seqlens`` per micro-batch, ``[capacity + 1]``: the graph reads these addresses."""
        self.doc_capacity = capacity
        total = self.micro_rows * self.T
        self.cu = [mark_static(torch.full((capacity + 1,), total, dtype=torch.int32, device=self.device),
                               max_seqlen=self.T)  # documents never cross rows
                   for _ in range(self.rows // self.micro_rows)]
        for cu in self.cu:
            cu[0] = 0

    def _micro_boundaries(self, cu_seqlens: torch.Tensor) -> list[np.ndarray]:
        """The batch's ``cu_seqlens`` (``[N + 1]``, every row start a boundary) cut per micro-batch, each from 0."""
        cu = np.asarray(cu_seqlens.cpu() if cu_seqlens.device.type != "cpu" else cu_seqlens, dtype=np.int64)
        span = self.micro_rows * self.T
        if cu[0] != 0 or cu[-1] != self.rows * self.T or np.any(np.diff(cu) < 0):
            raise ValueError(f"cu_seqlens must run from 0 to {self.rows * self.T}, non-decreasing")
        out = []
        for m in range(self.rows // self.micro_rows):
            lo, hi = m * span, (m + 1) * span
            part = micro_boundaries(cu, lo, hi)
            if part[0] != 0 or part[-1] != span:
                raise ValueError("cu_seqlens must have a boundary at every micro-batch start")
            out.append(part)
        return out

    # ------------------------------------------------------------------ the step
    def step(self, input_ids: torch.Tensor, targets: torch.Tensor, lr: float,
             cu_seqlens: torch.Tensor | None = None) -> StepOutput | None:
        """One optimiser step on ``input_ids`` / ``targets`` (``[rows, T]``, any device) at learning rate ``lr``;
        in the documents layout ``cu_seqlens`` is the batch's (``[N + 1]`` over the flattened rows, on the host).
        ``None`` (no step taken) once the capture has failed.  The returned tensors are overwritten by the next call
        (the graph's outputs): read or clone them first."""
        if self.failed is not None:
            return None
        if tuple(input_ids.shape) != (self.rows, self.T) or tuple(targets.shape) != (self.rows, self.T):
            raise ValueError(f"the graph step takes [{self.rows}, {self.T}] batches, got {tuple(input_ids.shape)} "
                             f"and {tuple(targets.shape)}")
        if self.packed:
            if cu_seqlens is None:
                raise ValueError("the documents layout takes the batch's cu_seqlens")
            parts = self._micro_boundaries(cu_seqlens)
            most = max(len(p) - 1 for p in parts)
            if most > self.doc_capacity:  # capture anew with buffers that fit (the old graph and its pool go)
                self.graph, self.update_graph, self._out = None, None, None
                self._make_buffers(1 << (2 * most - 1).bit_length())
            for buf, part in zip(self.cu, parts):
                padded = np.full(self.doc_capacity + 1, part[-1], dtype=np.int32)
                padded[:len(part)] = part
                buf.copy_(torch.from_numpy(padded), non_blocking=True)
        elif cu_seqlens is not None:
            raise ValueError("the rows layout takes no cu_seqlens (every row is one sequence)")
        # the number of targets from a host copy where the batch is on the host (no device read)
        n = int((targets != IGNORE_INDEX).sum()) if targets.device.type == "cpu" else (targets != IGNORE_INDEX).sum()
        if self.env is not None:  # the global batch's targets, summed on the device
            n = par.global_count(int(n), self.env)
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.targets.copy_(targets, non_blocking=True)
        if isinstance(n, int):
            self.n_targets.fill_(max(n, 1))
        else:
            self.n_targets.copy_(n.clamp(min=1))
        self.lr.fill_(float(lr))
        if not self.capture:
            self.optimizer.zero_grad(set_to_none=True)
            return self._body()
        if self.graph is None:
            try:
                self._capture_graph()
            except RuntimeError as err:  # e.g. "operation not permitted when stream is capturing"
                self.failed = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if self.env is not None and self._any_rank_failed():  # every rank takes the same step, or none would end
                self.failed = self.failed or "another rank's capture failed"
                self.graph = self.update_graph = self._out = None
            if self.failed is not None:
                self.optimizer.zero_grad(set_to_none=True)
                for group in self.optimizer.param_groups:  # eager steps from here on
                    group["capturable"], group["lr"] = False, float(lr)
                if self.notice is not None:
                    self.notice(f"lintime train: --compile: the step does not capture in a CUDA graph ({self.failed}); "
                                "eager steps")
                return None
        self.graph.replay()
        if self.env is not None:
            par.all_reduce_grads(self.model, self.env)
            self.update_graph.replay()
        return self._out

    def _any_rank_failed(self) -> bool:
        """Whether the capture failed on any rank (one all-reduce of a flag): the ranks must agree, or the graph
        ranks' collectives would wait forever for the eager ranks' DDP buckets."""
        import torch.distributed as dist

        flag = torch.tensor([0.0 if self.failed is None else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _body(self) -> StepOutput:
        """forward + backward of every micro-batch, (data parallel: the gradients summed over the ranks,) clip,
        optimizer step: what the graph (the two graphs) holds."""
        ce, aux = self._grads()
        if self.env is not None:
            par.all_reduce_grads(self.model, self.env)
        return StepOutput(ce, aux, self._update())

    def _grads(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward of every micro-batch into ``.grad``; the loss and auxiliary loss (shares when data
        parallel)."""
        B, b = self.rows, self.micro_rows
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        ce_total, aux_total = zero, zero
        for i, start in enumerate(range(0, B, b)):
            ids, targets = self.input_ids[start:start + b], self.targets[start:start + b]
            aux: dict[str, torch.Tensor] = {}
            with _autocast(self.device, self.autocast):
                if self.packed:  # [1, b * T] with the micro-batch's documents
                    ce = self.model(ids.reshape(1, -1), cu_seqlens=self.cu[i], aux_losses=aux,
                                    targets=targets.reshape(1, -1), fused_loss=self.fused_loss)
                else:
                    ce = self.model(ids, aux_losses=aux, targets=targets, fused_loss=self.fused_loss)
            loss = ce / self.n_targets
            if aux:
                aux_loss = self.aux_weight * (b / (B * self.replicas)) * sum(_at_least_fp32(v) for v in aux.values())
                loss = loss + aux_loss
                aux_total = aux_total + aux_loss.detach().float()
            loss.backward()
            ce_total = ce_total + ce.detach().float()
        return ce_total / self.n_targets, aux_total

    def _update(self) -> torch.Tensor:
        """Clip the gradients and take the optimizer step; the gradient norm before clipping."""
        max_norm = self.clip if self.clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=True)
        self.optimizer.step()
        return grad_norm.float()

    # ------------------------------------------------------------------ capture
    def _capture_graph(self) -> None:
        saved = _snapshot(self.model, self.optimizer, self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*capturable=True.*")  # "... without graph capture"
                for _ in range(self.warmup):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._body()
        finally:
            torch.cuda.current_stream(self.device).wait_stream(side)
            _restore(self.model, self.optimizer, saved)  # the warm-up steps leave no trace, even a failed one
        self.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates the gradients in its pool
        graph = torch.cuda.CUDAGraph()
        if self.env is None:
            with torch.cuda.graph(graph):
                out = self._body()
            self.graph, self._out = graph, out
            return
        with torch.cuda.graph(graph):  # data parallel: the all-reduce runs between the two replays
            ce, aux = self._grads()
        update = torch.cuda.CUDAGraph()
        with torch.cuda.graph(update, pool=graph.pool()):  # reads the gradients the first graph's pool holds
            norm = self._update()
        self.graph, self.update_graph, self._out = graph, update, StepOutput(ce, aux, norm)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """Copies of what a training step changes: parameters, buffers, optimizer state, RNG states."""
    tensors = {id(t): (t, t.detach().clone()) for t in list(model.parameters()) + list(model.buffers())}
    opt_state = {id(p): {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
                 for p, st in optimizer.state.items()}
    return {"tensors": tensors, "opt": opt_state, "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state(device), "device": device}


@torch.no_grad()
def _restore(model: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Put back in place (the graph captures these addresses) what :func:`_snapshot` copied; optimizer state that the
    warm-up created is zeroed, which is AdamW's fresh state (step 0, zero moments)."""
    for t, copy in saved["tensors"].values():
        t.copy_(copy)
    for p, st in optimizer.state.items():
        old = saved["opt"].get(id(p))
        for k, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            if old is not None and k in old:
                v.copy_(old[k])
            else:
                v.zero_()
    torch.set_rng_state(saved["cpu_rng"])
    torch.cuda.set_rng_state(saved["cuda_rng"], saved["device"])
