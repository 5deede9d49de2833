"""Functions the distributed tests run on every rank (module level, so ``spawn`` can import them)."""

from __future__ import annotations

import dataclasses

import torch

from lintime.models import CausalLM, get_preset


def tiny_model(preset: str, chunk: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> CausalLM:
    """A 2-layer model of ``preset`` (``dtype``, fp64 by default) with chunk (or block) length ``chunk`` where its mixer
    has one (softmax attention has none)."""
    cfg = get_preset(preset)
    sub = cfg.mixer
    field = "block_len" if hasattr(sub, "block_len") else "chunk_size" if hasattr(sub, "chunk_size") else None
    sub = dataclasses.replace(sub, **{field: chunk}) if field is not None else sub
    cfg = dataclasses.replace(cfg, mixer=sub, n_layers=2, d_model=32 if preset != "vq-tiny" else cfg.d_model)
    torch.manual_seed(seed)
    return CausalLM(cfg).to(dtype)


def packed_batch(rows: int, T: int, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ids [1, rows*T]``, ``targets [rows*T]`` and ``cu_seqlens`` with documents of odd lengths
    that cross the middle of the rows (and one that starts exactly at it)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (1, rows * T), generator=g)
    targets = torch.randint(0, vocab, (rows * T,), generator=g)
    cu = [0]
    for b in range(rows):
        cuts = sorted({b * T + c for c in (3, T // 2 - 5, T // 2, T // 2 + 7) if 0 < c < T})
        cu += cuts + [(b + 1) * T]
    return ids, targets, torch.tensor(cu, dtype=torch.int32)


def context_parallel_step(preset: str, chunk: int, rows: int, T: int, amp: bool = False) -> dict:
    """Forward + backward of this rank's slice under context parallelism; returns the slice's
    logits, the loss share and every parameter gradient summed over ranks.  ``amp``: an fp32 model
    under bf16 autocast (as ``--precision bf16`` trains), where the mixers' final states are not
    all in the residual stream's dtype (the hand-off must still match send for receive)."""
    import torch.distributed as dist

    from lintime.training.context_parallel import ContextParallel
    from lintime.training.parallel import init_distributed

    env = init_distributed("cpu", "none", int(dist.get_world_size() if dist.is_initialized() else 0) or
                           int(__import__("os").environ["WORLD_SIZE"]))
    model = tiny_model(preset, chunk, dtype=torch.float32 if amp else torch.float64)
    cp = ContextParallel(model, env)
    ids, targets, cu = packed_batch(rows, T, model.config.vocab_size)
    ids_l, tg_l, cu_l, offset = cp.shard(ids, targets, cu, rows)
    aux: dict = {}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = cp.forward(model, ids_l, cu_l, offset, aux)
    loss = torch.nn.functional.cross_entropy(logits[0].float() if amp else logits[0], tg_l, reduction="sum") / targets.numel()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
    return {"logits": logits.detach(), "loss": loss.item(), "grads": grads, "rank": env.cp_rank}


def single_step(preset: str, chunk: int, rows: int, T: int, amp: bool = False) -> dict:
    """The single-process reference of :func:`context_parallel_step` (same ``amp`` setting)."""
    model = tiny_model(preset, chunk, dtype=torch.float32 if amp else torch.float64)
    ids, targets, cu = packed_batch(rows, T, model.config.vocab_size)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = model(ids, cu_seqlens=cu)
    loss = torch.nn.functional.cross_entropy(logits[0].float() if amp else logits[0], targets, reduction="sum") / targets.numel()
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.item(),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}


def fsdp_clip_step(preset: str, chunk: int, T: int, max_norm: float, wrap: dict) -> dict:
    """FSDP2 over the ranks (``wrap``: keyword arguments of ``wrap_model``, e.g. the blocks per unit),
    rank ``r`` holding row ``r`` of a ``[world, T]`` batch: forward, backward (loss scaled as the
    trainer scales it), ``finish_grads`` and ``clip_grad_norm`` (the sharded path: local shards, one
    all-reduce).  Returns the norm (the device tensor of ``to_host=False``) and every clipped gradient
    gathered whole."""
    import torch.distributed as dist

    from lintime.training import parallel as par

    env = par.init_distributed("cpu", "fsdp", 1)
    model = tiny_model(preset, chunk, dtype=torch.float32)
    par.wrap_model(model, env, "fsdp", None, **wrap)
    ids = clip_rows(env.world, T, model.config.vocab_size)
    r = env.rank
    ce = model(ids[r : r + 1, :-1], targets=ids[r : r + 1, 1:])  # the row's summed cross-entropy
    (ce / (env.world * (T - 1)) * env.world).backward()
    par.finish_grads(model, env, "fsdp")
    norm = par.clip_grad_norm(model, max_norm, to_host=False)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in model.named_parameters() if p.grad is not None}
    dist.barrier()
    return {"norm": norm, "grads": grads}


def shard_step_run(preset: str, chunk: int, T: int, steps: int) -> dict:
    """FSDP2 training of ``steps`` steps (fused AdamW, the rate changing every step) stepped by
    ``optimizer.step()`` on the ``DTensor`` s, then from the same start by ``ShardStep`` on the local
    shards, whose optimizer state is replaced before step 3 by a copy of itself (as a checkpoint
    load replaces it).  Returns per mode the parameters and the optimizer's ``exp_avg`` s gathered
    whole."""
    import copy

    from lintime.training import parallel as par

    env = par.init_distributed("cpu", "fsdp", 1)
    r = env.rank
    out = {}
    for mode in ("dtensor", "local"):
        model = tiny_model(preset, chunk, dtype=torch.float32)
        par.wrap_model(model, env, "fsdp", None)
        opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-2, fused=True)
        stepper = par.ShardStep(opt) if mode == "local" else opt
        ids = clip_rows(env.world, T, model.config.vocab_size)
        for i in range(steps):
            (model(ids[r : r + 1, :-1], targets=ids[r : r + 1, 1:]) / (T - 1)).backward()
            par.finish_grads(model, env, "fsdp")
            for group in opt.param_groups:
                group["lr"] = 1e-2 / (i + 1)
            if mode == "local" and i == 2:
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            stepper.step()
            opt.zero_grad(set_to_none=True)

        def whole(t):
            return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

        names = {p: n for n, p in model.named_parameters()}
        out[mode] = {"params": {n: whole(p) for p, n in names.items()},
                     "exp_avg": {n: whole(opt.state[p]["exp_avg"]) for p, n in names.items() if p in opt.state}}
    return out


def clip_rows(rows: int, T: int, vocab: int) -> torch.Tensor:
    """``[rows, T]`` token ids of the FSDP clip check (a fixed draw)."""
    return torch.randint(0, vocab, (rows, T), generator=torch.Generator().manual_seed(3))


def scenarios(jobs: list[tuple[str, tuple]]) -> list:
    """Several scenarios, in order, in one set of processes (one process start-up for all): the
    process group is started once here and ``lintime.training.train`` leaves a group it did not
    start alone.  Jobs: ``("cp_op", args of context_parallel_step)``, ``("train", args of
    train_run)``, ``("clip", args of fsdp_clip_step)``,
    ``("shard_step", args of shard_step_run)``, ``("ddp_graph", args of ddp_graph_vs_eager_presets)``,
    ``("fsdp_compiled", args of fsdp_compiled_vs_eager)``, ``("copy", (src, dst))`` (rank 0 copies a run folder, then
    all wait)."""
    import datetime
    import shutil

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    out = []
    for kind, args in jobs:
        if kind == "cp_op":
            out.append(context_parallel_step(*args))
        elif kind == "train":
            out.append(train_run(*args))
        elif kind == "clip":
            out.append(fsdp_clip_step(*args))
        elif kind == "shard_step":
            out.append(shard_step_run(*args))
        elif kind == "ddp_graph":
            out.append(ddp_graph_vs_eager_presets(*args))
        elif kind == "fsdp_compiled":
            out.append(fsdp_compiled_vs_eager(*args))
        elif kind == "copy":
            if dist.get_rank() == 0:
                shutil.copytree(*args)
            dist.barrier()
            out.append(None)
        else:
            raise ValueError(f"unknown job {kind!r}")
    return out


def fail_at(config_dict: dict, out: str, name: str, bad_rank: int, bad_step: int) -> dict:
    """``train_run`` where rank ``bad_rank`` raises in its forward/backward of step ``bad_step``
    (the other rank goes on into the step's gradient reduction)."""
    import os

    from lintime.training import trainer

    if int(os.environ["RANK"]) == bad_rank:
        real, calls = trainer.forward_backward, [0]

        def broken(*args, **kwargs):
            calls[0] += 1
            if calls[0] == bad_step:
                raise RuntimeError(f"injected failure in step {bad_step}")
            return real(*args, **kwargs)

        trainer.forward_backward = broken
    return train_run(config_dict, out, name)


def train_run(config_dict: dict, out: str, name: str, resume: str | None = None, stop_after: int | None = None) -> dict:
    """``lintime.training.train`` on this rank; per-step losses read back from rank 0's metrics."""
    import json
    import os
    from pathlib import Path

    from lintime.training import TrainConfig, train

    cfg = TrainConfig(**config_dict)
    res = train(cfg, out=out, name=name, resume=resume, progress=False, echo=None, stop_after=stop_after)
    losses = []
    if int(os.environ.get("RANK", "0")) == 0:
        for line in (Path(res.run_dir) / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if row.get("loss") is not None:
                losses.append((row["step"], row["loss"]))
    return {"step": res.step, "losses": losses, "first_loss": res.first_loss, "checkpoint": str(res.checkpoint)}


def _rank_batch(i: int, rank: int, rows: int, T: int, vocab: int):
    """Step ``i``'s rows of ``rank`` (each rank its own): ``Batch`` of documents packed anew (a boundary that moves
    every step and one that differs between the ranks), the first row's first quarter without targets."""
    from lintime.data.packing import Batch

    g = torch.Generator().manual_seed(100 * i + rank)
    ids = torch.randint(0, vocab, (rows, T), generator=g)
    targets = torch.randint(0, vocab, (rows, T), generator=g)
    targets[0, : T // 4] = -100
    cu = [0]
    for r in range(rows):
        cu += [r * T + c for c in sorted({3 + i + r, T // 2 + rank})] + [(r + 1) * T]
    zeros = torch.zeros(rows, T, dtype=torch.long)
    return Batch(ids, targets, torch.tensor(cu, dtype=torch.int32), zeros, zeros, torch.arange(rows),
                 torch.zeros(rows, dtype=torch.long))


def fsdp_compiled_vs_eager(preset: str, chunk: int, rows: int, T: int, steps: int) -> dict:
    """On each rank: ``steps`` trainer steps of the same fp32 model under FSDP2 (``wrap_model``'s defaults: one unit
    per block, the first resharded after its forward, forward prefetch) on this rank's documents-packed rows, one
    micro-batch per row (accumulation), the loss scaled as the trainer scales it, ``finish_grads``, clipping that
    bites, ``ShardStep`` (AdamW on the local shards) at a changing rate; after step 1 a validation forward (eval
    mode, no gradient) and ``reshard``.  Once eager, once with ``compile_blocks`` (backend ``aot_eager``: dynamo's
    graphs and AOT autograd's forward / backward split, run as PyTorch ops).  Returns per run the per-step losses
    and gradient norms, the validation logits, the parameters gathered whole; for the compiled run also its notices,
    whether each block traced as one graph, and how many graphs dynamo made."""
    from torch._dynamo.utils import counters

    from lintime.training import parallel as par
    from lintime.training.compile import compile_blocks
    from lintime.training.step import forward_backward, packed_rows

    def whole(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    env = par.init_distributed("cpu", "fsdp", 1)
    out = {}
    for mode in ("eager", "compiled"):
        model = tiny_model(preset, chunk, dtype=torch.float32)
        par.wrap_model(model, env, "fsdp", None)
        lines: list[str] = []
        torch._dynamo.reset()
        counters.clear()
        forms = compile_blocks(model, lines.append, backend="aot_eager") if mode == "compiled" else []
        opt = torch.optim.AdamW(model.param_groups(0.01), lr=1e-3, betas=(0.9, 0.99))
        stepper = par.ShardStep(opt)
        losses, norms, grads, val = [], [], [], None
        for i in range(steps):
            batch = _rank_batch(i, env.rank, rows, T, model.config.vocab_size)
            for group in opt.param_groups:
                group["lr"] = 1e-3 * (i + 1)
            n = par.global_count(int((batch.targets != -100).sum()), env)
            loss, _ = forward_backward(model, batch, micro_rows=1, n_targets=n, replicas=env.world,
                                       loss_scale=float(env.world), to_host=False)
            par.finish_grads(model, env, "fsdp")
            norms.append(par.clip_grad_norm(model, 0.05, to_host=False))
            grads.append({n: whole(p.grad) for n, p in model.named_parameters()})
            stepper.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.float())
            if i == 1:  # the trainer's validation: eval mode, no gradient, then every unit resharded
                ids, _, cu = packed_rows(batch, 0, 1)
                model.eval()
                with torch.no_grad():
                    val = model(ids, cu_seqlens=cu).detach().clone()
                model.train()
                par.reshard(model)
        out[mode] = {"losses": torch.stack(losses), "norms": torch.stack(norms), "val": val, "grads": grads,
                     "params": {n: whole(p) for n, p in model.named_parameters()},
                     "lines": lines, "fullgraph": [f.fullgraph for f in forms],
                     "graphs": counters["stats"]["unique_graphs"]}
    return out


def ddp_graph_vs_eager(preset: str, chunk: int, rows: int, T: int, steps: int) -> dict:
    """On each rank: ``steps`` training steps of the same fp64 model on this rank's documents-packed rows, once as the
    trainer's eager DDP step (``forward_backward`` through the DDP wrapper with the global target count and
    ``loss_scale = world``, clipping, AdamW) and once as the data-parallel graph step's body run eagerly
    (``GraphedStep(data_parallel=env, capture=False)``: the rank's gradients of its share, summed over the ranks in one
    flat all-reduce, clipping, AdamW).  Returns both runs' per-step losses (shares), gradient norms and final
    parameters."""
    from lintime.data.packing import Batch
    from lintime.training import parallel as par
    from lintime.training.graphed import GraphedStep
    from lintime.training.parallel import init_distributed
    from lintime.training.step import forward_backward

    env = init_distributed("cpu", "ddp", 1)
    out = {}
    for mode in ("eager", "graph"):
        model = tiny_model(preset, chunk, dtype=torch.float32)
        opt = torch.optim.AdamW(model.param_groups(0.01), lr=1e-3, betas=(0.9, 0.99))
        step = (GraphedStep(model, opt, rows=rows, context_len=T, micro_rows=1, clip=0.05, capture=False,
                            doc_capacity=2, data_parallel=env) if mode == "graph" else None)
        ddp = par.wrap_model(model, env, "ddp", None) if mode == "eager" else None
        losses, norms = [], []
        for i in range(steps):
            g = torch.Generator().manual_seed(100 * i + env.rank)  # each rank its own rows
            ids = torch.randint(0, model.config.vocab_size, (rows, T), generator=g)
            targets = torch.randint(0, model.config.vocab_size, (rows, T), generator=g)
            targets[0, : T // 4] = -100
            cu = [0]
            for r in range(rows):
                cu += [r * T + c for c in sorted({3 + i + r, T // 2 + env.rank})] + [(r + 1) * T]
            cu = torch.tensor(cu, dtype=torch.int32)
            lr = 1e-3 * (i + 1)
            if step is not None:
                res = step.step(ids, targets, lr, cu_seqlens=cu)
                losses.append(float(res.loss))
                norms.append(float(res.grad_norm))
                continue
            zeros = torch.zeros(rows, T, dtype=torch.long)
            batch = Batch(ids, targets, cu, zeros, zeros, torch.arange(rows), torch.zeros(rows, dtype=torch.long))
            for group in opt.param_groups:
                group["lr"] = lr
            n = par.global_count(int((targets != -100).sum()), env)
            loss, _ = forward_backward(ddp, batch, micro_rows=1, n_targets=n, replicas=env.world,
                                       loss_scale=float(env.world))
            norms.append(float(par.clip_grad_norm(model, 0.05)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
        out[mode] = {"losses": losses, "norms": norms,
                     "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
        if step is not None:  # a capture that failed on rank 1 only: both ranks must learn it
            out["none_failed"] = step._any_rank_failed()
            step.failed = "a failed capture" if env.rank == 1 else None
            out["one_failed"] = step._any_rank_failed()
    return out


def ddp_graph_vs_eager_presets(presets: tuple[str, ...], chunk: int, rows: int, T: int, steps: int) -> list[dict]:
    """:func:`ddp_graph_vs_eager` for each preset in turn, in one set of processes (one start-up for all)."""
    return [ddp_graph_vs_eager(preset, chunk, rows, T, steps) for preset in presets]

