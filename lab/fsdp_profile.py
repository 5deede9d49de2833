"""FSDP2 training step vs one GPU, and where a step's time goes, on every GPU of one host.

    python3 -m torch.distributed.run --standalone --nproc-per-node 4 lab/fsdp_profile.py \
        [--preset flash-base] [--context-len 2048] [--tokens-per-gpu 32768] [--vocab 32000] [--packing rows] \
        [--configs single,u1,u1-sync,u1-dtopt,u1-keep,u4-keep] [--profile single,u1] [--steps 12] [--warmup 3] \
        [--profile-steps 2] [--out fsdp_profile_out]

The step is the eager trainer's (``lintime.training.trainer``): ``forward_backward`` (bf16 autocast, the packed
layout, the fused loss), ``finish_grads``, ``clip_grad_norm`` (1.0), fused AdamW (under FSDP2 by ``ShardStep``,
as the trainer steps it), the numbers kept on the device
(``StepStats``) and read once after the timed steps.  Batches are made on the host each step, as the data iterator
makes them: random tokens, ``--packing rows`` (one sequence per row, the layout ``lintime bench model`` times) or
``documents`` (random document lengths, mean ``--doc-mean`` tokens, other cuts on every rank and step).

Configs (comma-separated): ``single`` -- the plain model on rank 0 alone (the other ranks wait), the one-GPU
baseline in the same processes; ``u<N>`` -- FSDP2 over all ranks with ``N`` blocks per ``fully_shard`` unit
(``wrap_model(blocks_per_unit=N)``; ``uall``: one unit for all blocks), with suffixes ``-keep`` (no reshard after
forward: no all-gather in the backward), ``-noprefetch`` (FSDP2's implicit forward prefetch only), ``-sync`` (the
loss and grad norm read on the host and the device synchronised every step, as the trainer did before it kept
them on the device), ``-dtopt`` (the optimizer stepped on the DTensors, not by ``ShardStep`` on the local shards).

Per config (rank 0 writes ``<out>/fsdp_profile.json``): tokens/s over the timed steps (all ranks' tokens over the
slowest rank's wall time), per GPU, the efficiency ``tokens/s / (GPUs x single's tokens/s)``; per step the device
time between step starts (CUDA events; median / min / max) and the host time until the step function returns (a
host-bound step has host ~= device time); every rank's wall time (a straggler shows); the allocator's retries
(``cudaMalloc`` after a free of the cache: a stall) and peak memory.  Configs in ``--profile``: torch.profiler on
rank 0 over ``--profile-steps`` steps (every rank runs them): ms per step of GEMMs / attention op / elementwise /
norms / loss / optimizer (the categories of ``benchmarks/profile_step.py``), plus NCCL (collective kernels) and
FSDP copies (kernels under FSDP2's ``FSDP::`` annotations: all-gather copy-in / copy-out, reduce-scatter
packing); the device's busy time (union of all kernels), compute busy (union without NCCL), NCCL exposed (busy
minus compute busy: only a collective runs), and host gaps (the profiled step minus busy: the GPU waits for
the host); the 15 largest kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_step  # noqa: E402  (its categories and kernel linking)

from lintime.data import IGNORE_INDEX  # noqa: E402
from lintime.data.packing import Batch  # noqa: E402
from lintime.models import CausalLM, get_preset  # noqa: E402
from lintime.training import parallel as par  # noqa: E402
from lintime.training.step import StepStats, forward_backward  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Spec:
    name: str
    fsdp: bool = True
    blocks_per_unit: int = 1  # 0: all blocks in one unit
    keep: bool = False
    prefetch: bool = True
    sync: bool = False
    dtensor_opt: bool = False


def parse_spec(name: str) -> Spec:
    if name == "single":
        return Spec(name, fsdp=False)
    head, *flags = name.split("-")
    if not head.startswith("u") or not (head[1:] == "all" or head[1:].isdigit()) or set(flags) - {"keep", "noprefetch", "sync", "dtopt"}:
        raise SystemExit(f"unknown config {name!r} (single, u<N>|uall[-keep][-noprefetch][-sync][-dtopt])")
    return Spec(name, blocks_per_unit=0 if head[1:] == "all" else int(head[1:]), keep="keep" in flags,
                prefetch="noprefetch" not in flags, sync="sync" in flags, dtensor_opt="dtopt" in flags)


def make_batch(rows: int, T: int, vocab: int, packing: str, doc_mean: int, seed: int) -> Batch:
    """A host batch as the data iterator gives it (int64 ids / targets, int32 ``cu_seqlens``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, T + 1), generator=g)
    targets = ids[:, 1:].clone()
    cuts = [0]
    for b in range(rows):
        if packing == "documents":
            at = 0
            while True:  # geometric document lengths: a document ends after each token with p = 1 / doc_mean
                at += int(torch.empty(1).geometric_(1.0 / doc_mean, generator=g))
                if at >= T:
                    break
                cuts.append(b * T + at)
                targets[b, at - 1] = IGNORE_INDEX  # a document's last token predicts nothing
        cuts.append((b + 1) * T)
    return Batch(input_ids=ids[:, :-1].contiguous(), targets=targets, cu_seqlens=torch.tensor(cuts, dtype=torch.int32),
                 doc_ids=torch.zeros(rows, T, dtype=torch.long), position_ids=torch.zeros(rows, T, dtype=torch.long),
                 row_ids=torch.arange(rows), epochs=torch.zeros(rows, dtype=torch.long))


def categorize(frames) -> str:
    normed = [f.lower() for f in frames]
    if any("nccl" in f or f.startswith("c10d::") for f in normed):
        return "NCCL"
    if any(f.startswith("fsdp::") for f in normed):
        return "FSDP copies"
    return profile_step.categorize(frames)


CATEGORIES = ("GEMMs", "attention op", "elementwise", "norms", "loss", "optimizer", "NCCL", "FSDP copies")


def profile_summary(prof, steps: int, step_ms: float) -> dict:
    from torch.autograd import DeviceType

    events = prof.events()
    pieces = [(profile_step._stack(e) + (k.name,), k.duration) for e in events if e.device_type == DeviceType.CPU
              for k in e.kernels]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    cats = dict.fromkeys(CATEGORIES, 0.0)
    top: dict[tuple[str, str], float] = {}
    for frames, us in pieces:
        c = categorize(frames)
        cats[c] = cats.get(c, 0.0) + us / 1e3 / steps  # profile_step may name more categories (VQ's quantisation)
        top[(frames[-1][:120], c)] = top.get((frames[-1][:120], c), 0.0) + us / 1e3 / steps
    iv = [(e.time_range.start, e.time_range.end) for e in kernels]
    busy = profile_step._union_us(iv) / 1e3 / steps
    compute = profile_step._union_us([(e.time_range.start, e.time_range.end) for e in kernels
                                      if "nccl" not in e.name.lower()]) / 1e3 / steps
    linked = sum(us for _, us in pieces) / max(sum(e.time_range.elapsed_us() for e in kernels), 1e-9)
    return {"categories_ms": {k: round(v, 3) for k, v in cats.items()}, "busy_ms": round(busy, 3),
            "compute_busy_ms": round(compute, 3), "nccl_exposed_ms": round(busy - compute, 3),
            "profiled_step_ms": round(step_ms, 3), "host_gaps_ms": round(max(0.0, step_ms - busy), 3),
            "kernel_time_linked": round(linked, 3),
            "top": [[n, round(ms, 3), c] for (n, c), ms in sorted(top.items(), key=lambda kv: -kv[1])[:15]]}


class Clock:
    """Step boundaries on the device's timeline: CUDA events (no sync), or the host's clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        m = self.marks
        if self.cuda:
            return [a.elapsed_time(b) for a, b in zip(m, m[1:])]
        return [(b - a) * 1e3 for a, b in zip(m, m[1:])]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(spec: Spec, args, env, out_dir: Path) -> dict | None:
    device = env.device
    cuda = device.type == "cuda"
    amp = torch.bfloat16 if cuda else None
    active = spec.fsdp or env.rank == 0
    world = env.world if spec.fsdp else 1
    result = None
    if active:
        torch.manual_seed(0)
        model = CausalLM(get_preset(args.preset, vocab_size=args.vocab)).to(device).train()
        if spec.fsdp:
            n_blocks = len(model.backbone.blocks)
            par.wrap_model(model, env, "fsdp", amp, blocks_per_unit=spec.blocks_per_unit or n_blocks,
                           reshard_after_forward=not spec.keep, prefetch=spec.prefetch)
        opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4, **({"fused": True} if cuda else {}))
        opt_step = par.ShardStep(opt).step if spec.fsdp and not spec.dtensor_opt else opt.step
        stats = StepStats(device, shares=spec.fsdp)
        rows = args.tokens_per_gpu // args.context_len
        counter, seen = [0], []

        def step():
            seed = 1_000_003 * env.rank + counter[0]
            counter[0] += 1
            batch = make_batch(rows, args.context_len, args.vocab, args.packing, args.doc_mean, seed)
            n = par.global_count(int((batch.targets != IGNORE_INDEX).sum()), env) if spec.fsdp else None
            loss, aux = forward_backward(model, batch, micro_rows=rows, autocast=amp, n_targets=n,
                                         replicas=world, loss_scale=float(world), to_host=False)
            if spec.fsdp:
                par.finish_grads(model, env, "fsdp")
            norm = par.clip_grad_norm(model, 1.0, to_host=False)
            opt_step()
            opt.zero_grad(set_to_none=True)
            stats.add(counter[0], loss, aux, norm)
            if spec.sync:
                seen.extend(stats.read())
                sync(device)

        for _ in range(args.warmup):
            step()
        seen.extend(stats.read())
        sync(device)
        mem = torch.cuda.memory_stats(device) if cuda else {}
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if spec.fsdp:
            dist.barrier()
        clock, host = Clock(device), []
        t0 = time.perf_counter()
        for _ in range(args.steps):
            clock.mark()
            h0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - h0) * 1e3)
        clock.mark()
        seen.extend(stats.read())
        sync(device)
        wall = time.perf_counter() - t0
        dev = clock.intervals_ms()
        result = {"config": spec.name, "gpus": world, "wall_s": wall, "first_loss": seen[0][1], "last_loss": seen[-1][1],
                  "step_ms": {"median": statistics.median(dev), "min": min(dev), "max": max(dev)},
                  "host_ms": {"median": statistics.median(host), "max": max(host)},
                  "alloc_retries": (torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
                                    - mem.get("num_alloc_retries", 0)) if cuda else 0,
                  "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0}
        if spec.name in args.profile and args.profile_steps > 0:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            ctx = profile(activities=acts) if env.rank == 0 else contextlib.nullcontext()
            with ctx as prof:
                p0 = time.perf_counter()
                for _ in range(args.profile_steps):
                    step()
                stats.read()
                sync(device)
                pms = (time.perf_counter() - p0) * 1e3 / args.profile_steps
            if env.rank == 0 and cuda:
                result["profile"] = profile_summary(prof, args.profile_steps, pms)
        del model, opt, stats, step, opt_step
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if env.distributed:
        walls = [None] * env.world
        dist.all_gather_object(walls, result["wall_s"] if (result and spec.fsdp) else None)
        if result is not None and spec.fsdp:
            result["wall_s_per_rank"] = walls
            result["wall_s"] = max(walls)
    if result is not None:
        result["tokens_per_s"] = args.steps * args.tokens_per_gpu * world / result["wall_s"]
        result["tokens_per_s_per_gpu"] = result["tokens_per_s"] / world
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash-base")
    ap.add_argument("--context-len", type=int, default=2048)
    ap.add_argument("--tokens-per-gpu", type=int, default=32768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--packing", choices=("rows", "documents"), default="rows")
    ap.add_argument("--doc-mean", type=int, default=1500, help="documents: mean document length in tokens")
    ap.add_argument("--configs", default="single,u1,u1-sync,u1-dtopt,u1-keep,u4-keep")
    ap.add_argument("--profile", default="single,u1", help="configs profiled on rank 0")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--out", default="fsdp_profile_out")
    ap.add_argument("--device", default="cuda", help="cpu: a check of the script (gloo, no autocast, no profile)")
    args = ap.parse_args()
    args.profile = set(args.profile.split(",")) if args.profile else set()
    specs = [parse_spec(n) for n in args.configs.split(",")]
    env = par.init_distributed(args.device, "fsdp", 1)
    out_dir = Path(args.out)
    if env.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    res = {"settings": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
           "world": env.world, "torch": torch.__version__,
           "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
           "commit": os.environ.get("LINTIME_GIT_COMMIT"), "rows": []}
    base = None
    for spec in specs:
        t0 = time.time()
        try:
            row = run_config(spec, args, env, out_dir)
        except Exception as e:  # noqa: BLE001 -- one failing config must not end the run
            row = {"config": spec.name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        if env.distributed:
            dist.barrier()
        if env.rank != 0 or row is None:
            continue
        if spec.name == "single" and "tokens_per_s" in row:
            base = row["tokens_per_s"]
        if base and "tokens_per_s" in row:
            row["efficiency"] = row["tokens_per_s"] / (row["gpus"] * base)
        res["rows"].append(row)
        (out_dir / "fsdp_profile.json").write_text(json.dumps(res, indent=1))
        if "error" in row:
            print(f"{spec.name:<18} {row['error']}", flush=True)
            continue
        p = row.get("profile")
        extra = (f"  busy {p['busy_ms']:.1f} nccl-exposed {p['nccl_exposed_ms']:.1f} gaps {p['host_gaps_ms']:.1f} ms"
                 if p else "")
        print(f"{spec.name:<18} {row['gpus']} GPU {row['tokens_per_s']:>12,.0f} tok/s ({row['tokens_per_s_per_gpu']:,.0f}/GPU)"
              f" eff {row.get('efficiency', float('nan')):.2f}  step {row['step_ms']['median']:.1f} ms"
              f" [{row['step_ms']['min']:.1f}-{row['step_ms']['max']:.1f}] host {row['host_ms']['median']:.1f} ms"
              f" retries {row['alloc_retries']} ({time.time() - t0:.0f} s){extra}", flush=True)
    if env.rank == 0:
        print(f"wrote {out_dir / 'fsdp_profile.json'}")
    par.shutdown(failed=False)


if __name__ == "__main__":
    main()
