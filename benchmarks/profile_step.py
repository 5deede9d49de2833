"""Where the time of one training step goes: a per-category breakdown (torch.profiler) of the step that
``lintime bench model`` times, for given presets at given context lengths.

    python3 benchmarks/profile_step.py --presets flash-base,gla-base,transformer-pp-base --contexts 2k,8k,32k \
        [--tokens-per-batch 32768] [--steps 3] [--warmup 2] [--device cuda] [--dtype auto] [--out profile_step_out]

Each row profiles the step ``lintime bench model`` times under the same name: forward + backward of
``rows = tokens_per_batch // T`` random rows, gradient clipping, fused AdamW, ``zero_grad``, under bf16 autocast on
CUDA.  A plain ``<preset>`` takes the step ``lintime train`` takes by default (:func:`lintime.bench.model.default_step`:
on CUDA the packed documents step captured in one CUDA graph, ``graph-documents``, where the model allows it);
``<preset>@eager`` the eager step on packed documents (``--compile off``); ``<preset>@graph`` the captured step on
``[rows, T]`` rows, one document each (``--compile graph --packing rows``); anchor presets (``hf:llama-base``,
``fla:gla-base``) their library's eager step.  Captured steps run in
:class:`lintime.training.graphed.GraphedStep`.  For each preset and ``T``: ``--warmup`` untimed
steps, ``--steps`` steps timed without the profiler (wall time, device synchronised: ``step ms``), then the same
number of steps under torch.profiler (with Python stacks).  Every device kernel is put in one category by the
names of the PyTorch ops that launched it, the Python functions they ran in, and the kernel's own name
(:func:`categorize`, first rule that matches):

* optimizer -- ``Optimizer.step`` / ``zero_grad`` and the ``_foreach_*`` ops of gradient clipping;
* loss -- cross-entropy (``log_softmax``, ``nll_loss``; lintime's fused linear + cross-entropy, which includes
  its output-projection GEMMs);
* quantisation -- Transformer-VQ's codebook work in the layer's forward (``VQAttention.codebook`` / ``quantize`` /
  ``commit_loss`` / ``update_codebook``: the distance GEMM, argmin, codeword gather, straight-through, commitment
  loss, EMA statistics), by the ``vq_quantisation`` profiler range the layer opens around it while a profiler
  runs (the Python-stack rule on the same functions is kept for traces without the range: on CUDA the profiler's
  stacks did not reach the kernels); its backward (a few elementwise passes over the keys) stays in elementwise;
* attention op -- the mixer's core op: lintime's attention custom ops (mixed chunk, GAU, linear, GLA, VQ with the
  PyTorch glue of ``lintime/ops/vq``: block layout, per-code sums, cache einsums), PyTorch's scaled-dot-product
  attention kernels, fla's chunk / recurrent kernels;
* norms -- LayerNorm / RMSNorm / GroupNorm, forward and backward;
* GEMMs -- matrix products (``mm``, ``addmm``, ``bmm``, ``matmul``, ``linear``; cuBLAS / CUTLASS kernels);
* elementwise -- everything else on the device: activations, gates, RoPE, casts, copies, fills, reductions;
* host gaps / idle -- ``step ms`` minus the time the device was busy (the union of the kernels' intervals): the
  GPU waiting for the host (Python, dispatch, launches) and for syncs.

A replayed graph launches its kernels without the ops: the profiler records them (CUPTI traces graph kernels) but
links none to an op or a Python frame.  So a captured row first profiles the graph's body run eagerly on a second
copy of the model (``GraphedStep(capture=False)``: the same kernels), and splits each replayed kernel's time over
the categories in the proportions that kernel's name had there (exact for a name used by one category); a kernel
name the eager body did not run is categorised by its name alone.  Where the replay's trace holds no kernels the
row carries the eager body's breakdown and says so in ``note``.

On CPU (``--device cpu``: a check of the tool, not a measurement worth reading) the "device" is the CPU: each
PyTorch op's own CPU time is categorised the same way, and host gaps are the profiled steps' time outside any op
(Python).  Prints one table and writes ``<out>/profile_step.json``: ``{"env", "settings", "rows": [{"preset", "T",
"rows", "tokens", "status", "step_ms", "profiled_step_ms", "basis_ms", "busy_ms", "categories": {name: ms per
step}, "top": [[kernel, ms per step, category], ...]}]}`` (``basis_ms``: the wall time the gaps are taken from).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import time

import torch

CATEGORIES = ("GEMMs", "attention op", "quantisation", "elementwise", "norms", "loss", "optimizer", "host gaps / idle")

# (category, substrings of a normalised frame: lower case, no underscores); first matching rule wins
_RULES = (
    ("optimizer", ("optimizer.", "foreach", "fusedadam")),
    ("loss", ("crossentropy", "nllloss", "logsoftmax", "cerowskernel")),
    ("attention op", ("lintime::mixedchunk", "lintime::gaufwd", "lintime::gaubwd", "lintime::linearattention",
                      "lintime::gla", "scaleddotproduct", "flashattention", "efficientattention", "cudnnattention",
                      "flashattn", "chunkgla", "chunklinearattn", "chunkfwdkernel", "chunkbwdkernel",
                      "chunklocalcumsum", "fusedrecurrent",
                      # lintime's attention kernels by name (for kernels the profiler leaves unlinked)
                      "mcgemmkernel", "mcdqkkernel", "mcdredkernel", "chunkstatekernel", "foldbiaskernel",
                      "segfixkernel", "segscankernel", "segsummarykernel", "slabfwd", "slabbwd", "relu2fwd",
                      "relu2bwd", "glafwd", "glabwd", "glarecurrent", "glasegsummary", "linearfwdkernel",
                      "linearbwd", "linearrecurrent",
                      # Transformer-VQ: the custom ops, their eager autograd nodes, the kernels
                      "lintime::vq", "eagervq", "vqprobskernel", "vqpvkernel", "vqdpkernel", "vqdeltakernel",
                      "vqbwdkeykernel",
                      "vqscanfwdkernel", "vqscanbwdkernel")),
    ("norms", ("layernorm", "rmsnorm", "groupnorm", "lintime::normalize", "lintime::addnorm", "normfwdkernel",
               "normbwdkernel", "addnormfwd", "addnormbwd")),
    ("GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
               "aten::scaledmm", "mmbackward", "gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma")),
)


# (category, pattern of a Python frame "path(line): function"), tried after the optimizer and loss rules (a
# frame of these functions is inside the step's forward, never inside the optimizer or the loss)
_PY_RULES = (
    ("quantisation", re.compile(r"lintime/layers/vq\.py\(\d+\): (codebook|quantize|commit_loss|update_codebook)$")),
    ("attention op", re.compile(r"lintime/ops/vq/")),
)
# profiler ranges (``torch.profiler.record_function``) that name a category, tried with the Python rules
_RANGES = (("quantisation", ("vqquantisation",)),)
_PY_FRAME = re.compile(r"^(<built-in |nn\.Module: |.*\(\d+\): )")  # what the profiler's Python tracer records


def _norm(frame: str) -> str:
    return frame.lower().replace("_", "")


def categorize(frames, py=()) -> str:
    """The category of one piece of device time, from its frames: the names of the PyTorch ops (and
    autograd nodes / profiler annotations) that enclose it, outermost first, then the kernel's (or the
    op's) own name; ``py`` the Python frames it ran in (``"path(line): function"``).  ``elementwise`` when
    no rule matches."""
    normed = [_norm(f) for f in frames]

    def ops_match(needles):
        return any(n in f for f in normed for n in needles)

    for category, needles in _RULES[:2]:  # optimizer, loss
        if ops_match(needles):
            return category
    for category, needles in _RANGES:
        if ops_match(needles):
            return category
    for category, pattern in _PY_RULES:
        if any(pattern.search(f) for f in py):
            return category
    for category, needles in _RULES[2:]:
        if ops_match(needles):
            return category
    return "elementwise"


@dataclasses.dataclass
class Piece:
    """Device time of one kernel launch (CUDA) or one op's own time (CPU), with its frames (op names, then
    the kernel's) and Python frames; ``category`` set when it was decided elsewhere (a replayed kernel)."""

    frames: tuple[str, ...]
    us: float
    py: tuple[str, ...] = ()
    category: str | None = None

    def cat(self) -> str:
        return self.category or categorize(self.frames, self.py)


def _is_py(name: str) -> bool:
    return bool(_PY_FRAME.match(name))


def _chain(evt) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(ops, py)``: the names enclosing ``evt`` (itself included), outermost first, split into PyTorch ops /
    annotations and the Python tracer's frames."""
    names = []
    while evt is not None:
        names.append(evt.name)
        evt = evt.cpu_parent
    names.reverse()
    return tuple(n for n in names if not _is_py(n)), tuple(n for n in names if _is_py(n))


def _stack(evt) -> tuple[str, ...]:
    return _chain(evt)[0]


def _union_us(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def pieces_of(prof, device: torch.device) -> tuple[list[Piece], float]:
    """``(pieces, busy_us)`` of a finished profile: on CUDA every kernel with the stack of the op that
    launched it, and the union of the kernels' intervals; the kernel time of a name that the profiler
    did not link to ops (all of a replayed graph's) is one piece by that name.  On CPU every op's own
    time with its stack (the Python tracer's frames are not ops), and their sum."""
    from torch.autograd import DeviceType

    events = prof.events()
    if device.type != "cuda":
        pieces = []
        for e in events:
            if e.device_type == DeviceType.CPU and e.self_cpu_time_total > 0 and not _is_py(e.name):
                ops, py = _chain(e)
                pieces.append(Piece(ops, e.self_cpu_time_total, py))
        return pieces, sum(p.us for p in pieces)
    linked = []
    for e in events:
        if e.device_type == DeviceType.CPU and e.kernels:
            ops, py = _chain(e)
            linked += [Piece(ops + (k.name,), k.duration, py) for k in e.kernels]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    left = collections.Counter()  # kernel time per name not linked to an op
    for e in kernels:
        left[e.name] += e.time_range.elapsed_us()
    for p in linked:
        left[p.frames[-1]] -= p.us
    pieces = linked + [Piece((name,), us) for name, us in left.items() if us > 0]
    device_us = sum(e.time_range.elapsed_us() for e in kernels)
    if device_us and sum(p.us for p in linked) < 0.9 * device_us:
        print(f"note: {sum(p.us for p in linked) / device_us:.0%} of the kernel time is linked to ops; "
              "the rest is categorised by kernel names", flush=True)
    busy = _union_us((e.time_range.start, e.time_range.end) for e in kernels) if kernels else sum(p.us for p in pieces)
    return pieces, busy


def replayed(pieces: list[Piece], reference: list[Piece]) -> list[Piece]:
    """The kernels of a replayed graph (``pieces``: one per kernel name, no op or Python frames) with their
    time split over the categories in the proportions their names had in ``reference`` (the same body run
    eagerly); a name the reference did not run keeps the category of its name."""
    shares: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for p in reference:
        shares[p.frames[-1]][p.cat()] += p.us
    out = []
    for p in pieces:
        name, share = p.frames[-1], shares.get(p.frames[-1])
        total = sum(share.values()) if share else 0.0
        if not total:
            out.append(p)
            continue
        out += [Piece((name,), p.us * us / total, category=cat) for cat, us in share.items() if us > 0]
    return out


def breakdown(pieces: list[Piece], busy_us: float, step_ms: float, steps: int) -> dict:
    """Milliseconds per step of every category (:data:`CATEGORIES`); ``host gaps / idle`` is
    ``step_ms`` minus the busy time per step (never negative)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for p in pieces:
        out[p.cat()] += p.us / 1e3 / steps
    out["host gaps / idle"] = max(0.0, step_ms - busy_us / 1e3 / steps)
    return out


def top_kernels(pieces: list[Piece], steps: int, n: int = 20) -> list[list]:
    """The ``n`` largest kernels (CUDA) or ops (CPU) by time per step: ``[name, ms, category]`` (one
    entry per name and category: an ``mm`` inside the fused loss is not the projections' ``mm``)."""
    acc: dict[tuple[str, str], list] = {}
    for p in pieces:
        cat = p.cat()
        row = acc.setdefault((p.frames[-1], cat), [p.frames[-1], 0.0, cat])
        row[1] += p.us / 1e3 / steps
    return sorted(acc.values(), key=lambda r: -r[1])[:n]


def _profile(step, steps: int, device: torch.device):
    """``(prof, wall ms per step)`` of ``steps`` calls of ``step`` under torch.profiler (CPU + CUDA activities,
    Python stacks: the quantisation rule reads the layer's function names)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities, with_stack=True) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3 / steps
    return prof, ms


def _graph_reference(cfg, batch, args, device: torch.device, amp, documents: bool = False) -> list[Piece]:
    """Pieces of the graph step's body run eagerly (``GraphedStep(capture=False)``, the same kernels a replay
    launches) on a fresh copy of the model, ``args.steps`` steps after ``args.warmup`` (at least one)."""
    from lintime.bench import model as bm
    from lintime.training.graphed import GraphedStep

    torch.manual_seed(0)
    model = bm.build_model(cfg, device).train()
    rows, T = batch.input_ids.shape
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=bm.LR, **({"fused": True} if device.type == "cuda" else {}))
    body = GraphedStep(model, opt, rows=rows, context_len=T, clip=bm.CLIP, autocast=amp, capture=False,
                       doc_capacity=rows if documents else None)
    cu = batch.cu_seqlens if documents else None

    def step():
        body.step(batch.input_ids, batch.targets, bm.LR, cu_seqlens=cu)

    for _ in range(max(1, args.warmup)):
        step()
    prof, _ = _profile(step, args.steps, device)
    pieces, _ = pieces_of(prof, device)
    del body, opt, model, prof
    bm.free_memory(device)
    return pieces


def profile_case(name: str, T: int, args, device: torch.device, amp) -> dict:
    """One preset at one ``T``: wall time of the step, then its profile (see the module docstring)."""
    from lintime.bench import model as bm
    from lintime.bench.anchors import SkipPreset
    from lintime.bench.measure import call_times_ms, quantiles

    base, _, kind = name.partition("@")
    if kind not in ("", "graph", "eager"):
        raise SkipPreset(f"unknown step {kind!r} in {name!r} ('<preset>@graph' or '<preset>@eager')")
    if kind and bm.anchors.is_anchor(base):
        raise SkipPreset("the steps '@graph' / '@eager' are lintime's, not an anchor's")
    if kind == "graph" and device.type != "cuda":
        raise SkipPreset("the captured step is lintime's GraphedStep, on CUDA")
    rows = max(1, args.tokens_per_batch // T)
    cfg, _ = bm.preset_config(base, T, device)
    step_kind = kind or bm.default_step(cfg, device)  # a plain preset: what `lintime bench model` / train take
    row = {"preset": name, "T": T, "rows": rows, "tokens": rows * T, "status": "ok", "note": "", "step": step_kind}
    documents = step_kind != "graph"  # packed documents except on the rows layout of '@graph'
    batch = bm.random_batch(rows, T, cfg.vocab_size, device, documents=documents)
    captured = step_kind in ("graph", "graph-documents")
    reference = _graph_reference(cfg, batch, args, device, amp, documents=documents) if captured else None
    torch.manual_seed(0)
    model = bm.build_model(cfg, device).train()
    if captured:
        step, _ = bm.graph_step_fn(model, batch, amp, documents=documents)
    else:
        step, _ = bm.train_step_fn(model, batch, amp)
    for _ in range(args.warmup):
        step()
    row["step_ms"] = quantiles(call_times_ms(step, args.steps, device))["median"]
    prof, row["profiled_step_ms"] = _profile(step, args.steps, device)
    pieces, busy = pieces_of(prof, device)
    if reference is not None:
        if pieces:
            pieces = replayed(pieces, reference)
        else:
            row["note"] = "the replay's trace holds no kernels: categories and busy time of the eager body"
            pieces = reference
            busy = sum(p.us for p in reference)  # an upper bound of the body's busy time (overlaps counted twice)
    row["busy_ms"] = busy / 1e3 / args.steps
    # the GPU's kernel times are what they are under the profiler, so the gaps are taken against the
    # step's own wall time; on CPU the profiler inflates every op's time, so against the profiled steps'
    row["basis_ms"] = row["step_ms"] if device.type == "cuda" else row["profiled_step_ms"]
    row["categories"] = breakdown(pieces, busy, row["basis_ms"], args.steps)
    row["top"] = top_kernels(pieces, args.steps, args.top)
    return row


_SHORT = {"GEMMs": "GEMMs", "attention op": "attention", "quantisation": "quantisation", "elementwise": "elementwise",
          "norms": "norms", "loss": "loss", "optimizer": "optimizer", "host gaps / idle": "host gaps"}


def table(rows: list[dict]) -> str:
    head = f"{'preset':<20} {'T':>6} {'step ms':>9} " + " ".join(f"{_SHORT[c]:>13}" for c in CATEGORIES)
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['preset']:<20} {r['T']:>6} {'-':>9}  {r['status']}")
            continue
        cells = " ".join(f"{r['categories'][c]:8.1f} {100 * r['categories'][c] / r['basis_ms']:3.0f}%"
                         for c in CATEGORIES)
        lines.append(f"{r['preset']:<20} {r['T']:>6} {r['step_ms']:9.1f} {cells}")
    return "\n".join(lines) + "\n(ms per step, and % of the step's wall time -- on CPU of the profiled steps' wall time)"


def main(argv=None) -> list[dict]:
    from lintime.bench import model as bm
    from lintime.bench.anchors import SkipPreset
    from lintime.bench.measure import environment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="flash-base,gla-base,transformer-pp-base")
    ap.add_argument("--contexts", default="2k,8k,32k", help="training contexts T, e.g. 2k,8k,32k")
    ap.add_argument("--tokens-per-batch", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3, help="timed steps, and profiled steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="autocast: auto (bf16 on CUDA, none on CPU), bf16, fp16, fp32")
    ap.add_argument("--out", default="profile_step_out")
    ap.add_argument("--top", type=int, default=20, help="kernels listed per row in the JSON (largest first)")
    args = ap.parse_args(argv)
    s = bm.make_settings(presets=args.presets, contexts=args.contexts, tokens_per_batch=args.tokens_per_batch,
                         steps=args.steps, warmup=args.warmup, dtype=args.dtype, device=args.device, parts="train")
    device = torch.device(s.device)
    amp = bm.autocast_for(s.dtype, device)
    os.makedirs(args.out, exist_ok=True)
    result = {"env": environment(peaks=False, device=device), "settings": vars(args), "rows": []}
    path = os.path.join(args.out, "profile_step.json")
    for name in s.presets:
        for T in s.contexts:
            t0 = time.time()
            try:
                row = profile_case(name, T, args, device, amp)
            except Exception as e:  # noqa: BLE001 - one failing case must not end the run
                status = "OOM" if bm.is_oom(e) else (f"skipped: {e}" if isinstance(e, SkipPreset) else
                                                      f"error: {bm.one_line(e)}")
                row = {"preset": name, "T": T, "status": status}
            bm.free_memory(device)
            result["rows"].append(row)
            print(table([row]).splitlines()[2], f"({time.time() - t0:.0f} s)", flush=True)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
    print(table(result["rows"]))
    print(f"wrote {path}")
    return result["rows"]


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
