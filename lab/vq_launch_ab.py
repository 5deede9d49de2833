"""Launch A/B of the Transformer-VQ Triton kernels at the vq-base shape (H = 1, K = 128, V = 1536, S = L = 512,
bf16, B * T = 32768 tokens, T = 32k then 8k): fwd and fwd+bwd median device ms (CUDA-graph replays) per
:class:`VQLaunch` variant, each checked against the default launch (max |a - b| / max |b| over the output and
every gradient), plus a torch.profiler split of the default's fwd+bwd (device ms per kernel and per PyTorch op),
so the PyTorch work around the kernels is visible.

``k_hat = codebook[codes]`` is gathered inside the timed call (the codebook's gradient is part of the backward,
as in the layer); the bias is ``[B, T, 1, 2L]`` as the layer passes it.  Every variant is timed with the bias;
the default also without (first at each T, before the budget check).  A time budget (``--budget`` s, compiles
included) skips the remaining variants once spent.

GPU: ``PYTHONPATH=. python3 lab/vq_launch_ab.py --out $OUT/vq_launch_ab.json`` (about 2-3 min warm).
CPU smoke test of the code paths (interpreter, tiny fp32 shape, no timing meaning):
``PYTHONPATH=. python3 lab/vq_launch_ab.py --smoke``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from lintime.ops.utils import mark_checked  # noqa: E402
from lintime.ops.vq.triton import triton_vq_attention  # noqa: E402
from lintime.ops.vq.triton.launch import default_launch  # noqa: E402

# (name, overrides of the default launch); fields: bm_p bn_p warps_p (probabilities) | bm_o bd_o bk_o warps_o
# (P [v; mean], dS [k; codebook]) | bm_d bn_d bk_d warps_d (dS) | bn_k bi_k bd_k warps_k (dv, dk) | stages.  One axis
# at a time (each kernel's tiles change only that kernel)
VARIANTS = [
    ("default", {}),
    ("probs bm128 w8", dict(bm_p=128, warps_p=8)),
    ("probs bm32", dict(bm_p=32)),
    ("probs bn32", dict(bn_p=32)),
    ("probs bn128 w8", dict(bn_p=128, warps_p=8)),
    ("pv bd256", dict(bd_o=256)),
    ("pv bm64 w4", dict(bm_o=64, warps_o=4)),
    ("pv bk32", dict(bk_o=32)),
    ("pv bd64 w4", dict(bd_o=64, warps_o=4)),
    ("dp bn64 w4", dict(bn_d=64, warps_d=4)),
    ("dp bn256", dict(bn_d=256)),
    ("dp bm64 bn256", dict(bm_d=64, bn_d=256)),
    ("dp bk32", dict(bk_d=32)),
    ("stages2", dict(stages=2)),
    ("stages4", dict(stages=4)),
    ("key bn64 bi32", dict(bn_k=64, bi_k=32)),
    ("key bd256", dict(bd_k=256)),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_inputs(B, T, K, V, S, L, dt, dev, bias: bool):
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dev, dt).requires_grad_()
    q = r(B, T, 1, K, scale=K**-0.25)
    v = r(B, T, 1, V)
    cb = r(1, S, K, scale=K**-0.25)
    b = r(B, T, 1, 2 * L, scale=0.1) if bias else None
    codes = torch.randint(0, S, (B, T, 1), generator=g).to(dev)
    mark_checked(codes)  # as the layer marks its argmin codes: no range read-back, so the call is graph-capturable
    return q, v, cb, b, codes


def make_fn(codes, L, launch):
    heads = torch.zeros_like(codes)

    def f(q, v, cb, b):
        k_hat = cb[heads, codes]
        return triton_vq_attention(q, k_hat, codes, v, cb, block_len=L, bias=b, launch=launch)[0]

    return f


def timer(dev):
    if dev == "cuda":
        import triton

        from lintime.bench.measure import graph_ms

        def ms(fn):  # device time: CUDA-graph replays (the op's host work is what the training step's graph drops)
            t = graph_ms(fn, rep=60)
            if t is not None:
                return t
            fn()
            torch.cuda.synchronize()
            return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    else:
        def ms(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    return ms


def run_variant(inputs, codes, L, launch, ms, ref=None):
    """``(fwd ms, fwd+bwd ms, outputs for the check, max rel err against ref)``."""
    leaves = [x for x in inputs if x is not None]
    f = make_fn(codes, L, launch)
    out = f(*inputs)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, leaves, do)
    res = [out.detach()] + [g_.detach() for g_ in grads]
    err = None if ref is None else max(rel_err(a, b) for a, b in zip(res, ref))

    def fwd():
        with torch.no_grad():
            f(*inputs)

    def fb():
        torch.autograd.grad(f(*inputs), leaves, do)

    return ms(fwd), ms(fb), res, err


def profile_default(inputs, codes, L, launch, dev, top=25):
    """Device ms per kernel and per PyTorch op (self device time) of one fwd+bwd."""
    from torch.profiler import ProfilerActivity, profile

    leaves = [x for x in inputs if x is not None]
    f = make_fn(codes, L, launch)
    do = torch.randn_like(f(*inputs))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    torch.autograd.grad(f(*inputs), leaves, do)  # warm
    if dev == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        torch.autograd.grad(f(*inputs), leaves, do)
        if dev == "cuda":
            torch.cuda.synchronize()
    ev = prof.key_averages()
    is_dev = lambda e: e.device_type == torch.autograd.DeviceType.CUDA
    kernels = sorted(((e.key, e.self_device_time_total / 1e3, e.count) for e in ev if is_dev(e)),
                     key=lambda x: -x[1])
    ops = sorted(((e.key, e.self_device_time_total / 1e3, e.cpu_time_total / 1e3, e.count) for e in ev
                  if not is_dev(e) and e.self_device_time_total > 0), key=lambda x: -x[1])
    tot = sum(k[1] for k in kernels)
    vq = sum(k[1] for k in kernels if k[0].startswith("vq_"))
    return {
        "all_kernels_ms": tot, "vq_kernels_ms": vq, "other_kernels_ms": tot - vq,
        "kernels": [dict(name=k[0][:120], ms=round(k[1], 4), count=k[2]) for k in kernels[:top]],
        "ops": [dict(name=o[0][:80], device_ms=round(o[1], 4), cpu_ms=round(o[2], 3), count=o[3]) for o in ops[:top]],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--Ts", default="32768,8192",
                    help="the first gets the compiles, the profile and priority in the budget")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--budget", type=float, default=140.0, help="seconds; variants past it are skipped")
    ap.add_argument("--variants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny fp32 shape")
    a = ap.parse_args()
    t0 = time.perf_counter()
    if a.smoke:
        dev, dt, K, V, S, L, Ts, tokens = "cpu", torch.float32, 32, 64, 32, 32, [64, 128], 128
        a.variants = a.variants or "probs bn32,pv bk32,dp bn64 w4"
    else:
        dev, dt, K, V, S, L = "cuda", torch.bfloat16, 128, 1536, 512, 512
        Ts, tokens = [int(t) for t in a.Ts.split(",")], a.tokens
    base = default_launch(K, V, dt)
    names = set(a.variants.split(",")) if a.variants else None
    variants = [(n, ov) for n, ov in VARIANTS if names is None or n in names or n == "default"]
    ms = timer(dev)
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)", "dtype": str(dt),
           "shape": dict(H=1, K=K, V=V, S=S, L=L, tokens=tokens), "default": dataclasses.asdict(base),
           "rows": [], "skipped": []}
    print(f"{out['device']}  default {base}", flush=True)
    print(f"{'variant':28s} {'T':>6s} {'bias':>4s} {'fwd ms':>8s} {'fwd+bwd':>8s} {'max rel err':>11s} "
          f"{'fb/def':>7s}", flush=True)
    for T in Ts:
        B = max(1, tokens // T)
        for bias in (False, True):  # the default without a bias first: never skipped
            q, v, cb, b, codes = make_inputs(B, T, K, V, S, L, dt, dev, bias)
            inputs = [q, v, cb, b]
            ref, ref_fb = None, float("nan")
            for name, ov in variants:
                if not bias and name != "default":
                    continue  # without the bias: the default only
                if name != "default" and time.perf_counter() - t0 > a.budget:
                    out["skipped"].append(f"{name} T={T} bias={bias}")
                    continue
                cfg = dataclasses.replace(base, **ov)
                row = dict(variant=name, T=T, B=B, bias=bias, launch=dataclasses.asdict(cfg))
                try:
                    fwd, fb, res, err = run_variant(inputs, codes, L, cfg, ms, ref)
                    if name == "default":
                        ref, ref_fb = res, fb
                    row.update(fwd_ms=fwd, fwdbwd_ms=fb, max_rel_err=err, fwdbwd_vs_default=fb / ref_fb)
                    flag = "  <-- MISMATCH" if err is not None and err > 0.05 else ""
                    print(f"{name:28s} {T:6d} {str(bias):>4s} {fwd:8.3f} {fb:8.3f} "
                          f"{'-' if err is None else f'{err:.2e}':>11s} {fb / ref_fb:6.3f}x{flag}", flush=True)
                except Exception as e:  # noqa: BLE001 -- a variant that fails to compile / run is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{name:28s} {T:6d} {str(bias):>4s} ERROR {row['error']}", flush=True)
                out["rows"].append(row)
                del row
            if bias and T == Ts[0]:  # after the variants: their compiles are not in it
                prof = profile_default(inputs, codes, L, base, dev)
                out["profile"] = dict(T=T, B=B, bias=True, **prof)
                print(f"\nprofile of the default, T={T} bias: all kernels {prof['all_kernels_ms']:.3f} ms, vq_* "
                      f"{prof['vq_kernels_ms']:.3f} ms, other {prof['other_kernels_ms']:.3f} ms", flush=True)
                for k in prof["kernels"]:
                    print(f"  kernel {k['ms']:8.3f} ms x{k['count']:<3d} {k['name'][:90]}")
                for o in prof["ops"]:
                    print(f"  op     {o['device_ms']:8.3f} ms x{o['count']:<3d} {o['name']}")
                print(flush=True)
            del q, v, cb, b, codes, inputs, ref
            if dev == "cuda":
                torch.cuda.empty_cache()
    # best variant per T (with the bias) by fwd+bwd
    for T in Ts:
        rows = [r for r in out["rows"] if r["T"] == T and r["bias"] and "fwdbwd_ms" in r]
        if rows:
            best = min(rows, key=lambda r: r["fwdbwd_ms"])
            print(f"best fwd+bwd at T={T}: {best['variant']} {best['fwdbwd_ms']:.3f} ms "
                  f"(fwd best: {min(rows, key=lambda r: r['fwd_ms'])['variant']})")
    if out["skipped"]:
        print(f"skipped (budget {a.budget:.0f} s): {out['skipped']}")
    out["wall_s"] = time.perf_counter() - t0
    print(f"wall {out['wall_s']:.1f} s")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
