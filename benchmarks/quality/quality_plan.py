"""The run plan of the quality study: which models, contexts, budgets and seeds, and what each run costs.

Tables (each compares its runs at **equal tokens and equal context**):

* ``main``: the eight study models at context 1024 (seed Figures 5-6 / Table 3 at one length);
* ``context``: FLASH, FLASH-Quad, Transformer++ and GLA at 512, 1024, 2048 and 8192 (the 1024 runs
  are the main table's);
* ``chunk``: FLASH at context 2048 with chunk sizes 64, 128, 256, 512 (seed Figure 8; C = 256 is the
  context table's FLASH run).

The default study is the ``main`` table with seeds 0, 1, 2 (what one ~9-minute call on three GPUs
holds: :func:`fits`); ``context`` and ``chunk`` are selectable (``tables=``) for a larger budget.

Seeds: every configuration (a *group*, e.g. ``flash-1024``) runs once per seed ``s``, as run
``<group>-s<s>`` (``flash-1024-s1``).  ``s`` is the trainer's ``seed`` (the data order: every model of
seed ``s`` at one context sees the same batches); the initial weights are drawn from ``init_seed``,
the CRC-32 of the run id (:func:`init_seed_of`), so no two runs of the study share an initial draw:
not two contexts of one preset (which ``seed`` alone would give them), not two seeds.

Every run: ``tokens`` training tokens in batches of ``tokens_per_batch`` (2^15 by default: 128 steps
for 2^22 tokens), the family's seed recipe, bf16 autocast on CUDA; validation bits per byte every
1/16 of the run on the first ``curve_eval_tokens`` validation tokens (the curves), and at the end
:func:`lintime.evaluation.evaluate` at the training context and at 2x and 4x it (extrapolation), on
the first ``final_eval_tokens`` validation tokens.

``smoke`` is the plan shrunk to run in a few minutes on a CPU: tiny presets (the chunk runs keep
their medium presets, as the chunk variants exist only there, at context 128), contexts / 8, a few
steps; the first seed of every group of the chosen tables (a few of them) and the first two for
FLASH, FLASH-Quad and Transformer++ at the main context, so that the seed aggregation and the verdicts run;
it checks the pipeline, its numbers mean nothing.  On a GPU (``smoke-gpu``) the smoke keeps the real
presets and contexts, one seed, and takes a few steps of each run, which checks every configuration
and measures each run's throughput.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

# key -> (display name, medium preset, tiny preset for the CPU smoke, recipe)
MODELS = {
    "flash": ("FLASH", "flash-medium", "flash-tiny", "flash"),
    "flash-quad": ("FLASH-Quad", "flash-quad-medium", "flash-quad-tiny", "flash"),
    "transformer-pp": ("Transformer++", "transformer-pp-medium", "transformer-pp-tiny", "flash"),
    "transformer-p": ("Transformer+", "transformer-p-medium", "transformer-p-tiny", "flash"),
    "gla": ("GLA", "gla-medium", "gla-tiny", "gla"),
    "vq": ("Transformer-VQ", "vq-medium", "vq-tiny", "vq"),
    "linear": ("Linear-attention GPT", "linear-medium", "linear-tiny", "flash"),
    "performer": ("Performer", "performer-medium", "performer-tiny", "flash"),
}
REFERENCE = "transformer-pp"  # speed-ups and equal-time views are against its final quality (seed Table 3)
MAIN_CONTEXT = 1024
CONTEXT_MODELS = ("flash", "flash-quad", "transformer-pp", "gla")
CONTEXTS = (512, 1024, 2048, 8192)
CHUNK_CONTEXT = 2048
CHUNK_SIZES = (64, 128, 256, 512)
EXTRAPOLATION = (1, 2, 4)  # evaluation contexts, as multiples of the training context
TABLES = ("main", "context", "chunk")
DEFAULT_TABLES = ("main",)
SEEDS = (0, 1, 2)
SMOKE_SEEDED = ("flash", "flash-quad", "transformer-pp")  # the CPU smoke runs two seeds of these (main context)
# 2^22 tokens (128 steps of 2^15): 24 runs (8 models x 3 seeds) predicted at ~1,000 GPU-s on H200s,
# ~340 s on three GPUs, inside one 540 s call (``fits``); 2^23 would need ~1,450 GPU-s (~500 s: no margin)
DEFAULT_TOKENS = 1 << 22
DEFAULT_TOKENS_PER_BATCH = 1 << 15

# Training throughput (tokens/s at context 1024, bf16, eager, -medium presets) measured on H200s
# (docs/results.md's one-seed study, 2026-11-22, two runs per machine at a time); an H100 may be
# ~10-20 % slower (not measured).  Quadratic models slow down with the context (``QUADRATIC`` share
# of their cost grows linearly in T).
GUESS_TPS_1K = {"flash": 235e3, "flash-quad": 218e3, "transformer-pp": 419e3, "transformer-p": 552e3,
                "gla": 332e3, "vq": 97e3, "linear": 664e3, "performer": 72e3}
QUADRATIC = {"flash-quad": 0.35, "transformer-pp": 0.2, "transformer-p": 0.2}
# Evaluation (forward only) costs about 0.6 of a training token: the same study's single-GPU runs
# spent 12-32 s on 5.1M evaluation tokens at 72-330k training tokens/s (2026-11-22, H200).
EVAL_COST = 0.6
RUN_FIXED_S = 10.0  # per run: process start, model build, checkpoint save and load (same runs: 8-10 s)
STUDY_FIXED_S = 35.0  # per call: nvidia-smi, corpus unpack and check (10 s on 2026-11-22), the report (15 s kept)


def init_seed_of(run_id: str) -> int:
    """The seed of a run's initial weights: CRC-32 of its id (stable across machines and Python
    versions, unlike ``hash``), so every run of the study starts from its own draw."""
    return zlib.crc32(run_id.encode())


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run.  ``group`` is ``<model>-<context>`` (``flash-c64-2048`` for chunk variants);
    ``id`` is ``<group>-s<seed>``."""

    id: str
    group: str
    model: str  # key of MODELS
    preset: str
    recipe: str
    context_len: int
    tokens: int
    tokens_per_batch: int
    micro_batch_tokens: int
    tables: tuple[str, ...]
    tier: int  # 0 main, 1 context, 2 chunk: the order the queue starts them in
    seed: int = 0  # the data order
    init_seed: int = 0  # the initial weights (init_seed_of(id))
    chunk_size: int | None = None  # FLASH runs only
    evals: int = 16  # validation points on the curve (every steps // evals steps)
    curve_eval_tokens: int = 65536
    final_eval_tokens: int = 1 << 19
    eval_batch_tokens: int = 65536

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / self.tokens_per_batch)

    @property
    def eval_contexts(self) -> tuple[int, ...]:
        return tuple(m * self.context_len for m in EXTRAPOLATION)

    def estimate_s(self, tps_1k: dict[str, float] | None = None) -> float:
        """Seconds this run is expected to take on one GPU: training and evaluation tokens at the
        measured (or given) throughput, slower at long contexts for the quadratic models, plus a
        fixed start-up.  Used to order and balance the queues and to check a plan fits a call."""
        tps = (tps_1k or GUESS_TPS_1K)[self.model]
        q = QUADRATIC.get(self.model, 0.0)

        def slow(T: int) -> float:
            return (1 - q) + q * T / MAIN_CONTEXT

        train = self.tokens * slow(self.context_len)
        curve = self.evals * self.curve_eval_tokens * slow(self.context_len)
        final = sum(self.final_eval_tokens * slow(T) for T in self.eval_contexts)
        return RUN_FIXED_S + (train + EVAL_COST * (curve + final)) / tps


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_plan(mode: str = "full", tokens: int = DEFAULT_TOKENS, tokens_per_batch: int = DEFAULT_TOKENS_PER_BATCH,
               seeds: tuple[int, ...] = SEEDS, tables: tuple[str, ...] = DEFAULT_TABLES) -> list[Run]:
    """The runs of ``mode`` (``full`` | ``smoke`` | ``smoke-gpu``) for ``tables`` and ``seeds``, in
    queue order: tier (main table first), then seed (every model's seed 0 before any seed 1, so a
    deadline leaves every model with as many seeds as possible), then the longest first (list
    scheduling on several GPUs balances well)."""
    if mode not in ("full", "smoke", "smoke-gpu"):
        raise ValueError(f"mode must be full, smoke or smoke-gpu, got {mode!r}")
    if tokens < 1 or tokens_per_batch < 1:
        raise ValueError("tokens and tokens_per_batch must be >= 1")
    seeds = tuple(seeds)
    if not seeds or len(set(seeds)) != len(seeds) or any(not isinstance(x, int) or x < 0 for x in seeds):
        raise ValueError(f"seeds must be distinct integers >= 0, got {seeds!r}")
    unknown = set(tables) - set(TABLES)
    if unknown or not tables:
        raise ValueError(f"tables must be a non-empty subset of {TABLES}, got {tables!r}")
    if mode == "smoke-gpu":
        seeds = seeds[:1]
    groups: dict[str, dict] = {}

    def add(model: str, ctx: int, table: str, tier: int, chunk: int | None = None) -> None:
        gid = f"{model}-{ctx}" if chunk in (None, 256) else f"{model}-c{chunk}-{ctx}"
        if gid in groups:
            g = groups[gid]
            g["tables"] += (table,)
            g["tier"] = min(g["tier"], tier)
            g["chunk"] = g["chunk"] or chunk
            return
        groups[gid] = {"model": model, "ctx": ctx, "tables": (table,), "tier": tier, "chunk": chunk}

    if "main" in tables:
        for m in MODELS:
            add(m, MAIN_CONTEXT, "main", 0, 256 if m == "flash" else None)
    if "context" in tables:
        for ctx in CONTEXTS:
            for m in CONTEXT_MODELS:
                add(m, ctx, "context", 1, 256 if m == "flash" else None)
    if "chunk" in tables:
        for C in CHUNK_SIZES:
            add("flash", CHUNK_CONTEXT, "chunk", 2, C)
        add(REFERENCE, CHUNK_CONTEXT, "chunk", 2)  # the speed-up reference at 2048
    if mode == "smoke":  # a few groups of each chosen table (every model of the main table)
        keep = ({f"{m}-{MAIN_CONTEXT}" for m in MODELS} | {"flash-512", "transformer-pp-512", "flash-2048",
                                                          "transformer-pp-2048", "flash-c64-2048"})
        groups = {k: v for k, v in groups.items() if k in keep}
    if mode == "smoke-gpu":  # one run per model at 1k and the heaviest long-context ones are enough
        keep = {f"{m}-{MAIN_CONTEXT}" for m in MODELS} | {"flash-quad-8192", "transformer-pp-8192", "flash-c512-2048"}
        groups = {k: v for k, v in groups.items() if k in keep}

    runs = []
    for gid, g in groups.items():
        model, ctx, chunk = g["model"], g["ctx"], g["chunk"]
        name, medium, tiny, recipe = MODELS[model]
        preset = medium if chunk in (None, 256) else f"{medium}-c{chunk}"
        if mode == "smoke" and chunk in (None, 256):
            preset = tiny
        T, tpb, tok = ctx, tokens_per_batch, tokens
        kw: dict = {}
        if mode == "smoke" and preset == tiny:  # CPU: contexts / 8, 3 steps of 4 rows, tiny evaluations
            T = ctx // 8
            tpb = 4 * T
            tok = 3 * tpb
            kw = dict(evals=3, curve_eval_tokens=2 * T, final_eval_tokens=4 * T, eval_batch_tokens=8192)
        elif mode == "smoke":  # the medium chunk variants: 2 steps of one 128-token row
            T = tpb = 128
            tok = 2 * tpb
            kw = dict(evals=2, curve_eval_tokens=T, final_eval_tokens=T, eval_batch_tokens=8192)
        elif mode == "smoke-gpu":  # real presets and contexts, 12 steps: configs, memory, throughput
            tok = 12 * tpb
            kw = dict(evals=4, curve_eval_tokens=4 * T, final_eval_tokens=max(8 * T, 65536))
        tpb = max(tpb, T)
        run_seeds = seeds
        if mode == "smoke":  # two seeds (the fewest a spread needs) of a few configurations, one of the rest
            run_seeds = seeds[:2] if model in SMOKE_SEEDED and ctx == MAIN_CONTEXT else seeds[:1]
        for sd in run_seeds:
            rid = f"{gid}-s{sd}"
            runs.append(Run(id=rid, group=gid, model=model, preset=preset, recipe=recipe, context_len=T, tokens=tok,
                            tokens_per_batch=tpb, micro_batch_tokens=tpb, tables=g["tables"], tier=g["tier"],
                            seed=sd, init_seed=init_seed_of(rid), chunk_size=chunk, **kw))
    rank = {sd: i for i, sd in enumerate(seeds)}
    return sorted(runs, key=lambda r: (r.tier, rank[r.seed], -r.estimate_s(), r.id))


def schedule(runs: list[Run], n_gpus: int, tps_1k: dict[str, float] | None = None) -> list[list[Run]]:
    """Greedy list scheduling in queue order: each run goes to the GPU that frees up first.  The
    driver does the same dynamically; this is the static prediction it prints."""
    loads = [0.0] * n_gpus
    queues: list[list[Run]] = [[] for _ in range(n_gpus)]
    for r in runs:
        g = min(range(n_gpus), key=lambda i: loads[i])
        queues[g].append(r)
        loads[g] += r.estimate_s(tps_1k)
    return queues


def fits(runs: list[Run], n_gpus: int, deadline_s: float, tps_1k: dict[str, float] | None = None) -> dict:
    """The predicted cost of ``runs`` on ``n_gpus`` GPUs against a call of ``deadline_s`` seconds:
    ``{gpu_s, makespan_s, available_s, fits, margin}`` (makespan: the call's fixed start plus the
    busiest GPU's queue; ``margin``: the unused fraction of the deadline, negative when it overruns)."""
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    gpu_s = sum(r.estimate_s(tps_1k) for r in runs)
    makespan = STUDY_FIXED_S + max(sum(r.estimate_s(tps_1k) for r in q) for q in schedule(runs, n_gpus, tps_1k))
    return {"gpu_s": gpu_s, "makespan_s": makespan, "available_s": deadline_s, "fits": makespan <= deadline_s,
            "margin": 1 - makespan / deadline_s}


def describe(runs: list[Run], n_gpus: int = 3, deadline_s: float | None = None) -> str:
    seeds = sorted({r.seed for r in runs})
    lines = [f"{len(runs)} runs ({len({r.group for r in runs})} configurations x seeds {','.join(map(str, seeds))}); "
             f"predicted seconds per GPU on {n_gpus} GPUs (H200 throughputs of GUESS_TPS_1K):"]
    for g, q in enumerate(schedule(runs, n_gpus)):
        lines.append(f"  GPU {g}: {sum(r.estimate_s() for r in q):6.0f} s  " + " ".join(r.id for r in q))
    for r in runs:
        lines.append(f"  {r.id:24s} {r.preset:22s} {r.recipe:5s} T={r.context_len:<5d} {r.tokens / 1e6:6.2f}M tokens "
                     f"{r.steps:4d} steps  init {r.init_seed:<10d}  tables {','.join(r.tables):14s} ~{r.estimate_s():4.0f} s")
    f = fits(runs, n_gpus, deadline_s or math.inf)
    lines.append(f"total {f['gpu_s']:.0f} GPU-s; predicted call {f['makespan_s']:.0f} s on {n_gpus} GPUs "
                 f"({STUDY_FIXED_S:.0f} s start and report + the busiest queue)"
                 + ("" if deadline_s is None else
                    f" against DEADLINE_S {deadline_s:.0f} s: " + (f"fits ({100 * f['margin']:.0f} % margin)" if f["fits"]
                                                                else "DOES NOT FIT (runs at the end would be killed)")))
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="print the run plan and its predicted cost")
    ap.add_argument("--mode", default="full", choices=("full", "smoke", "smoke-gpu"))
    ap.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    ap.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="comma-separated seeds (default %(default)s)")
    ap.add_argument("--tables", default=",".join(DEFAULT_TABLES), help=f"comma-separated, of {','.join(TABLES)}")
    ap.add_argument("--gpus", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=None, help="check the plan fits a call this long")
    a = ap.parse_args()
    plan = build_plan(a.mode, a.tokens, seeds=parse_ints(a.seeds), tables=tuple(a.tables.split(",")))
    print(describe(plan, a.gpus, a.deadline_s))
