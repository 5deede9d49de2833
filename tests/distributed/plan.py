"""What the 2-process tests of tests/distributed run, and the one launch that runs it all (``launch_all``, the session
fixture ``launched_all`` of tests/distributed/conftest.py): the single-process references, then every 2-process
scenario of test_distributed.py and the graph-step checks of test_ddp_graph_step.py and test_fsdp_compiled_step.py on
the same 2 gloo processes (``workers.scenarios``; a process start-up costs seconds on a loaded CI machine), then the
2 -> 1 resumes.  The tests read their own pieces."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from launch import run_ranks
from workers import scenarios

from lintime.training import TrainConfig, train

STEPS = 4
CP_PRESETS = (("flash-tiny", 8), ("gla-tiny", 8), ("linear-tiny", 8), ("vq-tiny", 8))
# under bf16 autocast: the families whose final state is not all in the residual stream's dtype
CP_AMP_PRESETS = (("flash-tiny", 8), ("vq-tiny", 8))
ROWS, T = 2, 64
STEP2 = "checkpoints/step_00000002"
# (name, parallel, context parallel, resumed from the run folder's step 2 | None); context
# parallel: each rank's half row must be whole chunks (flash-tiny: C = 64), so T = 128
TWO_RANK_RUNS = (
    ("ddp", "ddp", 1, None),
    ("fsdp", "fsdp", 1, None),
    ("cp", "none", 2, None),
    ("single-to-fsdp2", "fsdp", 1, "single"),
    ("single-to-ddp2", "ddp", 1, "single"),
    ("ddp-to-ddp2", "ddp", 1, "ddp"),
)
ONE_RANK_RESUMES = (("fsdp-to-1", "fsdp"), ("ddp-to-1", "ddp"))
CLIP = ("flash-tiny", 8, 33, 0.05)  # preset, chunk, T, max norm (bites: the norm is larger)
# wrap_model settings: one unit per block (the first resharded after forward, forward prefetch), and both
# blocks of the 2-layer model in one unit without prefetch
CLIP_WRAPS = ({}, {"blocks_per_unit": 2, "prefetch": False})
SHARD_STEP = ("flash-tiny", 8, 33, 4)  # preset, chunk, T, steps
# test_fsdp_compiled_step.py: (preset, chunk, rows per rank, T, steps); test_ddp_graph_step.py: its presets, then
# (chunk, rows per rank, T, steps)
FSDP_COMPILED_JOB = ("transformer-pp-tiny", 8, 2, 32, 3)
DDP_GRAPH_PRESETS = ("flash-tiny", "gla-tiny")
DDP_GRAPH_JOB = (8, 2, 32, 3)


def run_losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("loss") is not None]


def config(base: dict, cp: int = 1, **kw) -> dict:
    return {**base, "context_len": 64 * cp, **kw}


def base_config(corpus: str, cache: str) -> dict:
    """The training runs' settings: a checkpoint and a validation pass at step 2 of 4."""
    return dict(preset="flash-tiny", corpus=corpus, cache_dir=cache, context_len=64, tokens_per_batch=512,
                micro_batch_tokens=256, steps=STEPS, log_every=1, eval_every=2, eval_tokens=128, save_every=2,
                keep=0, plots=False, sample_tokens=0, device="cpu", lr=3e-3)


def launch_all(base: dict, out: Path) -> dict:
    """Single-process references, then every 2-process job in one launch, then the 2 -> 1 resumes.  ``{"out",
    "single": {cp: losses}, "cp_ops": [...], "cp_amp_ops": [...], "runs": {name: result}, "resumed": {name:
    (TrainResult, losses)}, "clip", "shard_step", "fsdp_compiled": [rank 0's, rank 1's], "ddp_graph": {preset:
    [rank 0's, rank 1's]}}``."""
    single = {}
    for cp in (1, 2):
        res = train(TrainConfig(**config(base, cp)), out=str(out), name=f"single-cp{cp}", progress=False, echo=None)
        single[cp] = run_losses(res.run_dir)
    jobs = [("cp_op", (p, c, ROWS, T)) for p, c in CP_PRESETS]
    jobs += [("cp_op", (p, c, ROWS, T, True)) for p, c in CP_AMP_PRESETS]
    for name, parallel, cp, origin in TWO_RANK_RUNS:
        resume = None
        if origin is not None:
            src = out / ("single-cp1" if origin == "single" else origin)
            if origin == "single":
                shutil.copytree(src, out / name)
            else:  # made in this launch: copied there
                jobs.append(("copy", (str(src), str(out / name))))
            resume = str(out / name / STEP2)
        jobs.append(("train", (config(base, cp, parallel=parallel, context_parallel=cp), str(out), name, resume)))
    jobs += [("clip", (*CLIP, wrap)) for wrap in CLIP_WRAPS]
    jobs.append(("shard_step", SHARD_STEP))
    jobs.append(("ddp_graph", (DDP_GRAPH_PRESETS, *DDP_GRAPH_JOB)))
    jobs.append(("fsdp_compiled", FSDP_COMPILED_JOB))
    outs = run_ranks(scenarios, 2, jobs, timeout=600)
    results = outs[0]  # rank 0 (its metrics hold the losses); the op checks need both ranks
    kinds = [kind for kind, _ in jobs]

    def both(kind: str) -> list[tuple]:
        return [(outs[0][i], outs[1][i]) for i, k in enumerate(kinds) if k == kind]

    cp_ops = both("cp_op")
    runs = {args[2]: r for (kind, args), r in zip(jobs, results) if kind == "train"}
    resumed = {}
    for name, origin in ONE_RANK_RESUMES:
        shutil.copytree(out / origin, out / name)
        res = train(TrainConfig(**config(base, parallel="none")), out=str(out), resume=out / name / STEP2,
                    progress=False, echo=None)
        resumed[name] = (res, run_losses(out / name))
    (ddp_graph,) = both("ddp_graph")
    (fsdp_compiled,) = both("fsdp_compiled")
    return {"out": out, "single": single, "cp_ops": cp_ops[:len(CP_PRESETS)], "cp_amp_ops": cp_ops[len(CP_PRESETS):],
            "runs": runs, "resumed": resumed, "clip": both("clip"), "shard_step": both("shard_step")[0],
            "fsdp_compiled": list(fsdp_compiled),
            "ddp_graph": {p: [ddp_graph[0][i], ddp_graph[1][i]] for i, p in enumerate(DDP_GRAPH_PRESETS)}}
