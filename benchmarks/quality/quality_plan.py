"""The run plan of the quality study: which models, contexts and budgets, and what each run costs.

Tables (each compares its runs at **equal tokens and equal context**):

* ``main``: the eight study models at context 1024 (seed Figures 5-6 / Table 3 at one length);
* ``context``: FLASH, FLASH-Quad, Transformer++ and GLA at 512, 1024, 2048 and 8192 (the 1024 runs
  are the main table's);
* ``chunk``: FLASH at context 2048 with chunk sizes 64, 128, 256, 512 (seed Figure 8; C = 256 is the
  context table's FLASH run).

Every run: ``tokens`` training tokens in batches of ``tokens_per_batch`` (2^15 by default: 256 steps
for 2^23 tokens), the family's seed recipe, seed 0, bf16 autocast on CUDA; validation bits per byte
every 1/16 of the run on the first ``curve_eval_tokens`` validation tokens (the curves), and at the
end :func:`lintime.evaluation.evaluate` at the training context and at 2x and 4x it
(extrapolation), on the first ``final_eval_tokens`` validation tokens.

``smoke`` is the same plan shrunk to run in about a minute on a CPU: tiny presets (the chunk
runs keep their medium presets, as the chunk variants exist only there, at context 128), contexts
/ 8, a few steps, 13 of the runs (every model, every table); it checks the pipeline, its
numbers mean nothing.  On a GPU the smoke keeps the real presets and contexts and takes a few steps of each run,
which checks every configuration and measures each run's throughput.
"""

from __future__ import annotations

import dataclasses
import math

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
REFERENCE = "transformer-pp"  # speed-ups are to reach its final quality (seed Table 3)
MAIN_CONTEXT = 1024
CONTEXT_MODELS = ("flash", "flash-quad", "transformer-pp", "gla")
CONTEXTS = (512, 1024, 2048, 8192)
CHUNK_CONTEXT = 2048
CHUNK_SIZES = (64, 128, 256, 512)
EXTRAPOLATION = (1, 2, 4)  # evaluation contexts, as multiples of the training context

# Conservative H200 training throughput guesses (tokens/s at context 1024, bf16, eager) used only
# to order and balance the queues before anything is measured; quadratic models slow down with
# the context (``QUADRATIC`` share of their cost grows linearly in T).
GUESS_TPS_1K = {"flash": 300e3, "flash-quad": 300e3, "transformer-pp": 400e3, "transformer-p": 400e3,
                "gla": 200e3, "vq": 100e3, "linear": 300e3, "performer": 250e3}
QUADRATIC = {"flash-quad": 0.35, "transformer-pp": 0.2, "transformer-p": 0.2}
RUN_OVERHEAD_S = 25.0  # process start, CUDA context, Triton compiles, final evaluation


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run.  ``id`` is ``<model>-<context>`` (``flash-c64-2048`` for chunk variants)."""

    id: str
    model: str  # key of MODELS
    preset: str
    recipe: str
    context_len: int
    tokens: int
    tokens_per_batch: int
    micro_batch_tokens: int
    tables: tuple[str, ...]
    tier: int  # 0 main, 1 context, 2 chunk: the order the queue starts them in
    chunk_size: int | None = None  # FLASH runs only
    evals: int = 16  # validation points on the curve (every steps // evals steps)
    curve_eval_tokens: int = 131072
    final_eval_tokens: int = 1 << 20
    eval_batch_tokens: int = 65536
    seed: int = 0

    @property
    def steps(self) -> int:
        return math.ceil(self.tokens / self.tokens_per_batch)

    @property
    def eval_contexts(self) -> tuple[int, ...]:
        return tuple(m * self.context_len for m in EXTRAPOLATION)

    def estimate_s(self, tps_1k: dict[str, float] | None = None) -> float:
        """Seconds this run is expected to take (training at the guessed or measured throughput,
        plus a fixed overhead); used to order and balance the queues and for time caps."""
        tps = (tps_1k or GUESS_TPS_1K)[self.model]
        q = QUADRATIC.get(self.model, 0.0)
        slow = (1 - q) + q * self.context_len / MAIN_CONTEXT
        return RUN_OVERHEAD_S + self.tokens / tps * slow * 1.15  # 1.15: curve evaluations


def build_plan(mode: str = "full", tokens: int = 1 << 23, tokens_per_batch: int = 1 << 15) -> list[Run]:
    """The runs of ``mode`` (``full`` | ``smoke`` | ``smoke-gpu``), in queue order (tier, then the
    longest first, so that list scheduling on several GPUs balances well)."""
    if mode not in ("full", "smoke", "smoke-gpu"):
        raise ValueError(f"mode must be full, smoke or smoke-gpu, got {mode!r}")
    if tokens < 1 or tokens_per_batch < 1:
        raise ValueError("tokens and tokens_per_batch must be >= 1")
    runs: dict[str, Run] = {}

    def add(model: str, ctx: int, table: str, tier: int, chunk: int | None = None) -> None:
        name, medium, tiny, recipe = MODELS[model]
        preset = medium if chunk in (None, 256) else f"{medium}-c{chunk}"
        rid = f"{model}-{ctx}" if chunk in (None, 256) else f"{model}-c{chunk}-{ctx}"
        if mode == "smoke" and chunk in (None, 256):
            preset = tiny
        if rid in runs:
            old = runs[rid]
            runs[rid] = dataclasses.replace(old, tables=old.tables + (table,), tier=min(old.tier, tier),
                                            chunk_size=old.chunk_size or chunk)
            return
        T, tpb, tok = ctx, tokens_per_batch, tokens
        kw = {}
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
        runs[rid] = Run(id=rid, model=model, preset=preset, recipe=recipe, context_len=T, tokens=tok,
                        tokens_per_batch=tpb, micro_batch_tokens=tpb, tables=(table,), tier=tier,
                        chunk_size=chunk, **kw)

    for m in MODELS:
        add(m, MAIN_CONTEXT, "main", 0, 256 if m == "flash" else None)
    for ctx in CONTEXTS:
        for m in CONTEXT_MODELS:
            add(m, ctx, "context", 1, 256 if m == "flash" else None)
    for C in CHUNK_SIZES:
        add("flash", CHUNK_CONTEXT, "chunk", 2, C)
    if mode == "smoke":  # every model once, every table with two entries or more
        keep = {f"{m}-{MAIN_CONTEXT}" for m in MODELS} | {"flash-512", "transformer-pp-512", "flash-2048",
                                                            "transformer-pp-2048", "flash-c64-2048"}
        runs = {k: v for k, v in runs.items() if k in keep}
    if mode == "smoke-gpu":  # one run per model at 1k and the heaviest long-context ones are enough
        keep = {f"{m}-{MAIN_CONTEXT}" for m in MODELS} | {"flash-quad-8192", "transformer-pp-8192", "flash-c512-2048"}
        runs = {k: v for k, v in runs.items() if k in keep}
    return sorted(runs.values(), key=lambda r: (r.tier, -r.estimate_s()))


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


def describe(runs: list[Run], n_gpus: int = 4) -> str:
    lines = [f"{len(runs)} runs; predicted seconds per GPU on {n_gpus} GPUs (guessed throughput):"]
    for g, q in enumerate(schedule(runs, n_gpus)):
        lines.append(f"  GPU {g}: {sum(r.estimate_s() for r in q):6.0f} s  " + " ".join(r.id for r in q))
    for r in runs:
        lines.append(f"  {r.id:22s} {r.preset:22s} {r.recipe:5s} T={r.context_len:<5d} {r.tokens / 1e6:6.2f}M tokens "
                     f"{r.steps:4d} steps  tables {','.join(r.tables):14s} ~{r.estimate_s():4.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="print the run plan")
    ap.add_argument("--mode", default="full", choices=("full", "smoke", "smoke-gpu"))
    ap.add_argument("--tokens", type=int, default=1 << 23)
    ap.add_argument("--gpus", type=int, default=4)
    a = ap.parse_args()
    print(describe(build_plan(a.mode, a.tokens), a.gpus))
