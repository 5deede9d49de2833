"""One optimiser step's gradients and the validation loss, on a batch in the packed layout.

:func:`packed_rows` (a slice of a batch in the packed layout), :func:`forward_backward` (one
optimiser step's gradients, with accumulation), :func:`evaluate` (validation loss, bits per byte
/ perplexity).  The loop that calls them is :mod:`lintime.training.trainer`; ``lintime bench
model`` times :func:`forward_backward` too.

Notation: ``B`` rows per batch (``tokens_per_batch / context_len``), ``T`` = ``context_len``,
``b`` rows per micro-batch, ``V`` vocabulary.

Every step the model sees the batch in the packed layout, ``input_ids.reshape(1, b*T)`` with the
batch's flattened ``cu_seqlens``, so documents never see each other.  The loss of a step is the
mean cross-entropy over the predicted tokens of the *whole* batch (each micro-batch contributes
its summed loss divided by the batch's number of targets, so accumulation gives the big batch's
gradient), plus ``aux_weight`` times the mixers' auxiliary losses (Transformer-VQ's commitment
loss, seed Eq. 35; each micro-batch's is weighted by its share ``b / B`` of the rows).  Mixers
that keep state updated in training mode (the VQ codebook's EMA k-means) update it during the
forward pass; evaluation runs the model in eval mode, which leaves such state alone.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from lintime.data import IGNORE_INDEX, Batch, BatchIterator, TokenDataset, Tokenizer
from lintime.training.parallel import grad_sync, to_device


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)



# ---------------------------------------------------------------------------------------------
# one step


def packed_rows(batch: Batch, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``start:stop`` of ``batch`` in the packed layout: ``input_ids [1, n*T]``,
    ``targets [n*T]`` and their ``cu_seqlens [N'+1]`` (int32; every row start is a boundary)."""
    B, T = batch.input_ids.shape
    if not 0 <= start < stop <= B:
        raise ValueError(f"need 0 <= start < stop <= {B}, got {start}:{stop}")
    cu = micro_boundaries(batch.cu_seqlens.long(), start * T, stop * T)
    ids = batch.input_ids[start:stop].reshape(1, -1)
    return ids, batch.targets[start:stop].reshape(-1), cu.to(torch.int32)


def micro_boundaries(cu_seqlens, lo: int, hi: int):
    """The boundaries of ``cu_seqlens`` (a tensor or an array, every row start one of them) within tokens
    ``lo..hi``, counted from ``lo``."""
    return cu_seqlens[(cu_seqlens >= lo) & (cu_seqlens <= hi)] - lo


def forward_backward(
    model: torch.nn.Module,
    batch: Batch,
    *,
    micro_rows: int,
    aux_weight: float = 0.0,
    autocast: torch.dtype | None = None,
    n_targets: int | torch.Tensor | None = None,
    replicas: int = 1,
    loss_scale: float = 1.0,
    context=None,
    fused_loss: bool = True,
    to_host: bool = True,
    packed: bool = True,
) -> tuple[float, float] | tuple[torch.Tensor, torch.Tensor]:
    """Accumulate into ``.grad`` the gradient of the batch's loss (see the module docstring),
    ``micro_rows`` rows per forward/backward.  Returns ``(loss, aux)``: the mean cross-entropy per
    predicted token and the weighted auxiliary loss, as Python floats (``to_host``: one host read
    after the last backward), else as 0-d fp64 tensors on the model's device (no host read: the
    trainer reads them once per logged step).  Both forms hold the same numbers.

    Distributed (:mod:`lintime.training.parallel`): ``n_targets`` is the number of predicted
    tokens of the *global* batch (all ranks; an int, or a 0-d tensor on the device:
    :func:`~lintime.training.parallel.global_count`), ``replicas`` the number of ranks that share
    the auxiliary losses (data x context parallel), ``loss_scale`` undoes the wrapper's averaging
    (the world size for DDP / FSDP), ``context`` a :class:`~lintime.training.context_parallel.ContextParallel`
    that runs this rank's slice of every row.  The returned numbers are then this rank's share:
    their sum over ranks is the global loss.  Gradients are reduced on the last micro-batch only.

    ``fused_loss``: the model's cross-entropy fused with its output projection (no ``[b*T, V]``
    logits; see :meth:`lintime.models.CausalLM.forward`); ``False`` = the plain loss on the logits.

    ``packed=False``: every row is one sequence, given to the model as ``[b, T]`` rows without
    ``cu_seqlens`` (the call form of :class:`~lintime.training.graphed.GraphedStep`'s rows layout,
    which a model whose loss reads whole rows takes: an MQAR run's loss on the queried positions);
    ``batch`` then needs only its ``input_ids`` and ``targets``, and ``context`` must be None.
    """
    B = batch.input_ids.shape[0]
    if not packed and context is not None:
        raise ValueError("forward_backward: packed=False takes no context (context parallelism packs its rows)")
    if micro_rows < 1 or B % micro_rows:
        raise ValueError(f"micro_rows ({micro_rows}) must divide the batch's {B} rows")
    device = next(model.parameters()).device
    if n_targets is None:
        n_targets = int((batch.targets != IGNORE_INDEX).sum())
    if isinstance(n_targets, torch.Tensor):
        n_targets = n_targets.clamp(min=1)
    else:
        n_targets = max(n_targets, 1)
    ce_total = aux_total = None  # fp64 sums on the device, in micro-batch order (as Python would add them)
    for start in range(0, B, micro_rows):
        if packed:
            ids, targets, cu = packed_rows(batch, start, start + micro_rows)
        else:
            ids, targets = batch.input_ids[start:start + micro_rows], batch.targets[start:start + micro_rows]
        aux: dict[str, torch.Tensor] = {}
        with grad_sync(model, start + micro_rows == B):
            with _autocast(device, autocast):
                # the summed cross-entropy of the micro-batch's (or this rank's slice's) targets
                if not packed:
                    ids, targets = to_device(ids, device), to_device(targets, device)
                    ce = model(ids, aux_losses=aux, targets=targets, fused_loss=fused_loss)
                elif context is None:
                    ids, targets, cu = (to_device(t, device) for t in (ids, targets, cu))
                    ce = model(ids, cu_seqlens=cu, aux_losses=aux, targets=targets.view(1, -1), fused_loss=fused_loss)
                else:
                    ids, targets, cu, offset = context.shard(ids, targets, cu, micro_rows, device=device)
                    ce = context.forward(model, ids, cu, offset, aux, targets=targets.view(1, -1), fused_loss=fused_loss)
            loss = ce / (n_targets.to(ce.dtype) if isinstance(n_targets, torch.Tensor) else n_targets)
            if aux:
                aux_loss = aux_weight * (micro_rows / (B * replicas)) * sum(_at_least_fp32(v) for v in aux.values())
                loss = loss + aux_loss
                aux_total = _add(aux_total, aux_loss)
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        ce_total = _add(ce_total, ce)
    if aux_total is None:
        aux_total = torch.zeros((), dtype=torch.float64, device=device)
    if to_host:
        n = float(n_targets) if isinstance(n_targets, torch.Tensor) else n_targets
        return float(ce_total) / n, float(aux_total)
    # a tensor divisor: a true division (CUDA divides by a host number as a multiplication by its inverse)
    n = n_targets if isinstance(n_targets, torch.Tensor) else torch.full((), float(n_targets), dtype=torch.float64,
                                                                         device=device)
    return ce_total / n.to(torch.float64), aux_total


def _add(total: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().to(torch.float64)
    return x if total is None else total + x


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Losses are taken in fp32 (bf16 logits under autocast), or fp64 when the model is fp64."""
    return x if x.dtype == torch.float64 else x.float()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    dataset: TokenDataset,
    *,
    context_len: int,
    rows: int,
    max_tokens: int,
    objective: str = "clm",
    seed: int = 0,
    mlm_prob: float = 0.15,
    autocast: torch.dtype | None = None,
    tokenizer: Tokenizer | None = None,
) -> dict:
    """Validation on the first ``max_tokens`` tokens of ``dataset`` in split order (the same
    tokens every time): ``{"val_loss", "val_bpb" | "val_ppl", "val_targets"}``.  ``val_bpb`` (byte
    tokenizer: the mean loss in bits per predicted byte) or else ``val_ppl`` = exp(loss)."""
    tok = tokenizer if tokenizer is not None else dataset.tokenizer
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    it = BatchIterator(dataset, batch_size=rows, context_len=context_len, tokenizer=tok, objective=objective,
                       seed=seed, shuffle=False, epochs=1, mlm_prob=mlm_prob)
    total, n, seen = 0.0, 0, 0
    for batch in it:
        ids, targets, cu = packed_rows(batch, 0, rows)
        with _autocast(device, autocast):
            logits = model(ids.to(device), cu_seqlens=cu.to(device))
        targets = targets.to(device)
        total += float(F.cross_entropy(_at_least_fp32(logits[0]), targets, ignore_index=IGNORE_INDEX, reduction="sum"))
        n += int((targets != IGNORE_INDEX).sum())
        seen += rows * context_len
        if seen >= max_tokens:
            break
    model.train(was_training)
    if n == 0:
        raise ValueError("the validation split has no tokens to predict")
    loss = total / n
    out = {"val_loss": loss, "val_targets": n}
    if tok.bits_per_byte:
        out["val_bpb"] = loss / math.log(2)
    else:
        out["val_ppl"] = math.exp(min(loss, 700.0))
    return out


def describe_val(val: dict) -> str:
    score = f"{val['val_bpb']:.4f} bits/byte" if "val_bpb" in val else f"perplexity {val['val_ppl']:.2f}"
    return f"val loss {val['val_loss']:.4f} ({score})"



class StepStats:
    """The loss, auxiliary loss and gradient norm of the training steps not read yet, kept on the
    device: reading a number waits for every kernel queued before it, so the trainer reads them
    once per logged step, all in one read (:meth:`read`).  ``shares``: the losses are this rank's
    shares (:func:`forward_backward`, distributed), summed over the ranks when read in one
    all-reduce (every rank must read at the same steps); the gradient norm is already global."""

    def __init__(self, device: torch.device, shares: bool = False):
        self.device, self.shares = device, shares
        self._steps: list[int] = []
        self._rows: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: int, loss, aux, grad_norm) -> None:
        """Step ``step``'s numbers: 0-d tensors (copied: a CUDA graph's outputs change at its next
        replay) or floats."""
        self._rows.append(torch.stack([_fp64(x, self.device) for x in (loss, aux, grad_norm)]))
        self._steps.append(step)

    def read(self) -> list[tuple[int, float, float, float]]:
        """``[(step, loss, aux, grad_norm)]`` of the steps added since the last read, in order."""
        if not self._steps:
            return []
        values = torch.stack(self._rows)  # [n, 3]
        if self.shares:
            import torch.distributed as dist

            part = values[:, :2].contiguous()
            dist.all_reduce(part)
            values = torch.cat([part, values[:, 2:]], 1)
        out = [(s, *v) for s, v in zip(self._steps, values.tolist())]
        self._steps, self._rows = [], []
        return out


def _fp64(x, device: torch.device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(()).to(device=device, dtype=torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)  # a fill: no host-to-device copy
