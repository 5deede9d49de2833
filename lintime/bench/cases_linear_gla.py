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
DEFAULT_CASES = ("linear", "gla", "decode")


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
