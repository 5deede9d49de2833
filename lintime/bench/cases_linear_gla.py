"""Bench cases of linear attention and GLA: the Triton backend against the anchors measured in the
same run -- fla 0.6.0 (``chunk_linear_attn``, ``chunk_gla``, ``fused_recurrent_linear_attn``,
``fused_recurrent_gla``) when installed, and PyTorch SDPA (causal softmax attention, the cost a
linear-time layer replaces).

bf16 inputs, 32k tokens per batch (``B = max(1, 32768 // T)``), ``T`` from 1k to 64k.  Linear
attention: ``H = 16, K = V = 64``; GLA: ``H = 4, K = 128, V = 256`` (the issue's shapes).
Work counted per token and head for the chunked algorithm with ``C = 64`` (full ``C x C``
blocks): forward ``2 C (K + V) + 4 K V`` flops, forward + backward three times that; bytes =
each input read once and each output written once (forward: q, k, v[, g] in, o out;
forward + backward: also do in, every gradient out).  ``extra`` holds the speed-up over the fla
anchor and the relative RMS difference of the outputs (a sanity check, both in bf16).

Two times per configuration: eager (``fwd_ms``, ``fwdbwd_ms``: the ops called from PyTorch, host
launch overhead included, what an eager training step sees) and CUDA-graph replay
(``extra.fwd_graph_ms``, ``extra.fwdbwd_graph_ms``: device time, what a captured / compiled step
approaches).  Speed-ups are given for both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.bench import Result
from lintime.bench.measure import (
    fwd_fwdbwd_graph_ms,
    fwd_fwdbwd_ms,
    graph_ms,
    median_ms,
)

TOKENS = 32 * 1024
TS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_TS = (2048, 8192, 32768)
C = 64
DEFAULT_CASES = ("linear", "gla", "decode", "segments")


def _batch(T: int) -> int:
    return max(1, TOKENS // T)


def _flops_fwd(B, T, H, K, V) -> float:
    return B * T * H * (2 * C * (K + V) + 4 * K * V)


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def _fla():
    try:
        import fla.ops.linear_attn as lin
        from fla.ops import gla
    except ImportError:
        return None, None
    return lin, gla


def _time(f, inputs):
    """Eager and graph-replay medians: ``(fwd, fwdbwd, fwd_graph, fwdbwd_graph)`` in ms."""
    return (*fwd_fwdbwd_ms(f, inputs), *fwd_fwdbwd_graph_ms(f, inputs))


def _record(results, case, impl, T, B, shape, times, work, extra=None):
    fwd, fb, fwd_g, fb_g = times
    flops_fwd, bytes_fwd, bytes_fb = work
    extra = dict(extra or {})
    extra.update(fwd_graph_ms=fwd_g, fwdbwd_graph_ms=fb_g)
    if fb_g:
        extra["gbps_fwdbwd_graph"] = bytes_fb / fb_g / 1e6
        extra["tflops_fwdbwd_graph"] = 3 * flops_fwd / fb_g / 1e9
    results.append(Result(case, impl, T, B, dict(shape), fwd_ms=fwd, fwdbwd_ms=fb, flops_fwd=flops_fwd,
                          flops_fwdbwd=3 * flops_fwd, bytes_fwd=bytes_fwd, bytes_fwdbwd=bytes_fb, extra=extra))
    return results[-1]


def _speedups(mine, ref):
    mine.extra["speedup_fwd"] = ref.fwd_ms / mine.fwd_ms
    mine.extra["speedup_fwdbwd"] = ref.fwdbwd_ms / mine.fwdbwd_ms
    for kind in ("fwd", "fwdbwd"):
        a, b = mine.extra.get(f"{kind}_graph_ms"), ref.extra.get(f"{kind}_graph_ms")
        if a and b:
            mine.extra[f"speedup_{kind}_graph"] = b / a


def case_linear(results, quick=False, H=16, D=64):
    """Linear attention, normalised and not, vs fla ``chunk_linear_attn`` and SDPA causal."""
    from lintime.ops import linear_attention

    lin, _ = _fla()
    for T in QUICK_TS if quick else TS:
        B = _batch(T)
        n = B * T * H * D
        q = torch.rand(B, T, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.rand(B, T, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        shape = dict(H=H, K=D, V=D)
        for normalize in (True, False):
            tag = "norm" if normalize else "plain"
            work = (_flops_fwd(B, T, H, D, D), 2 * 4 * n + (4 * B * T * H if normalize else 0), 2 * 8 * n)
            ours = lambda q, k, v, nz=normalize: linear_attention(q, k, v, normalize=nz, backend="triton")[0]
            mine = _record(results, f"linear_{tag}", "lintime.triton", T, B, shape, _time(ours, [q, k, v]), work)
            if lin is not None:
                theirs = lambda q, k, v, nz=normalize: lin.chunk_linear_attn(q, k, v, normalize=nz)[0]
                ref = _record(results, f"linear_{tag}", "fla.chunk_linear_attn", T, B, shape, _time(theirs, [q, k, v]),
                              work)
                with torch.no_grad():
                    mine.extra["rel_vs_fla"] = _rel(ours(q, k, v), theirs(q, k, v))
                _speedups(mine, ref)
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        fl = B * H * T * T * 2 * D  # causal: half of 4 T^2 D
        _record(results, "sdpa_causal", "torch.sdpa", T, B, shape, _time(sdpa, [q, k, v]), (fl, 2 * 4 * n, 2 * 8 * n))
        results[-1].flops_fwdbwd = 3.5 * fl  # FlashAttention's count: backward 2.5x forward
        del q, k, v


def case_gla(results, quick=False, H=4, K=128, V=256, Ts=None):
    """GLA vs fla ``chunk_gla`` (``Ts``: context lengths, default by ``quick``)."""
    from lintime.ops import gated_linear_attention

    _, gla = _fla()
    for T in Ts or (QUICK_TS if quick else TS):
        B = _batch(T)
        q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
        g = (F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).bfloat16().requires_grad_()
        nt = B * T * H
        work = (_flops_fwd(B, T, H, K, V), 2 * nt * (3 * K + 2 * V), 2 * nt * (6 * K + 4 * V))
        shape = dict(H=H, K=K, V=V)
        ours = lambda q, k, v, g: gated_linear_attention(q, k, v, g, backend="triton")[0]
        mine = _record(results, "gla", "lintime.triton", T, B, shape, _time(ours, [q, k, v, g]), work)
        if gla is not None:
            theirs = lambda q, k, v, g: gla.chunk_gla(q, k, v, g)[0]
            ref = _record(results, "gla", "fla.chunk_gla", T, B, shape, _time(theirs, [q, k, v, g]), work)
            with torch.no_grad():
                mine.extra["rel_vs_fla"] = _rel(ours(q, k, v, g), theirs(q, k, v, g))
            _speedups(mine, ref)
        del q, k, v, g


def case_decode(results, quick=False):
    """One decoding step (``T = 1``) from a state: microseconds per token (per call) against fla's
    ``fused_recurrent_*``; batches of 1 and 32 sequences."""
    from lintime.ops import gated_linear_attention, linear_attention

    lin, gla = _fla()
    for B in (1, 32):
        for name, H, K, V in (("decode_linear", 16, 64, 64), ("decode_gla", 4, 128, 256)):
            q = torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16)
            k = torch.rand(B, 1, H, K, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(B, 1, H, V, device="cuda", dtype=torch.bfloat16)
            g = (F.logsigmoid(torch.randn(B, 1, H, K, device="cuda")) / 16).bfloat16()
            s = torch.randn(B, H, K, V, device="cuda")
            shape = dict(H=H, K=K, V=V)
            if name == "decode_linear":
                q = q.abs()
                impls = {"lintime.triton": lambda: linear_attention(q, k, v, normalize=False, initial_state=s,
                                                                    output_final_state=True, backend="triton")}
                if lin is not None:
                    impls["fla.fused_recurrent_linear_attn"] = lambda: lin.fused_recurrent_linear_attn(
                        q, k, v, initial_state=s, output_final_state=True, normalize=False)
            else:
                impls = {"lintime.triton": lambda: gated_linear_attention(q, k, v, g, initial_state=s,
                                                                          output_final_state=True, backend="triton")}
                if gla is not None:
                    impls["fla.fused_recurrent_gla"] = lambda: gla.fused_recurrent_gla(
                        q, k, v, gk=g, initial_state=s, output_final_state=True)
            bytes_ = 2 * B * H * K * V * 4  # the state read and written dominates
            ms = {}
            with torch.no_grad():
                for impl, fn in impls.items():
                    ms[impl] = median_ms(fn, warmup=10, rep=50)
                    gm = graph_ms(fn, rep=50)
                    results.append(Result(name, impl, 1, B, shape, fwd_ms=ms[impl], bytes_fwd=bytes_,
                                          extra={"us_per_token": 1000 * ms[impl],
                                                 "us_per_token_graph": None if gm is None else 1000 * gm}))
            if len(ms) == 2:
                a, b = results[-2], results[-1]
                a.extra["speedup_fwd"] = b.fwd_ms / a.fwd_ms
                if a.extra["us_per_token_graph"] and b.extra["us_per_token_graph"]:
                    a.extra["speedup_graph"] = b.extra["us_per_token_graph"] / a.extra["us_per_token_graph"]


def case_segments(results, quick=False, ops=("linear", "gla")):
    """The materialisation choice: chunks per segment ``ns`` (0 = one segment per sequence, i.e.
    non-materialised; ``auto`` = the rule in ``lintime.ops.segments.choose_segment_chunks``)."""
    from lintime.ops.gla.triton.ops import segment_chunks_for as gla_auto
    from lintime.ops.gla.triton.ops import triton_gla
    from lintime.ops.linear.triton.ops import segment_chunks_for as lin_auto
    from lintime.ops.linear.triton.ops import triton_linear_attention

    for T in (2048, 8192, 32768):
        B = _batch(T)
        for op, H, K, V in (("linear", 16, 64, 64), ("gla", 4, 128, 256)):
            if op not in ops:
                continue
            q = torch.rand(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
            k = torch.rand(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
            v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
            g = (F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).bfloat16().requires_grad_()
            auto = (lin_auto if op == "linear" else gla_auto)(q, v, None)
            for ns in (0, 4, 8, 16, 32) if op == "linear" else (0, 8, 16, 32, 64):
                if op == "linear":
                    f = lambda q, k, v, ns=ns: triton_linear_attention(q, k, v, segment_chunks=ns)[0]
                    inputs = [q, k, v]
                else:
                    f = lambda q, k, v, g, ns=ns: triton_gla(q, k, v, g, segment_chunks=ns)[0]
                    inputs = [q, k, v, g]
                fwd, fb = fwd_fwdbwd_ms(f, inputs, rep=50)
                fwd_g, fb_g = fwd_fwdbwd_graph_ms(f, inputs, rep=50)
                print(f"segments_{op} T={T} ns={ns} (auto {auto}): fwd {fwd:.3f} fb {fb:.3f} ms, graph fwd {fwd_g} "
                      f"fb {fb_g}", flush=True)
                results.append(Result(f"segments_{op}", f"ns={ns}", T, B, dict(H=H, K=K, V=V), fwd_ms=fwd,
                                      fwdbwd_ms=fb, extra={"auto": auto, "fwd_graph_ms": fwd_g,
                                                           "fwdbwd_graph_ms": fb_g}))
            del q, k, v, g


# GLA launch variants timed by case_kernel_configs: lintime.ops.gla.triton.ops.LAUNCH_VARIANTS (the
# CUDA tests run every one of them against the naive form before one may become a default).


def _linear_configs(results, T, B, H, D, linear_fwd, linear_bwd, lin_auto):
    q = torch.rand(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.rand(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(v)
    ns = lin_auto(q, v, None)
    for name, cfg in (("default", None), ("s2", {"fwd": (4, 2), "dq": (4, 2), "dkdv": (4, 2)}),
                      ("s4", {"fwd": (4, 4), "dq": (4, 4), "dkdv": (4, 4)})):
        out = linear_fwd(q, k, v, None, None, None, D**-0.5, True, True, ns, cfg)
        fwd = median_ms(lambda: linear_fwd(q, k, v, None, None, None, D**-0.5, True, True, ns, cfg), rep=50)
        bwd = median_ms(lambda: linear_bwd(q, k, v, out[0], out[3], out[1], out[2], out[4], out[5], do, None, None,
                                           None, None, None, D**-0.5, True, True, ns, False, cfg), rep=50)
        results.append(Result("configs_linear_norm", name, T, B, dict(H=H, K=D, V=D, ns=ns), fwd_ms=fwd,
                              fwdbwd_ms=fwd + bwd, extra={"bwd_ms": bwd}))


def case_kernel_configs(results, quick=False, T=8192, ops=("linear", "gla")):
    """Launch configurations of the walk kernels (num_warps, num_stages; the dq/dk/dg tile of
    GLA), forward and backward launchers timed separately (no autograd), T = 8k, 32k tokens."""
    from lintime.ops.gla.triton.ops import LAUNCH_VARIANTS, gla_bwd, gla_fwd
    from lintime.ops.gla.triton.ops import segment_chunks_for as gla_auto
    from lintime.ops.linear.triton.ops import linear_bwd, linear_fwd
    from lintime.ops.linear.triton.ops import segment_chunks_for as lin_auto

    B = _batch(T)
    H, D = 16, 64
    if "linear" in ops:
        _linear_configs(results, T, B, H, D, linear_fwd, linear_bwd, lin_auto)
    if "gla" not in ops:
        return
    H, K, V = 4, 128, 256
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).bfloat16()
    do = torch.randn_like(v)
    ns = gla_auto(q, v, None)
    for name, cfg in LAUNCH_VARIANTS:
        try:
            o, ht, *saved = gla_fwd(q, k, v, g, None, None, K**-0.5, ns, True, cfg)
            fwd = median_ms(lambda: gla_fwd(q, k, v, g, None, None, K**-0.5, ns, True, cfg), rep=50)
            bwd = median_ms(lambda: gla_bwd(q, k, v, g, *saved, do, None, None, K**-0.5, ns, False, cfg), rep=50)
        except Exception as e:  # a variant the compiler rejects must not cost the others (a fault still would)
            print(f"configs_gla {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        results.append(Result("configs_gla", name, T, B, dict(H=H, K=K, V=V, ns=ns), fwd_ms=fwd, fwdbwd_ms=fwd + bwd,
                              extra={"bwd_ms": bwd}))
        print(f"configs_gla {name}: fwd {fwd:.3f} ms, bwd {bwd:.3f} ms", flush=True)  # kept if the step times out


def case_profile(results, quick=False, T=8192, ops=("linear", "gla")):
    """Device time per kernel of one forward + backward (torch.profiler, mean of 5), linear
    attention (normalised) and GLA at T = 8k: rows ``profile_<op>`` with the kernel name as impl."""
    from torch.profiler import ProfilerActivity, profile

    from lintime.ops import gated_linear_attention, linear_attention

    B = _batch(T)
    for op, H, K, V in (("linear", 16, 64, 64), ("gla", 4, 128, 256)):
        if op not in ops:
            continue
        q = torch.rand(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.rand(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
        g = (F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).bfloat16().requires_grad_()
        if op == "linear":
            f, inputs = (lambda q, k, v: linear_attention(q, k, v, backend="triton")[0]), [q, k, v]
        else:
            f, inputs = (lambda q, k, v, g: gated_linear_attention(q, k, v, g, backend="triton")[0]), [q, k, v, g]
        do = torch.randn_like(f(*inputs))

        def step():
            torch.autograd.grad(f(*inputs), inputs, do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if us > 0 and e.count >= 5:
                results.append(Result(f"profile_{op}", e.key[:60], T, B, dict(H=H, K=K, V=V), fwd_ms=us / 5 / 1000,
                                      extra={"calls_per_step": e.count // 5}))
        del q, k, v, g


def case_gla_profile(results, quick=False):
    """:func:`case_profile` for GLA only (T = 8k)."""
    case_profile(results, quick, ops=("gla",))


def case_gla_configs(results, quick=False):
    """:func:`case_kernel_configs` for GLA only (T = 8k)."""
    case_kernel_configs(results, quick, ops=("gla",))


def case_gla_segments(results, quick=False):
    """:func:`case_segments` for GLA only (T = 2k, 8k, 32k)."""
    case_segments(results, quick, ops=("gla",))
