"""Where the device time of one decoding step goes: per-kernel time per generated token of the CUDA-graph step that
``lintime bench model``'s ``graph`` decode rows time, for given presets at given contexts.

    python3 benchmarks/profile_decode.py --presets vq-base,flash-base,gla-base --contexts 4k,32k \
        [--batch 1] [--replays 50] [--eager-steps 3] [--device cuda] [--dtype auto] [--out profile_decode_out]

The model and the step are the decode rows' (:mod:`lintime.bench.decode`): random init, eval, fp32 weights under
bf16 autocast on CUDA; a fresh random ``L``-token prompt prefilled by :class:`lintime.bench.decode.Prompts` (one
prompt, replicated to ``--batch`` rows); its state copied into a
:class:`~lintime.generation.static.StaticDecoder` and one greedy step captured by
:class:`~lintime.generation.graphs.DecodeLoop`.  For each preset and ``L``, in this order:

1. **graph** (CUDA) -- after the capture and ``GRAPH_WARMUP`` replays, ``--replays`` replays timed one by one between
   two device synchronisations (``token_ms``: the decode rows' number), ``--replays`` back to back with one
   synchronisation (``b2b_token_ms``), then ``--replays`` under torch.profiler (CUDA kernels);
2. **eager** -- the same step run eagerly (``DecodeLoop(graph=False)`` over its own decoder: the kernels a capture
   records), one untimed step, ``--eager-steps`` timed, then as many under torch.profiler: ms per token, kernels per
   token, the PyTorch ops by self CPU time (``cpu_ops``: the host work that the graph removes), and each kernel's
   categories from the ops that launched it.  A replay's kernels link to no op, so each kernel name's time in the
   graph profile is split over the categories in the proportions that name had here; a name the eager step did
   not run is categorised by its name alone.

Two breakdowns of the time per token, each summing to the row's ``basis_ms`` (``token_ms`` on CUDA):

* ``categories`` -- ``benchmarks/profile_step.py``'s (:func:`profile_step.categorize`: GEMMs, attention op,
  quantisation, elementwise, norms, ...);
* ``groups`` -- this step's split (:data:`GROUPS`, first rule that matches the kernel's name or an op enclosing it):
  ``vq decode`` (the fused step's ``vq_decode_*`` kernels), ``vq quantize`` (``vq_quantize*``, or anything in the
  layer's ``vq_quantisation`` profiler range), ``mixer kernels`` (the other families' attention / recurrent
  kernels and ops), ``casts / copies`` (dtype casts -- the autocast casts of fp32 weights included -- copies,
  fills, memsets), ``GEMMs`` (cuBLAS / CUTLASS / nvjet, GEMV), ``norms``, ``elementwise`` (the rest);

and in both ``host gaps / idle`` = ``basis_ms`` minus the busy time (the union of the kernels' intervals).  On CUDA
the graph row also gives ``span_us``: the median time from a replay's first kernel start to its last kernel end
(``span_us - busy_us``: the device idle between the graph's kernels; ``token_ms - span_us``: launch, sync and host).

``--device cpu`` checks the tool (no measurement worth reading): no CUDA graphs, so the row is the eager step
(``path: eager``, said in its ``note``), the "device" is the CPU, each PyTorch op's own CPU time is a piece,
``busy_us`` their sum and ``basis_ms`` the profiled steps' wall time (the profiler inflates every op's time).

Prints one summary table, the top kernels and the eager step's top CPU ops per case, and writes
``<out>/profile_decode.json``: ``{"env", "settings", "rows": [{"preset", "L", "batch", "path", "status", "note",
"layers", "params", "state_mib", "token_ms", "token_p10_ms", "token_p90_ms", "b2b_token_ms", "profiled_token_ms",
"basis_ms", "busy_us", "kernel_us", "launches_per_token", "span_us", "categories": {name: us per token},
"groups": {name: us per token}, "kernels": [{"name", "calls", "us", "group", "category"}, ...] (per token, largest
first), "eager": {"token_ms", "profiled_token_ms", "busy_us", "kernel_us", "launches_per_token", "categories",
"groups", "kernels", "cpu_ops": [{"name", "calls", "self_us"}, ...] (per token, top ``--top``)}}]}`` (``calls``:
kernel launches per token -- on CPU op calls; ``kernel_us``: the pieces' sum, ``busy_us`` on one stream).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import time
import traceback

import torch


def _load_profile_step():
    """``benchmarks/profile_step.py`` (a script, not a package module: loaded by path)."""
    if "profile_step" in sys.modules:
        return sys.modules["profile_step"]
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profile_step.py")
    spec = importlib.util.spec_from_file_location("profile_step", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks the module up
    spec.loader.exec_module(mod)
    return mod


ps = _load_profile_step()

GAPS = "host gaps / idle"
GROUPS = ("vq decode", "vq quantize", "mixer kernels", "casts / copies", "GEMMs", "norms", "elementwise", GAPS)


def _needles(category: str) -> tuple[str, ...]:
    return next(n for c, n in ps._RULES if c == category)


# (group, substrings of a normalised frame (profile_step._norm: lower case, no underscores), normalised op names
# matched whole); first matching rule wins.  Casts come before GEMMs: autocast's weight casts run inside aten::linear.
_GROUP_RULES = (
    ("vq decode", ("vqdecode",), ()),
    ("vq quantize", ("vqquantize", "vqquantisation"), ()),
    ("mixer kernels", _needles("attention op") + ("decodescoreskernel", "decodevalueskernel", "decodeadvancekernel"),
     ()),
    ("casts / copies", ("memcpy", "memset", "copykernel", "fillfunctor"),
     ("aten::to", "aten::tocopy", "aten::copy", "aten::clone", "aten::contiguous", "aten::fill", "aten::zero",
      "aten::indexcopy")),
    ("GEMMs", _needles("GEMMs") + ("gemv", "splitkreduce"), ()),
    ("norms", _needles("norms"), ()),
)


def group_of(frames) -> str:
    """The :data:`GROUPS` entry of one piece of time from its frames (the enclosing op names outermost first, then
    the kernel's or op's own name); ``elementwise`` when no rule matches."""
    normed = [ps._norm(f) for f in frames]
    for group, needles, whole in _GROUP_RULES:
        if any(n in f for f in normed for n in needles) or any(f in whole for f in normed):
            return group
    return "elementwise"


def _classify(frames) -> tuple[str, str]:
    return ps.categorize(frames), group_of(frames)


class Profile:
    """The kernels (CUDA) or ops (CPU) of ``steps`` profiled steps: per name the launches, the time and its split
    over ``(category, group)`` pairs, and the busy time (all totals over the steps)."""

    def __init__(self, steps: int):
        self.steps = steps
        self.calls: collections.Counter = collections.Counter()
        self.us: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # name -> (cat, grp)
        self.busy_us = 0.0

    def add(self, name: str, key: tuple[str, str], us: float, calls: int = 0) -> None:
        self.us[name][key] += us
        self.calls[name] += calls

    def split(self, name: str) -> dict[tuple[str, str], float]:
        """Fractions of ``name``'s time per ``(category, group)``; empty for a name this profile did not run."""
        share = self.us.get(name)
        total = sum(share.values()) if share else 0.0
        return {k: v / total for k, v in share.items()} if total > 0 else {}

    def kernel_us(self) -> float:
        return sum(sum(c.values()) for c in self.us.values())

    def summary(self, basis_ms: float, top: int | None = None) -> dict:
        """Per token (``steps``): busy / kernel time, launches, the two breakdowns (gaps against ``basis_ms``), and
        every name's calls and time with its largest category and group."""
        n = self.steps
        cats, groups = dict.fromkeys(ps.CATEGORIES, 0.0), dict.fromkeys(GROUPS, 0.0)
        kernels = []
        for name, share in self.us.items():
            for (cat, grp), us in share.items():
                cats[cat] = cats.get(cat, 0.0) + us / n
                groups[grp] += us / n
            by_cat, by_grp = collections.Counter(), collections.Counter()
            for (cat, grp), us in share.items():
                by_cat[cat] += us
                by_grp[grp] += us
            kernels.append({"name": name, "calls": self.calls[name] / n, "us": sum(share.values()) / n,
                            "group": by_grp.most_common(1)[0][0], "category": by_cat.most_common(1)[0][0]})
        kernels.sort(key=lambda k: -k["us"])
        busy = self.busy_us / n
        cats[GAPS] = groups[GAPS] = max(0.0, basis_ms * 1e3 - busy)
        return {"busy_us": busy, "kernel_us": self.kernel_us() / n, "launches_per_token": sum(self.calls.values()) / n,
                "categories": cats, "groups": groups, "kernels": kernels[:top] if top else kernels}


def _kernel_events(prof) -> list:
    from torch.autograd import DeviceType

    return sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)


def _profile(fn, steps: int, device: torch.device):
    """``(prof, wall ms per step)`` of ``steps`` calls of ``fn`` under torch.profiler (CPU ops, and CUDA kernels on
    CUDA; no Python stacks: they would inflate the host times that ``cpu_ops`` reports), the device synchronised
    after each call like the timed steps."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
            if cuda:
                torch.cuda.synchronize(device)
        ms = (time.perf_counter() - t0) * 1e3 / steps
    return prof, ms


def eager_profile(prof, steps: int, device: torch.device) -> Profile:
    """The eager step's pieces (:func:`profile_step.pieces_of`: on CUDA each kernel with the ops that launched it,
    on CPU each op's own time), classified by those frames; launches counted from the kernel events (CUDA) or the
    pieces (CPU)."""
    out = Profile(steps)
    pieces, out.busy_us = ps.pieces_of(prof, device)
    for p in pieces:
        out.add(p.frames[-1], _classify(p.frames), p.us, calls=0 if device.type == "cuda" else 1)
    if device.type == "cuda":
        out.calls.update(e.name for e in _kernel_events(prof))
    return out


def cpu_ops(prof, steps: int, top: int) -> list[dict]:
    """The ``top`` PyTorch ops (and CUDA runtime calls) by self CPU time per step; without the profiler's own
    ``cudaDeviceSynchronize`` after each step (the host waiting for the device, not host work: a synchronisation
    inside the step shows as ``cudaStreamSynchronize`` or a copy to the host)."""
    rows = sorted((a for a in prof.key_averages() if a.key != "cudaDeviceSynchronize" and a.self_cpu_time_total > 0),
                  key=lambda a: -a.self_cpu_time_total)
    return [{"name": a.key, "calls": a.count / steps, "self_us": a.self_cpu_time_total / steps} for a in rows[:top]]


def replay_profile(prof, steps: int, reference: Profile) -> tuple[Profile, list[float]]:
    """The replays' kernels, each name's time split as in ``reference`` (the eager step), else by its name; and the
    span of each replay (first kernel start to last kernel end, us; empty when the kernels do not divide evenly
    into ``steps`` replays)."""
    out = Profile(steps)
    kernels = _kernel_events(prof)
    for e in kernels:
        us = e.time_range.elapsed_us()
        share = reference.split(e.name) or {_classify((e.name,)): 1.0}
        for key, frac in share.items():
            out.add(e.name, key, us * frac)
        out.calls[e.name] += 1
    out.busy_us = ps._union_us((e.time_range.start, e.time_range.end) for e in kernels) if kernels else 0.0
    spans = []
    if kernels and len(kernels) % steps == 0:
        k = len(kernels) // steps
        for i in range(steps):
            part = kernels[i * k:(i + 1) * k]
            spans.append(max(e.time_range.end for e in part) - part[0].time_range.start)
    return out, spans


def _median(xs: list[float]) -> float:
    from lintime.bench.measure import quantiles

    return quantiles(xs)["median"]


def _graph_part(model, logits, start, L: int, args, device: torch.device, amp) -> tuple[dict, object, float]:
    """The graph step (CUDA): capture, ``--replays`` timed one by one, as many back to back, as many profiled.
    Returns the row's timing fields, the profile and the state's MiB per sequence."""
    from lintime.bench.anchors import autocast
    from lintime.bench.decode import GRAPH_WARMUP
    from lintime.bench.measure import call_times_ms, quantiles
    from lintime.generation.graphs import DecodeLoop
    from lintime.generation.static import StaticDecoder

    steps = GRAPH_WARMUP + 3 * args.replays
    seeds = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
    with torch.no_grad(), autocast(device, amp):
        dec = StaticDecoder(model, start, L + steps + 1)
        loop = DecodeLoop(dec, logits, seeds, steps, graph=True, temperature=0.0)  # a capture failure: the row's error
        for _ in range(GRAPH_WARMUP):
            loop.advance()
    q = quantiles(call_times_ms(loop.advance, args.replays, device))
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.replays):
        loop.advance()
    torch.cuda.synchronize(device)
    b2b = (time.perf_counter() - t0) * 1e3 / args.replays
    prof, profiled_ms = _profile(loop.advance, args.replays, device)
    fields = {"token_ms": q["median"], "token_p10_ms": q["p10"], "token_p90_ms": q["p90"], "b2b_token_ms": b2b,
              "profiled_token_ms": profiled_ms, "basis_ms": q["median"]}
    return fields, prof, _state_mib(dec)


def _eager_part(model, logits, start, L: int, args, device: torch.device, amp):
    """The same step run eagerly (``DecodeLoop(graph=False)`` over its own decoder): one untimed step, ``timed``
    timed, ``--eager-steps`` profiled.  Returns the step times, the profile, its wall ms per step and the state's MiB
    per sequence."""
    from lintime.bench.anchors import autocast
    from lintime.bench.measure import call_times_ms
    from lintime.generation.graphs import DecodeLoop
    from lintime.generation.static import StaticDecoder

    timed = args.eager_steps if device.type == "cuda" else args.replays  # on CPU the eager step is the row
    steps = 1 + timed + args.eager_steps
    seeds = torch.zeros(logits.shape[0], dtype=torch.long, device=device)
    with torch.no_grad(), autocast(device, amp):
        dec = StaticDecoder(model, start, L + steps + 1)
        loop = DecodeLoop(dec, logits, seeds, steps, graph=False, temperature=0.0)

    def step() -> None:
        with torch.no_grad(), autocast(device, amp):
            loop.advance()

    step()  # untimed: first-call compilation and the layers' memos
    times = call_times_ms(step, timed, device)
    prof, profiled_ms = _profile(step, args.eager_steps, device)
    return times, prof, profiled_ms, _state_mib(dec)


def _state_mib(dec) -> float:
    """The decoder's buffers per sequence (a KV cache at its capacity)."""
    return sum(t.numel() * t.element_size() for t in dec.buffers()) / dec.batch_size / 2**20


def fed_tokens(args) -> int:
    """The most tokens a case feeds past its prompt (a decoder's capacity; a learned position table's length)."""
    from lintime.bench.decode import GRAPH_WARMUP

    return max(GRAPH_WARMUP + 3 * args.replays, 1 + 2 * args.eager_steps + args.replays)


def profile_case(name: str, prompts, model, cfg, L: int, args, device: torch.device) -> dict:
    """One preset at one context: prefill, the graph step (CUDA), the eager step (see the module docstring).  The
    graph is timed first, before this case's profiler runs."""
    from lintime.bench import common
    from lintime.bench.measure import quantiles

    cuda = device.type == "cuda"
    row = {"preset": name, "L": L, "batch": args.batch, "path": "graph" if cuda else "eager", "status": "ok",
           "note": "" if cuda else "CPU: no CUDA graphs; the eager step (DecodeLoop.body over a StaticDecoder)",
           "layers": cfg.n_layers, "params": common.num_parameters(model)}
    row.update(prompts.prefill(L))
    logits, start = prompts.rows(args.batch)
    graph_prof = None
    if cuda:
        fields, graph_prof, row["state_mib"] = _graph_part(model, logits, start, L, args, device, prompts.amp)
        row.update(fields)
        common.free_memory(device)
    times, prof, profiled_ms, mib = _eager_part(model, logits, start, L, args, device, prompts.amp)
    if not cuda:  # else the graph's buffers (a KV cache at its larger capacity)
        row["state_mib"] = mib
    del logits, start
    eager_ms = quantiles(times)["median"]
    eager = eager_profile(prof, args.eager_steps, device)
    row["eager"] = {"token_ms": eager_ms, "profiled_token_ms": profiled_ms,
                    **eager.summary(eager_ms if cuda else profiled_ms, args.kernels),
                    "cpu_ops": cpu_ops(prof, args.eager_steps, args.top)}
    del prof
    if not cuda:  # the eager step is the row
        q = quantiles(times)
        row.update(token_ms=q["median"], token_p10_ms=q["p10"], token_p90_ms=q["p90"], b2b_token_ms=None,
                   profiled_token_ms=profiled_ms, basis_ms=profiled_ms, span_us=None)
        row.update({k: row["eager"][k] for k in ("busy_us", "kernel_us", "launches_per_token", "categories",
                                                  "groups", "kernels")})
        return row
    graph, spans = replay_profile(graph_prof, args.replays, eager)
    row["span_us"] = _median(spans) if spans else None
    if not graph.calls:  # CUPTI recorded none of the graph's kernels: the eager step's, said so
        row["note"] = "the replays' trace holds no kernels: breakdown of the eager step's kernels"
        graph = eager
    row.update(graph.summary(row["basis_ms"], args.kernels))
    return row


_SHORT = {"vq decode": "vq dec", "vq quantize": "vq quant", "mixer kernels": "mixer", "casts / copies": "casts",
          "GEMMs": "GEMMs", "norms": "norms", "elementwise": "elemwise", GAPS: "gaps"}


def table(rows: list[dict]) -> str:
    """One line per case: ms per token (timed, back to back, eager), launches and busy us per token, the groups."""
    head = (f"{'preset':<14} {'L':>7} {'path':>5} {'ms/tok':>7} {'b2b':>6} {'eager':>7} {'launch':>6} {'busy':>6} "
            + " ".join(f"{_SHORT[g]:>8}" for g in GROUPS))
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['preset']:<14} {r['L']:>7}  {r['status']}")
            continue
        b2b = "-" if r["b2b_token_ms"] is None else f"{r['b2b_token_ms']:.3f}"
        lines.append(f"{r['preset']:<14} {r['L']:>7} {r['path']:>5} {r['token_ms']:7.3f} {b2b:>6} "
                     f"{r['eager']['token_ms']:7.2f} {r['launches_per_token']:6.0f} {r['busy_us']:6.0f} "
                     + " ".join(f"{r['groups'][g]:8.1f}" for g in GROUPS))
    return "\n".join(lines) + ("\n(ms per token; launches: kernels per token (CPU: ops); busy and the groups: us per "
                               "token, device time -- on CPU op self time)")


def details(r: dict, top: int) -> str:
    """A case's top kernels (per token) and its eager step's top ops by self CPU time (on CPU these are the row's
    pieces: listed once)."""
    out = [f"\n== {r['preset']} L={r['L']} B={r['batch']} ({r['path']}{'; ' + r['note'] if r['note'] else ''}): "
           f"{r['token_ms']:.3f} ms/token, {r['launches_per_token']:.0f} launches, busy {r['busy_us']:.0f} us"
           + (f", span {r['span_us']:.0f} us" if r.get("span_us") else "")]
    if r["path"] != "eager":
        out.append(f"   {'us/tok':>8} {'calls':>6}  {'group':<14} kernel")
        out += [f"   {k['us']:8.1f} {k['calls']:6.1f}  {k['group']:<14} {k['name'][:100]}" for k in r["kernels"][:top]]
    out.append(f"   eager step: {r['eager']['token_ms']:.2f} ms/token, {r['eager']['launches_per_token']:.0f} "
               f"launches; top ops by self CPU us per token:")
    out += [f"   {o['self_us']:8.1f} {o['calls']:6.1f}  {o['name'][:100]}" for o in r["eager"]["cpu_ops"]]
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    from lintime.bench import common
    from lintime.bench import model as bm
    from lintime.bench.anchors import SkipPreset, is_anchor
    from lintime.bench.decode import Prompts
    from lintime.bench.measure import environment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="vq-base,flash-base,gla-base", help="lintime presets (anchors are skipped)")
    ap.add_argument("--contexts", default="4k,32k", help="prompt lengths L before the profiled steps, e.g. 4k,32k")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (one prompt replicated)")
    ap.add_argument("--replays", type=int, default=50, help="graph replays timed, back to back, and profiled (each)")
    ap.add_argument("--eager-steps", type=int, default=3, help="eager steps timed, and profiled")
    ap.add_argument("--top", type=int, default=15, help="kernels and CPU ops printed per case (CPU ops kept)")
    ap.add_argument("--kernels", type=int, default=60, help="kernels kept per case in the JSON, largest first (0: all)")
    ap.add_argument("--device", default="auto", help="auto (CUDA when available), cuda, cpu (a check: eager only)")
    ap.add_argument("--dtype", default="auto", help="autocast: auto (bf16 on CUDA, none on CPU), bf16, fp16, fp32")
    ap.add_argument("--out", default="profile_decode_out")
    args = ap.parse_args(argv)
    if min(args.batch, args.replays, args.eager_steps) < 1:
        ap.error("--batch, --replays and --eager-steps must be >= 1")
    s = bm.make_settings(presets=args.presets, contexts=args.contexts, decode_steps=args.replays,
                         decode_batch=args.batch, dtype=args.dtype, device=args.device, parts="decode")
    device = torch.device(s.device)
    amp = common.autocast_for(s.dtype, device)
    os.makedirs(args.out, exist_ok=True)
    result = {"env": environment(peaks=False, device=device), "settings": vars(args), "rows": []}
    path = os.path.join(args.out, "profile_decode.json")

    def emit(row: dict, t0: float) -> None:
        result["rows"].append(row)
        print(table([row]).splitlines()[2], f"({time.time() - t0:.0f} s)", flush=True)
        if row["status"] == "ok":
            print(details(row, args.top), flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    for name in s.presets:
        t0 = time.time()
        try:
            if is_anchor(name):
                raise SkipPreset("an anchor decodes through its library's generate (no static step to profile)")
            cfg, _ = common.preset_config(name, max(s.decode_contexts) + fed_tokens(args) + 1, device)
            torch.manual_seed(0)
            model = common.build_model(cfg, device).eval()
        except Exception as e:  # noqa: BLE001 - one failing preset must not end the run
            status = f"skipped: {e}" if isinstance(e, SkipPreset) else (
                "OOM" if common.is_oom(e) else f"error: {common.one_line(e)}")
            for L in s.decode_contexts:
                emit({"preset": name, "L": L, "batch": args.batch, "status": status}, t0)
            del e
            continue
        prompts = Prompts(model, cfg, s, device, amp)
        for L in s.decode_contexts:
            t0 = time.time()
            try:
                row = profile_case(name, prompts, model, cfg, L, args, device)
            except Exception as e:  # noqa: BLE001 - one failing case must not end the run
                row = {"preset": name, "L": L, "batch": args.batch,
                       "status": "OOM" if common.is_oom(e) else f"error: {common.one_line(e)}"}
                if not common.is_oom(e):
                    traceback.print_exc()  # the run is one call on a GPU machine: the whole story now
                del e
            prompts.state = prompts.logits = None
            common.free_memory(device)
            emit(row, t0)
        del model, prompts
        common.free_memory(device)
    print()
    print(table(result["rows"]))
    print(f"wrote {path}")
    return result["rows"]


if __name__ == "__main__":
    sys.exit(0 if all(r["status"] == "ok" for r in main()) else 1)
