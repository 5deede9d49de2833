"""``lintime serve`` under load: N concurrent streaming clients against a real server process on 127.0.0.1, each
sending ``--requests`` completions of a fixed prompt length and output length; reported per model: aggregate
output tokens/s, time to first token (p50 / p90 / p99) and inter-token latency (p50 / p99), with every request's
finish reason checked.  Each model is served in turn by the same server command, so a KV-cache softmax model
(e.g. a transformer-pp run) under the same server is the anchor in the same run.  Loopback only; every request has
a timeout, the number of requests is bounded and the server is stopped (SIGTERM, then killed) whatever happens.

    python3 benchmarks/serve_bench.py --out $OUT --models runs/flash-base,runs/tpp-base --clients 64 \\
        --prompt-tokens 512 --new-tokens 256 --requests 2

A model is a run folder, a step folder or an exported folder (what ``lintime serve`` takes).  Results:
``$OUT/serve_bench.json`` and a table on stdout.

``--hf-anchor SIZE`` adds the other anchor of the same run, after the served models: HF ``generate`` with its static
cache at the same batch (``--clients`` prompts of ``--prompt-tokens`` tokens in one call, ``--new-tokens`` each,
``--requests`` timed calls), by ``benchmarks/hf_generate_bench.py`` in its own process (``--hf-flags`` passes it more
flags, e.g. ``--vocab-size 260``); its rows join the JSON and the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


class Server:
    """A ``lintime serve`` process on a free loopback port, stopped on exit."""

    def __init__(self, model: str, flags: list[str], logs: Path, start_s: float):
        self.log = open(logs, "w")
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, "-m", "lintime", "serve", model, "--host", "127.0.0.1",
                                      "--port", "0", *flags], stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        self.url = None
        deadline = time.monotonic() + start_s
        lines: list[str] = []

        def read() -> None:  # the address line, then keep draining stdout so the process never blocks on it
            for line in self.proc.stdout:
                lines.append(line)

        threading.Thread(target=read, daemon=True).start()
        while time.monotonic() < deadline and self.url is None and self.proc.poll() is None:
            for line in list(lines):
                m = re.search(r"at (http://127\.0\.0\.1:\d+/v1)", line)
                if m:
                    self.url = m.group(1)
            time.sleep(0.1)
        if self.url is None:
            self.stop()
            raise RuntimeError(f"lintime serve {model} did not start (see {logs})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def one_request(client, model: str, prompt: str, new_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion: time to first text, the gaps between the following pieces, the pieces, and
    the tokens the server counted (its usage chunk: a piece may hold several tokens, or wait for a character's
    last byte)."""
    t0 = time.perf_counter()
    first, last, gaps, pieces, finish, tokens = None, None, [], 0, None, None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, timeout=timeout)
    for chunk in stream:
        if getattr(chunk, "usage", None) is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        now = time.perf_counter()
        if chunk.choices[0].text:
            if first is None:
                first = now - t0
            elif last is not None:
                gaps.append(now - last)
            last = now
            pieces += 1
        finish = chunk.choices[0].finish_reason or finish
    return {"ttft": first, "gaps": gaps, "pieces": pieces, "tokens": tokens, "finish": finish,
            "wall": time.perf_counter() - t0}


def bench_model(model: str, args, out: Path) -> dict:
    import httpx
    import openai

    server = Server(model, args.serve_flags.split(), out / f"serve_{Path(model).name}.log", args.start_s)
    try:
        client = openai.OpenAI(base_url=server.url, api_key=os.environ.get("LINTIME_API_KEY") or "unused",
                               max_retries=0)
        name = client.models.list().data[0].id
        prompt = ("The quick brown fox jumps over the lazy dog. " * (args.prompt_tokens // 45 + 1))[:args.prompt_tokens - 1]
        one_request(client, name, prompt[:64], 4, args.request_s)  # warm-up: kernels and the first buckets
        for _ in range(args.warmup_rounds):  # the load itself once, untimed: its prefill shapes compile kernels
            with ThreadPoolExecutor(args.clients) as pool:
                list(pool.map(lambda _: one_request(client, name, prompt, args.new_tokens, args.request_s),
                              range(args.clients)))
        results: list[dict] = []
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            futs = [pool.submit(one_request, client, name, prompt, args.new_tokens, args.request_s)
                    for _ in range(args.clients * args.requests)]
            for f in futs:
                try:
                    results.append(f.result(timeout=args.request_s * (args.requests + 1)))
                except Exception as err:  # noqa: BLE001 - a failed request is counted, not fatal
                    results.append({"error": f"{type(err).__name__}: {str(err)[:200]}"})
        wall = time.perf_counter() - t0
        health = httpx.get(server.url.removesuffix("/v1") + "/health", timeout=30).json()
    finally:
        server.stop()
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    tokens = sum(r["pieces"] for r in ok)
    new_tokens = sum(r["tokens"] or 0 for r in ok)
    row = {"model": model, "served_as": name, "clients": args.clients, "requests": len(results), "failed":
           len(results) - len(ok), "finish": {k: sum(r.get("finish") == k for r in ok) for k in ("length", "stop")},
           "wall_s": round(wall, 3), "output_pieces": tokens, "pieces_per_s": round(tokens / wall, 1),
           "output_tokens": new_tokens, "tokens_per_s": round(new_tokens / wall, 1),
           "ttft_ms": {q: _ms(_quantile(ttft, v)) for q, v in (("p50", .5), ("p90", .9), ("p99", .99))},
           "itl_ms": {q: _ms(_quantile(gaps, v)) for q, v in (("p50", .5), ("p99", .99))},
           "engine": {k: health.get(k) for k in ("steps", "tokens_generated") if k in health}}
    if ok:
        row["itl_ms"]["mean"] = _ms(statistics.fmean(gaps)) if gaps else None
    return row


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 2)


def hf_anchor_rows(args, out: Path) -> list[dict]:
    """``benchmarks/hf_generate_bench.py`` on the same load in a process of its own (its model and compiled graphs
    leave with it); its rows, or one ``failed`` row saying why."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "hf_generate_bench.py"), "--out", str(out / "hf_generate"),
           "--size", args.hf_anchor, "--clients", str(args.clients), "--prompt-tokens", str(args.prompt_tokens),
           "--new-tokens", str(args.new_tokens), "--rounds", str(args.requests), *args.hf_flags.split()]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    name = f"hf:llama-{args.hf_anchor}"
    path = out / "hf_generate" / "hf_generate_bench.json"
    path.unlink(missing_ok=True)  # an earlier run's rows are not this one's
    with open(out / "hf_generate.log", "w") as log:
        try:
            res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.hf_s)
        except subprocess.TimeoutExpired:
            return [{"model": name, "served_as": "hf generate", "status": f"failed: over --hf-s {args.hf_s:g} s"}]
    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    if res.returncode != 0:  # the rows it finished stay; the rest is said by one row
        rows.append({"model": name, "served_as": "hf generate", "status":
                     f"failed: exit {res.returncode} (see {out / 'hf_generate.log'})"})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", required=True, help="comma-separated run / step / exported folders ('' with "
                   "--hf-anchor: the HF anchor alone)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=2, help="requests per client")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="untimed rounds of the same load first (Triton compiles each new prefill shape once per "
                        "machine: a cold first round measures the compiler)")
    p.add_argument("--serve-flags", default="", help="extra lintime serve flags, space-separated")
    p.add_argument("--start-s", type=float, default=300)
    p.add_argument("--request-s", type=float, default=300)
    p.add_argument("--hf-anchor", default="", metavar="SIZE",
                   help="also time HF generate with its static cache on the same load: transformers' Llama the size "
                        "of transformer-pp-SIZE (e.g. base), benchmarks/hf_generate_bench.py")
    p.add_argument("--hf-flags", default="", help="more hf_generate_bench.py flags, space-separated "
                   "(e.g. '--vocab-size 260 --modes static,static+compile')")
    p.add_argument("--hf-s", type=float, default=900, help="time limit of the HF anchor's process")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    if args.clients < 1 or args.requests < 1 or args.clients * args.requests > 4096:
        p.error("--clients x --requests must be in 1..4096")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = [m for m in args.models.split(",") if m]
    if not models and not args.hf_anchor:
        p.error("--models is empty and there is no --hf-anchor: nothing to measure")
    rows = []

    def save() -> None:
        (out / "serve_bench.json").write_text(json.dumps({"commit": os.environ.get("LINTIME_GIT_COMMIT", ""),
                                                          "settings": vars(args), "rows": rows}, indent=1))

    for model in models:
        rows.append(bench_model(model, args, out))
        print(json.dumps(rows[-1]), flush=True)
        save()
    if args.hf_anchor:
        for row in hf_anchor_rows(args, out):
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "rounds"}), flush=True)
        save()
    print(f"\n{'model':<28} {'tokens/s':>9} {'pieces/s':>9} {'ttft p50':>9} {'p99':>8} {'itl p50':>8} {'p99':>8} failed")
    for r in rows:
        if r.get("status", "ok") != "ok":
            print(f"{r['served_as'][:28]:<28} {r['status']}")
            continue
        print(f"{r['served_as'][:28]:<28} {r['tokens_per_s']:>9} {r['pieces_per_s']:>9} {r['ttft_ms']['p50']!s:>9} {r['ttft_ms']['p99']!s:>8} "
              f"{r['itl_ms']['p50']!s:>8} {r['itl_ms']['p99']!s:>8} {r['failed']}")


if __name__ == "__main__":
    main()
