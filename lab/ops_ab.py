"""fwd+bwd device ms of the public attention ops at the presets' shapes, 32k tokens (8 rows of 4k, packed),
bf16 -- run once per source tree to compare trees on one machine."""
import sys, json, torch
sys.path.insert(0, sys.argv[1])
from lintime.ops import mixed_chunk_attention, gau_attention, gated_linear_attention, linear_attention
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
N, L = (8, 4096) if dev == "cuda" else (2, 64)
T = N * L
cu = torch.arange(0, T + 1, L, device=dev, dtype=torch.int32)
def r(*s): return torch.randn(*s, device=dev, dtype=dt).mul_(0.5).requires_grad_()
def bench(name, fn, args, n=10):
    out = fn(*args); o = out[0] if isinstance(out, tuple) else out
    do = torch.randn_like(o)
    def step():
        out = fn(*args); o = out[0] if isinstance(out, tuple) else out
        torch.autograd.grad(o, [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad], do)
    for _ in range(3): step()
    if dev != "cuda":
        step(); print(name, "ok"); return None
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); step(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    ts.sort(); ms = ts[n // 2]; print(f"{sys.argv[1]:8s} {name:40s} {ms:8.3f} ms", flush=True); return ms
res = {}
S, E = 128, 1536
res["mixed_chunk H1 S128 E1536 C256"] = bench("mixed_chunk H1 S128 E1536 C256", lambda a, b, c, d, v: mixed_chunk_attention(a, b, c, d, v, chunk_size=256, cu_seqlens=cu), [r(1, T, 1, S), r(1, T, 1, S), r(1, T, 1, S), r(1, T, 1, S), r(1, T, 1, E)])
res["gau H16 D64"] = bench("gau H16 D64", lambda q, k, v: gau_attention(q, k, v, scale=1.0 / L, cu_seqlens=cu), [r(1, T, 16, 64), r(1, T, 16, 64), r(1, T, 16, 64)])
g = lambda: torch.nn.functional.logsigmoid(torch.randn(1, T, 4, 96, device=dev)).div(16).to(dt).requires_grad_()
res["gla H4 K96 V192"] = bench("gla H4 K96 V192", lambda q, k, v, gg: gated_linear_attention(q, k, v, gg, cu_seqlens=cu), [r(1, T, 4, 96), r(1, T, 4, 96), r(1, T, 4, 192), g()])
res["linear H12 D64"] = bench("linear H12 D64", lambda q, k, v: linear_attention(q.abs(), k.abs(), v, cu_seqlens=cu), [r(1, T, 12, 64), r(1, T, 12, 64), r(1, T, 12, 64)])
if len(sys.argv) > 2: json.dump(res, open(sys.argv[2], "w"), indent=1)
