"""HF ``generate`` with its static cache at the serve bench's batch: the anchor that ``serve_bench.py``'s rows are set
against (issue 44, item 6).  One transformers ``LlamaForCausalLM`` the size of ``transformer-pp-<size>`` (what
``lintime bench model``'s ``hf:llama-<size>`` anchor builds: width, layers, heads, MLP width, tied embeddings, SDPA
attention; ``--vocab-size`` to match a served run's vocabulary, e.g. 260 for lintime's byte tokenizer), in bf16 on
CUDA, is given ``--clients`` prompts of ``--prompt-tokens`` tokens at once and draws ``--new-tokens`` greedy tokens
for each, with no early stop (``min_new_tokens = max_new_tokens``, eos disabled).  Modes (``--modes``):

* ``static``: ``generate(..., cache_implementation="static", disable_compile=True)``: the static cache, eager forward;
* ``static+compile``: the same without ``disable_compile``: transformers compiles the one-token forward itself (its
  documented way: a static cache on CUDA triggers ``torch.compile`` with its default ``CompileConfig``, mode
  ``reduce-overhead``, i.e. CUDA graphs); the prefill stays eager, as in transformers;
* ``static-reused+compile``: one ``StaticCache`` made once and passed to every call (``reset()`` before each), so its
  tensors keep their addresses from call to call: ``cache_implementation="static"`` allocates a new cache per call,
  whose new addresses can make the CUDA graphs be recorded again in every call; ``static-reused``: the same, eager
  (not run by default).

Per mode: one untimed call of the whole load first (compilation, CUDA-graph recording, allocator; its wall time is
reported as ``warmup_s``), ``--rounds`` calls with ``max_new_tokens=1`` (``first_token_call_ms``: the prompt's
forward and the first token), then ``--rounds`` timed calls of the whole load.  A streamer stamps each step's tokens
when they are on the host (as a streaming server must have them): time to first token (call start -> first token),
the gaps between tokens, and the wall time of the call (device synchronised).  Output tokens/s = new tokens of all
rows / the timed calls' wall time.  Rows have the units and keys of ``serve_bench.py``'s (a static batch: every row of
a call gets its first token at the same time, so the time-to-first-token percentiles are over the calls).

    python3 benchmarks/hf_generate_bench.py --out $OUT --size base --clients 64 --prompt-tokens 512 \\
        --new-tokens 256 --vocab-size 260

``serve_bench.py --hf-anchor base`` runs it in the same run, after the served models, and puts its rows in the same
JSON and table.  Results: ``$OUT/hf_generate_bench.json`` and a table on stdout.  A mode that fails (a transformers
version whose API differs) is a ``failed: ...`` row, never an error for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

MODES = ("static", "static+compile", "static-reused", "static-reused+compile")
DEFAULT_MODES = ("static", "static+compile", "static-reused+compile")
# the serve bench's prompt (serve_bench.py): the same text, the same bytes for a byte-vocabulary run
PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. "


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_llama(size: str, vocab_size: int | None, max_tokens: int, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.nn.Module, dict]:
    """transformers' ``LlamaForCausalLM`` sized like ``transformer-pp-<size>`` (``lintime.bench.anchors``), its
    vocabulary ``vocab_size`` when given; random weights in ``dtype`` on ``device``, eval mode.  Returns the model and
    its record (library, class, sizes, parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lintime.bench.anchors import SkipPreset, anchor_spec

    try:
        spec = anchor_spec(f"hf:llama-{size}", max_tokens, device)
    except SkipPreset as err:
        raise SystemExit(f"hf_generate_bench: {err}") from None
    sizes = {k: v for k, v in spec.config.items() if k != "attn_implementation"}
    if vocab_size is not None:
        sizes["vocab_size"] = vocab_size
    with torch.device(device):
        model = LlamaForCausalLM._from_config(LlamaConfig(**sizes), attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).eval()
    record = {"impl": spec.impl, "model": spec.model_class, "size_of": f"transformer-pp-{size}",
              "config": {**sizes, "attn_implementation": "sdpa"}, "dtype": str(dtype).removeprefix("torch."),
              "params": sum(p.numel() for p in model.parameters())}
    return model, record


def make_prompts(kind: str, batch: int, prompt_tokens: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """``batch x prompt_tokens`` ids: ``text`` = the serve bench's prompt as lintime's byte tokenizer encodes it
    (``bos`` + UTF-8 bytes: the ids a byte-vocabulary server sees), every row the same; ``random`` = uniform ids."""
    if kind == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (batch, prompt_tokens), generator=g)
    from lintime.data import ByteTokenizer

    tok = ByteTokenizer()
    if vocab_size < tok.vocab_size:
        raise ValueError(f"--prompt text needs a vocabulary of at least {tok.vocab_size} ids (got {vocab_size})")
    text = (PROMPT_TEXT * (prompt_tokens // len(PROMPT_TEXT) + 1))[:prompt_tokens - 1]
    ids = [tok.bos_id, *tok.encode(text)]
    assert len(ids) == prompt_tokens, (len(ids), prompt_tokens)
    return torch.tensor([ids] * batch, dtype=torch.long)


def _streamer():
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        """Stamps every step's new tokens once they are on the host; the prompt (the 2-D first put) is not a
        token."""

        def __init__(self):
            self.times: list[float] = []
            self.counts: list[int] = []

        def put(self, value):
            value = value.cpu()  # waits for the step (generate usually hands over host tensors already)
            now = time.perf_counter()
            if value.dim() == 2:
                return
            self.times.append(now)
            self.counts.append(value.numel())

        def end(self):
            pass

    return Clock()


def _graphs() -> int:
    """Graphs compiled by dynamo in this process so far."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def bench_generate(model, prompts: torch.Tensor, new_tokens: int, mode: str, rounds: int = 2,
                   name: str = "hf:llama", compile_config=None) -> tuple[dict, torch.Tensor]:
    """Times ``model.generate`` on ``prompts`` (``B x P``, on the model's device) in ``mode`` (one of
    :data:`MODES`): an untimed warm-up call, ``rounds`` calls of one new token, ``rounds`` timed calls of
    ``new_tokens`` greedy tokens (eos disabled, no early stop).  Returns the row (``serve_bench.py``'s keys and units,
    ``rounds`` with every call's raw times) and the new tokens of the last timed call (``B x new_tokens``, CPU).

    ``compile_config``: a transformers ``CompileConfig`` for the ``+compile`` modes (default: generate's own); on a
    CPU transformers compiles only with ``CompileConfig._compile_all_devices`` set (a check of this code, not a
    measurement)."""
    from transformers import StaticCache

    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    device = prompts.device
    batch, prompt_len = prompts.shape
    compiled = mode.endswith("+compile")
    extra: dict = {}
    cache = None
    if mode.startswith("static-reused"):
        cache = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens)
    else:
        extra["cache_implementation"] = "static"
    if not compiled:
        extra["disable_compile"] = True
    elif compile_config is not None:
        extra["compile_config"] = compile_config
    # every call sizes its static cache for the whole load: generate keeps the longest length it has seen on the model
    # (so that the compiled step is not recompiled for a shorter one); start each mode from this load's length
    if hasattr(model, "_previous_max_cache_length"):
        model._previous_max_cache_length = -1

    def call(n: int, streamer=None) -> tuple[float, float, torch.Tensor]:
        kw = dict(extra)
        if cache is not None:
            cache.reset()
            kw["past_key_values"] = cache
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0, streamer=streamer, **kw)
        _sync(device)
        return t0, time.perf_counter() - t0, out[:, prompt_len:].cpu()

    g0 = _graphs()
    _, warmup_s, _ = call(new_tokens)
    g1 = _graphs()
    first_call = [call(1)[1] for _ in range(rounds)]
    timed = []
    for _ in range(rounds):
        clock = _streamer()
        t0, wall, new = call(new_tokens, clock)
        timed.append({"wall_s": wall, "ttft_s": clock.times[0] - t0 if clock.times else None,
                      "tokens": int(new.numel()), "tokens_per_row": int(new.shape[1]),
                      "streamed_tokens": sum(clock.counts),
                      "token_times_s": [round(t - t0, 6) for t in clock.times]})
    g2 = _graphs()
    wall = sum(r["wall_s"] for r in timed)
    tokens = sum(r["tokens"] for r in timed)
    ttft = [r["ttft_s"] for r in timed if r["ttft_s"] is not None for _ in range(batch)]
    gaps = [b - a for r in timed for a, b in zip(r["token_times_s"], r["token_times_s"][1:])]
    per_token = [(r["token_times_s"][-1] - r["token_times_s"][0]) / (len(r["token_times_s"]) - 1)
                 for r in timed if len(r["token_times_s"]) > 1]
    full = sum(r["tokens_per_row"] == new_tokens for r in timed) * batch
    row = {"model": name, "served_as": f"hf generate {mode}", "mode": mode, "status": "ok", "clients": batch,
           "requests": batch * rounds, "failed": 0, "finish": {"length": full, "stop": batch * rounds - full},
           "wall_s": round(wall, 3), "output_pieces": tokens, "pieces_per_s": round(tokens / wall, 1),
           "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
           "ttft_ms": {q: _ms(_quantile(ttft, v)) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
           "itl_ms": {q: _ms(_quantile(gaps, v)) for q, v in (("p50", .5), ("p99", .99))},
           "prompt_tokens": prompt_len, "new_tokens": new_tokens, "warmup_s": round(warmup_s, 3),
           "first_token_call_ms": _ms(statistics.median(first_call)),
           "decode_ms_per_token": _ms(statistics.fmean(per_token)) if per_token else None,
           "compiled": compiled, "dynamo_graphs": {"warmup": g1 - g0, "timed": g2 - g1}, "rounds": timed}
    row["itl_ms"]["mean"] = _ms(statistics.fmean(gaps)) if gaps else None
    return row, new


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="base", help="the transformer-pp preset size to copy (tiny, small, base, ...)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocabulary (default: the preset's, 32000; 260 = lintime's byte tokenizer, as the runs "
                        "served in docs/performance.md)")
    p.add_argument("--clients", type=int, default=64, help="the batch: prompts given to one generate call")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="timed calls per mode (and one-token calls)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--prompt", choices=("text", "random"), default="text",
                   help="text: the serve bench's prompt in lintime's byte ids; random: uniform ids")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown mode(s) {', '.join(unknown)} (known: {', '.join(MODES)})")
    if min(args.clients, args.prompt_tokens, args.new_tokens, args.rounds) < 1:
        p.error("--clients, --prompt-tokens, --new-tokens and --rounds must be at least 1")
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise SystemExit(f"hf_generate_bench needs transformers (pip install -e '.[hf]'): {err}") from None
    from lintime.bench.measure import environment

    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    torch.manual_seed(0)
    model, record = build_llama(args.size, args.vocab_size, args.prompt_tokens + args.new_tokens, device, dtype)
    prompts = make_prompts(args.prompt, args.clients, args.prompt_tokens, record["config"]["vocab_size"]).to(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(peaks=False, device=device)
    env["git_commit"] = os.environ.get("LINTIME_GIT_COMMIT") or env.get("git_commit")
    result = {"commit": env["git_commit"], "env": env, "settings": vars(args), "model": record, "rows": []}
    name = f"hf:llama-{args.size}"
    first: torch.Tensor | None = None
    for mode in modes:
        if mode.endswith("+compile") and device.type != "cuda":
            row = {"model": name, "served_as": f"hf generate {mode}", "mode": mode,
                   "status": f"skipped: generate compiles only on CUDA (device {device})"}
        else:
            try:
                row, new = bench_generate(model, prompts, args.new_tokens, mode, args.rounds, name)
                # every mode decodes the same prompts greedily with the same weights: how many rows agree with the
                # first mode's (bf16 rounding may differ between the eager and the compiled step)
                if first is None:
                    first = new
                row["rows_equal_first_mode"] = int((new == first).all(dim=1).sum())
            except Exception as err:  # noqa: BLE001 - a failed mode is a row, not the end of the run
                row = {"model": name, "served_as": f"hf generate {mode}", "mode": mode,
                       "status": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}
            if device.type == "cuda":
                row["peak_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20)
                torch.cuda.reset_peak_memory_stats(device)
        row.update(impl=record["impl"], params=record["params"], dtype=record["dtype"], device=str(device),
                   versions={"torch": torch.__version__, "transformers": env.get("transformers")})
        printed = {k: v for k, v in row.items() if k != "rounds"}
        print(json.dumps(printed), flush=True)
        result["rows"].append(row)
        (out / "hf_generate_bench.json").write_text(json.dumps(result, indent=1))
    print(f"\n{'mode':<28} {'tokens/s':>9} {'ttft p50':>9} {'itl p50':>8} {'p99':>8} {'ms/token':>9} {'warm-up s':>9}")
    for r in result["rows"]:
        if r["status"] != "ok":
            print(f"{r['served_as'][:28]:<28} {r['status']}")
            continue
        print(f"{r['served_as'][:28]:<28} {r['tokens_per_s']:>9} {r['ttft_ms']['p50']!s:>9} {r['itl_ms']['p50']!s:>8} "
              f"{r['itl_ms']['p99']!s:>8} {r['decode_ms_per_token']!s:>9} {r['warmup_s']:>9}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
