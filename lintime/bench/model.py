"""``lintime bench model``: whole causal LMs against context length -- training-step latency,
tokens/s and peak memory, and decoding latency and state memory per token.

Notation: ``T`` training context (tokens per row), ``rows = max(1, tokens_per_batch // T)`` rows
per step (so every step holds the same ``tokens_per_batch`` tokens while ``T <= tokens_per_batch``;
above it a step is one row of ``T`` tokens), ``L`` decoding context (tokens already in the state),
``Bd`` sequences decoded together.

Training (:func:`bench_train`): for each preset and ``T``, a fresh model and a fused (on CUDA)
AdamW, then warm-up steps and timed steps, each exactly what ``lintime train`` runs per step:
:func:`lintime.training.step.forward_backward` over the batch in the packed layout (one
document per row, bf16 autocast on CUDA by default), gradient clipping, ``opt.step()``,
``zero_grad``.  Reported: the median step time with its 10th / 90th percentiles, tokens/s
(``rows * T / median``), and the peak memory allocated by PyTorch during the timed steps
(weights, gradients, optimiser state and activations).

Decoding (:mod:`lintime.bench.decode`): one model per preset; at each ``L`` a fresh ``L``-token prompt is
prefilled by :func:`lintime.generation.prefill` (timed: prefill tokens/s) and its state replicated to
each batch size of ``decode_batch``; one row per (``L``, batch, path): ``eager``
(:func:`lintime.generation.decode_one_token` per token) and ``graph`` (the static state buffers, one
CUDA-graph replay per token), each timed for ``decode_steps`` tokens.  Reported: the median latency
per token with its percentiles, the state's bytes per sequence (every tensor of the state object,
capacity included: a softmax KV cache grows with ``L``, a linear-time state does not), prefill
tokens/s and the peak memory during the timed steps; a case whose state cannot fit the free device
memory is a ``skipped: memory ...`` row.

Anchors (:mod:`lintime.bench.anchors`): presets named ``hf:llama-<size>`` and ``fla:gla-<size>`` are
other libraries' models at the size of ``transformer-pp-<size>`` / ``gla-<size>``, timed in the same
process on the same tokens: the same training step around the library's own loss, and decoding by
the library's ``generate`` (``eager``; for HF, also ``static-compiled``: its static cache and
compiled forward).  Every row records ``impl`` (``lintime`` or the library and its version) and,
decoding, ``path``.

Failures never end the run: an out-of-memory error gives the row ``status = "OOM"`` and skips the
preset's longer contexts, any other exception ``status = "error: <one line>"``, a preset that cannot
run here ``skipped: <reason>`` rows.  The timed steps of a case stop once they took
``case_budget_s``; a preset whose median timed training step, or whose timed prefill, exceeds it
skips its longer contexts.  Warm-up steps and the untimed warm-up prefills, which hold Triton's
compilation and autotuning, are never judged.  docs/bench_model.md describes every field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable

import torch

from lintime.bench import anchors
from lintime.bench.anchors import SkipPreset
from lintime.bench.common import (  # noqa: F401 -- re-exported: the bench's names for scripts and tests
    DecodeRow,
    autocast_for,
    build_model,
    free_memory,
    impl_name,
    is_oom,
    num_parameters,
    one_line,
    peak_mib,
    preset_config,
    reset_peak,
)
from lintime.bench.decode import bench_decode, decode_paths
from lintime.bench.measure import call_times_ms, environment, quantiles
from lintime.bench.report import decode_table, fmt_size, train_table, write_outputs

SCHEMA = 3  # bench_model.json layout: see docs/bench_model.md (3: settings.decode_batch a list, prefill of a fresh prompt per L)

# family -> its ~110M preset (the seed's "base" size; linear GPT-2's 124M is its smallest), then the anchors
DEFAULT_PRESETS = (
    "flash-base", "flash-base@eager", "flash-base@graph", "flash-quad-base", "transformer-pp-base",
    "transformer-pp-base@graph", "transformer-p-base", "mc-tfm-pp-base", "linear-gpt2-124m", "performer-base",
    "combiner-base", "gla-base", "gla-base@graph", "vq-base", "vq-base@graph", "flash-medium", "transformer-pp-medium",
    "hf:llama-base", "hf:llama-base+compile", "fla:gla-base",
)
# the same at CPU size (``--quick``)
QUICK_PRESETS = (
    "flash-tiny", "flash-quad-tiny", "transformer-pp-tiny", "transformer-p-tiny", "mc-tfm-pp-tiny",
    "linear-tiny", "performer-tiny", "combiner-tiny", "gla-tiny", "vq-tiny", "hf:llama-tiny", "fla:gla-tiny",
)
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
QUICK_CONTEXTS = (32, 64, 128)
TOKENS_PER_BATCH = 32768
QUICK_TOKENS_PER_BATCH = 128
STEPS, QUICK_STEPS = 5, 2
WARMUP, QUICK_WARMUP = 2, 1
DECODE_STEPS, QUICK_DECODE_STEPS = 16, 3
PREFILL_CHUNK = 0  # lintime.generation.prefill's automatic pieces (the whole prompt up to PREFILL_TOKENS per call)
CASE_BUDGET_S = 60.0
LR = 1e-5  # small: the weights barely move over the timed steps (random tokens)
CLIP = 1.0


@dataclasses.dataclass
class TrainRow:
    """One training configuration.  Times in ms; ``tokens = rows * T`` per step."""

    preset: str
    family: str | None
    T: int
    rows: int
    tokens: int
    status: str = "ok"  # "ok" | "OOM" | "error: ..." | "skipped: ..."
    step_ms: float | None = None  # median
    step_p10_ms: float | None = None
    step_p90_ms: float | None = None
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    steps: int = 0  # timed steps actually run
    params: int | None = None
    impl: str = "lintime"  # or the anchor's library and version
    note: str = ""
    # the step: "eager" (packed documents, "<preset>@eager"), "graph" (rows captured in one CUDA graph,
    # "<preset>@graph"), "graph-documents" (packed documents captured); a plain "<preset>" row takes what
    # `lintime train` takes by default on this device (lintime.training.compile.choose_compile)
    step: str = "eager"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one ``lintime bench model`` run measures (stored in the JSON)."""

    presets: tuple[str, ...]
    contexts: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    tokens_per_batch: int
    steps: int
    warmup: int
    decode_steps: int
    decode_batch: tuple[int, ...]  # batch sizes of the decoding rows
    prefill_chunk: int
    dtype: str  # autocast dtype name, "fp32" = none
    device: str
    case_budget_s: float
    train: bool = True
    decode: bool = True
    decode_paths: tuple[str, ...] = ("eager",)  # lintime.bench.decode.PATHS chosen by --decode-path


# ---------------------------------------------------------------------------------------------
# parsing and settings


def parse_sizes(spec: str, what: str) -> tuple[int, ...]:
    """``"1k,2k,4096"`` -> ``(1024, 2048, 4096)`` (``k`` = 1024, ``m`` = 1024**2); sorted, unique."""
    out = []
    for item in (s.strip().lower() for s in spec.split(",") if s.strip()):
        mult = {"k": 1024, "m": 1024**2}.get(item[-1], 1)
        num = item[:-1] if mult > 1 else item
        try:
            n = int(num) * mult
        except ValueError:
            raise ValueError(f"--{what}: {item!r} is not a size (e.g. 4096, 4k, 1m)") from None
        if n < 1:
            raise ValueError(f"--{what}: sizes must be >= 1, got {item!r}")
        out.append(n)
    if not out:
        raise ValueError(f"--{what}: no sizes given")
    return tuple(sorted(set(out)))


def make_settings(
    *, presets: str = "", contexts: str = "", decode_contexts: str = "", tokens_per_batch: int = 0,
    steps: int = 0, warmup: int = 0, decode_steps: int = 0, decode_batch: int | str = 1,
    prefill_chunk: int = PREFILL_CHUNK, dtype: str = "auto", device: str = "auto", quick: bool = False,
    case_budget_s: float = CASE_BUDGET_S, parts: str = "train,decode", decode_path: str = "auto",
) -> Settings:
    """Settings from the command line's flags: empty / 0 = the default (``--quick``'s when set)."""
    from lintime.utils.device import pick_device

    dev = pick_device(device)
    names = tuple(p.strip() for p in presets.split(",") if p.strip()) or (QUICK_PRESETS if quick else DEFAULT_PRESETS)
    ctx = parse_sizes(contexts, "contexts") if contexts else (QUICK_CONTEXTS if quick else CONTEXTS)
    dctx = parse_sizes(decode_contexts, "decode-contexts") if decode_contexts else ctx
    chosen = {p.strip() for p in parts.split(",") if p.strip()}
    if not chosen or chosen - {"train", "decode"}:
        raise ValueError(f"--parts must name train and/or decode, got {parts!r}")
    batches = (int(decode_batch),) if isinstance(decode_batch, int) else parse_sizes(decode_batch, "decode-batch")
    for name, v, lo in (("steps", steps, 0), ("warmup", warmup, 0), ("decode-steps", decode_steps, 0),
                        ("decode-batch", min(batches), 1), ("prefill-chunk", prefill_chunk, 0),
                        ("tokens-per-batch", tokens_per_batch, 0)):
        if v < lo:
            raise ValueError(f"--{name} must be >= {lo}, got {v}")
    if not case_budget_s > 0:
        raise ValueError(f"--case-budget-s must be > 0, got {case_budget_s}")
    amp = autocast_for(dtype, dev)
    paths = decode_paths(decode_path, dev)
    return Settings(
        presets=names, contexts=ctx, decode_contexts=dctx,
        tokens_per_batch=tokens_per_batch or (QUICK_TOKENS_PER_BATCH if quick else TOKENS_PER_BATCH),
        steps=steps or (QUICK_STEPS if quick else STEPS), warmup=warmup or (QUICK_WARMUP if quick else WARMUP),
        decode_steps=decode_steps or (QUICK_DECODE_STEPS if quick else DECODE_STEPS), decode_batch=batches,
        prefill_chunk=prefill_chunk, dtype={None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp],
        device=str(dev), case_budget_s=float(case_budget_s), train="train" in chosen, decode="decode" in chosen,
        decode_paths=paths,
    )


# ---------------------------------------------------------------------------------------------
# batches


DOC_TOKENS = 1024  # mean document length of the packed-documents rows' batches


def random_batch(rows: int, T: int, vocab: int, device: torch.device, seed: int = 0, documents: bool = False):
    """A :class:`~lintime.data.Batch` of uniform random tokens, one document per row (``cu_seqlens`` = row starts):
    a full-context training batch; ``documents``: every row cut into documents at ``T // DOC_TOKENS`` random points
    (the layout ``lintime train`` packs by default), targets kept (random tokens predict random tokens)."""
    from lintime.data.packing import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, T + 1), generator=g)
    cuts = [0]
    for r in range(rows):
        inner = torch.randint(1, T, (T // DOC_TOKENS if documents else 0,), generator=g).unique().tolist()
        cuts += [r * T + c for c in sorted(inner)] + [(r + 1) * T]
    cu = torch.tensor(cuts, dtype=torch.int32)
    return Batch(
        input_ids=ids[:, :-1].contiguous().to(device), targets=ids[:, 1:].contiguous().to(device), cu_seqlens=cu,
        doc_ids=torch.arange(rows).repeat_interleave(T).view(rows, T), position_ids=torch.arange(T).repeat(rows, 1),
        row_ids=torch.arange(rows), epochs=torch.zeros(rows, dtype=torch.long),
    )


# ---------------------------------------------------------------------------------------------
# training


def train_step_fn(model, batch, amp: torch.dtype | None) -> tuple[Callable[[], float], torch.optim.Optimizer]:
    """One ``lintime train`` step over ``batch`` (all rows in one micro-batch): returns
    ``(step, optimizer)``; ``step()`` returns the loss.  An anchor's step is the same around the
    library's own forward and loss (:func:`lintime.bench.anchors.forward_backward_fn`)."""
    from lintime.models import CausalLM
    from lintime.training.step import forward_backward

    device = next(model.parameters()).device
    rows = batch.input_ids.shape[0]
    if isinstance(model, CausalLM):
        groups = model.param_groups(0.1)

        def fwd_bwd() -> float:
            return forward_backward(model, batch, micro_rows=rows, autocast=amp)[0]
    else:
        groups, fwd_bwd = anchors.param_groups(model, 0.1), anchors.forward_backward_fn(model, batch, amp)
    opt = torch.optim.AdamW(groups, lr=LR, **({"fused": True} if device.type == "cuda" else {}))

    def step() -> float:
        loss = fwd_bwd()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


def graph_step_fn(model, batch, amp: torch.dtype | None, documents: bool = False
                  ) -> tuple[Callable[[], float], torch.optim.Optimizer]:
    """The same step as :func:`train_step_fn` (forward + backward, clip, fused AdamW) captured in one CUDA graph by
    :class:`lintime.training.graphed.GraphedStep` on its first call and replayed after: on ``[rows, T]`` rows (one
    sequence each: ``lintime train --compile graph --packing rows``), or with ``documents`` on the batch's packed
    documents (static ``cu_seqlens`` buffers: what ``lintime train`` does by default where the model allows)."""
    from lintime.training.graphed import GraphedStep

    rows, T = batch.input_ids.shape
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=LR, fused=True)
    graphed = GraphedStep(model, opt, rows=rows, context_len=T, clip=CLIP, autocast=amp,
                          doc_capacity=rows if documents else None)
    cu = batch.cu_seqlens if documents else None

    def step() -> float:
        out = graphed.step(batch.input_ids, batch.targets, LR, cu_seqlens=cu)
        if out is None:
            raise RuntimeError(f"the step did not capture: {graphed.failed}")
        return float(out.loss)

    return step, opt


def default_step(cfg, device: torch.device) -> str:
    """The step ``lintime train`` takes by default for ``cfg`` on ``device`` (documents packing, ``--compile auto``):
    ``graph-documents`` where the model plans packed documents on the device, else ``eager``; anchors: ``eager``."""
    from lintime.models import CausalLM
    from lintime.training.compile import choose_compile

    if anchors.is_anchor_spec(cfg):
        return "eager"
    with torch.device("meta"):
        static = CausalLM(cfg).backbone.static_packing()
    mode, _ = choose_compile("auto", device=device, distributed=False, packing="documents", static_packing=static)
    return "graph-documents" if mode == "graph" else "eager"


def _train_case(row: TrainRow, cfg, s: Settings, device: torch.device, amp) -> float:
    """Fill ``row``; returns the time of the last warm-up step in seconds (informational: the
    budget rule of :func:`bench_train` reads the median timed step ``row.step_ms``).

    The warm-up runs ``s.warmup`` steps but stops early once the steps *after the first* took
    ``case_budget_s`` (the first holds compilation / autotuning, whatever it costs)."""
    model = build_model(cfg, device)
    model.train()
    row.params = num_parameters(model)
    documents = row.step != "graph"  # the rows layout only for "<preset>@graph"
    batch = random_batch(row.rows, row.T, cfg.vocab_size, device, documents=documents)
    if row.step == "graph-documents":
        step, opt = graph_step_fn(model, batch, amp, documents=True)
    elif row.step == "graph":
        step, opt = graph_step_fn(model, batch, amp)
    else:
        step, opt = train_step_fn(model, batch, amp)
    last, spent = 0.0, 0.0
    for i in range(s.warmup):  # untimed: compilation, autotuning, the allocator's first pass
        t1 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        last = time.perf_counter() - t1
        if not math.isfinite(loss):
            raise RuntimeError(f"loss is {loss}")
        spent += last if i > 0 else 0.0  # the first step's compilation is not held against the case
        if spent > s.case_budget_s:
            break
    reset_peak(device)
    times = call_times_ms(step, s.steps, device, budget_s=s.case_budget_s)
    q = quantiles(times)
    row.step_ms, row.step_p10_ms, row.step_p90_ms = q["median"], q["p10"], q["p90"]
    row.tokens_per_s = row.tokens / (q["median"] / 1e3)
    row.peak_mib = peak_mib(device)
    row.steps = len(times)
    if len(times) < s.steps:
        row.note = (row.note + "; " if row.note else "") + f"{len(times)}/{s.steps} steps (budget {s.case_budget_s:g} s)"
    del step, opt, batch, model
    return last


def bench_train(s: Settings, on_row: Callable[[TrainRow], None] = lambda r: None,
                train_case: Callable | None = None) -> list[TrainRow]:
    """Training rows for every preset x context of ``s`` (see the module docstring).
    ``train_case(row, cfg, settings, device, amp)`` replaces the measurement (tests; it fills
    ``row``, its return value is ignored); ``on_row`` is called after each row.

    Budget rule: when a row's median timed step exceeds ``case_budget_s``, the preset's longer
    contexts are skipped (a step only gets slower with ``T``).  Warm-up time, which holds Triton's
    compilation and autotuning, is never judged."""
    device = torch.device(s.device)
    amp = autocast_for(s.dtype, device)
    train_case = train_case or _train_case
    rows: list[TrainRow] = []

    def emit(r: TrainRow) -> None:
        rows.append(r)
        on_row(r)

    for name in s.presets:
        base, _, step_kind = name.partition("@")
        try:
            if step_kind not in ("", "graph", "eager"):
                raise SkipPreset(f"unknown step {step_kind!r} in {name!r} ('<preset>@graph' or '<preset>@eager')")
            if step_kind and anchors.is_anchor(base):
                raise SkipPreset("the captured step is lintime's (GraphedStep), not an anchor's")
            if step_kind == "graph" and device.type != "cuda":
                raise SkipPreset(f"the captured step needs CUDA (device {device})")
            cfg, note = preset_config(base, max(s.contexts), device)
        except SkipPreset as e:
            for T in s.contexts:
                emit(TrainRow(name, None, T, 0, 0, status=f"skipped: {e}"))
            continue
        stop = None  # reason to skip the remaining (longer) contexts
        step = step_kind or default_step(cfg, device)
        for T in s.contexts:
            n = max(1, s.tokens_per_batch // T)
            row = TrainRow(name, cfg.family, T, n, n * T, impl=impl_name(cfg), note=note, step=step)
            if stop:
                row.status = f"skipped: {stop}"
                emit(row)
                continue
            torch.manual_seed(0)
            try:
                train_case(row, cfg, s, device, amp)
                if row.step_ms is not None and row.step_ms / 1e3 > s.case_budget_s:
                    stop = (f"median step at T={fmt_size(T)} took {row.step_ms / 1e3:.1f} s "
                            f"> budget {s.case_budget_s:g} s")
            except Exception as e:  # one failing case must not end the run
                if is_oom(e):
                    row.status = "OOM"
                    stop = f"OOM at T={fmt_size(T)}"
                else:
                    row.status = f"error: {one_line(e)}"
                row.step_ms = row.tokens_per_s = None
                row.peak_mib = peak_mib(device)
                del e
            try:
                free_memory(device)
            except Exception as e:  # a sticky CUDA error (e.g. an illegal memory access) surfaces here
                if row.status == "ok":
                    row.status = f"error: {one_line(e)}"
                    row.step_ms = row.step_p10_ms = row.step_p90_ms = row.tokens_per_s = None
                stop = f"device error at T={fmt_size(T)}"
                del e
            emit(row)
    return rows


# ---------------------------------------------------------------------------------------------
# the run


def run_model(s: Settings, out: str, *, echo: Callable[[str], None] = print, plots: bool = True,
              train_case: Callable | None = None, decode_case: Callable | None = None) -> dict:
    """Run the benchmark of ``s``, printing rows as they come and rewriting ``out/bench_model.json``
    after every row (an interrupted run keeps what it measured); then the tables and plots."""
    device = torch.device(s.device)
    os.makedirs(out, exist_ok=True)
    longest = max(max(s.contexts), max(s.decode_contexts) + s.decode_steps + 1)
    result = {"schema": SCHEMA, "env": environment(peaks=False, device=device), "settings": dataclasses.asdict(s),
              "anchors": {n: anchors.describe(n, longest, device) for n in s.presets if anchors.is_anchor(n)},
              "train": [], "decode": []}
    path = os.path.join(out, "bench_model.json")

    def save() -> None:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, path)

    def on_train(r: TrainRow) -> None:
        result["train"].append(dataclasses.asdict(r))
        echo(train_table([result["train"][-1]]).splitlines()[-1])
        save()

    def on_decode(r: DecodeRow) -> None:
        result["decode"].append(dataclasses.asdict(r))
        echo(decode_table([result["decode"][-1]]).splitlines()[-1])
        save()

    echo(json.dumps(result["env"]))
    if s.train:
        echo(train_table([]).splitlines()[0])
        bench_train(s, on_train, train_case)
    if s.decode:
        echo(decode_table([]).splitlines()[0])
        bench_decode(s, on_decode, decode_case)
    write_outputs(result, out, echo, plots)
    return result
