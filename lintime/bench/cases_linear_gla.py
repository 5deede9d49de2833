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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lintime.bench import Result
from lintime.bench.measure import fwd_fwdbwd_ms, median_ms

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


def _record(results, case, impl, T, B, shape, times, work, extra=None):
    fwd, fb = times
    flops_fwd, bytes_fwd, bytes_fb = work
    results.append(Result(case, impl, T, B, dict(shape), fwd_ms=fwd, fwdbwd_ms=fb, flops_fwd=flops_fwd,
                          flops_fwdbwd=3 * flops_fwd, bytes_fwd=bytes_fwd, bytes_fwdbwd=bytes_fb,
                          extra=dict(extra or {})))
    return results[-1]


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
            mine = _record(results, f"linear_{tag}", "lintime.triton", T, B, shape, fwd_fwdbwd_ms(ours, [q, k, v]), work)
            if lin is not None:
                theirs = lambda q, k, v, nz=normalize: lin.chunk_linear_attn(q, k, v, normalize=nz)[0]
                ref = _record(results, f"linear_{tag}", "fla.chunk_linear_attn", T, B, shape,
                              fwd_fwdbwd_ms(theirs, [q, k, v]), work)
                with torch.no_grad():
                    mine.extra["rel_vs_fla"] = _rel(ours(q, k, v), theirs(q, k, v))
                mine.extra["speedup_fwd"] = ref.fwd_ms / mine.fwd_ms
                mine.extra["speedup_fwdbwd"] = ref.fwdbwd_ms / mine.fwdbwd_ms
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
        fl = B * H * T * T * 2 * D  # causal: half of 4 T^2 D
        _record(results, "sdpa_causal", "torch.sdpa", T, B, shape, fwd_fwdbwd_ms(sdpa, [q, k, v]),
                (fl, 2 * 4 * n, 2 * 8 * n))
        results[-1].flops_fwdbwd = 3.5 * fl  # FlashAttention's count: backward 2.5x forward
        del q, k, v


def case_gla(results, quick=False, H=4, K=128, V=256):
    """GLA vs fla ``chunk_gla``."""
    from lintime.ops import gated_linear_attention

    _, gla = _fla()
    for T in QUICK_TS if quick else TS:
        B = _batch(T)
        q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
        g = (F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).bfloat16().requires_grad_()
        nt = B * T * H
        work = (_flops_fwd(B, T, H, K, V), 2 * nt * (3 * K + 2 * V), 2 * nt * (6 * K + 4 * V))
        shape = dict(H=H, K=K, V=V)
        ours = lambda q, k, v, g: gated_linear_attention(q, k, v, g, backend="triton")[0]
        mine = _record(results, "gla", "lintime.triton", T, B, shape, fwd_fwdbwd_ms(ours, [q, k, v, g]), work)
        if gla is not None:
            theirs = lambda q, k, v, g: gla.chunk_gla(q, k, v, g)[0]
            ref = _record(results, "gla", "fla.chunk_gla", T, B, shape, fwd_fwdbwd_ms(theirs, [q, k, v, g]), work)
            with torch.no_grad():
                mine.extra["rel_vs_fla"] = _rel(ours(q, k, v, g), theirs(q, k, v, g))
            mine.extra["speedup_fwd"] = ref.fwd_ms / mine.fwd_ms
            mine.extra["speedup_fwdbwd"] = ref.fwdbwd_ms / mine.fwdbwd_ms
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
                    results.append(Result(name, impl, 1, B, shape, fwd_ms=ms[impl], bytes_fwd=bytes_,
                                          extra={"us_per_token": 1000 * ms[impl]}))
            if len(ms) == 2:
                results[-2].extra["speedup_fwd"] = results[-1].fwd_ms / results[-2].fwd_ms


def case_segments(results, quick=False):
    """The materialisation choice: chunks per segment ``ns`` (0 = one segment per sequence, i.e.
    non-materialised; ``auto`` = the rule in ``triton_common.choose_segment_chunks``)."""
    from lintime.ops.gla.triton.ops import segment_chunks_for as gla_auto
    from lintime.ops.gla.triton.ops import triton_gla
    from lintime.ops.linear.triton.ops import segment_chunks_for as lin_auto
    from lintime.ops.linear.triton.ops import triton_linear_attention

    for T in (2048, 8192, 32768):
        B = _batch(T)
        for op, H, K, V in (("linear", 16, 64, 64), ("gla", 4, 128, 256)):
            q = torch.rand(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
            k = torch.rand(B, T, H, K, device="cuda", dtype=torch.bfloat16).requires_grad_()
            v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16).requires_grad_()
            g = (F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).bfloat16().requires_grad_()
            auto = (lin_auto if op == "linear" else gla_auto)(q, v, None)
            for ns in (0, 4, 8, 16, 32):
                if op == "linear":
                    f = lambda q, k, v, ns=ns: triton_linear_attention(q, k, v, segment_chunks=ns)[0]
                    inputs = [q, k, v]
                else:
                    f = lambda q, k, v, g, ns=ns: triton_gla(q, k, v, g, segment_chunks=ns)[0]
                    inputs = [q, k, v, g]
                fwd, fb = fwd_fwdbwd_ms(f, inputs, rep=50)
                results.append(Result(f"segments_{op}", f"ns={ns}", T, B, dict(H=H, K=K, V=V), fwd_ms=fwd,
                                      fwdbwd_ms=fb, extra={"auto": auto}))
            del q, k, v, g


def case_kernel_configs(results, quick=False, T=8192):
    """Launch configurations of the walk kernels (num_warps, num_stages; the dq/dk/dg tile of
    GLA), forward and backward launchers timed separately (no autograd), T = 8k, 32k tokens."""
    from lintime.ops.gla.triton.ops import gla_bwd, gla_fwd
    from lintime.ops.gla.triton.ops import segment_chunks_for as gla_auto
    from lintime.ops.linear.triton.ops import linear_bwd, linear_fwd
    from lintime.ops.linear.triton.ops import segment_chunks_for as lin_auto

    B = _batch(T)
    H, D = 16, 64
    q = torch.rand(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.rand(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    do = torch.randn_like(v)
    ns = lin_auto(q, v, None)
    for name, cfg in (("default", None), ("w8", {"fwd": (8, 2), "dq": (8, 2), "dkdv": (8, 2)}),
                      ("s1", {"fwd": (4, 1), "dq": (4, 1), "dkdv": (4, 1)}),
                      ("s3", {"fwd": (4, 3), "dq": (4, 3), "dkdv": (4, 3)})):
        out = linear_fwd(q, k, v, None, None, None, D**-0.5, True, True, ns, cfg)
        fwd = median_ms(lambda: linear_fwd(q, k, v, None, None, None, D**-0.5, True, True, ns, cfg), rep=50)
        bwd = median_ms(lambda: linear_bwd(q, k, v, out[0], out[3], out[1], out[2], out[4], out[5], do, None, None,
                                           None, None, None, D**-0.5, True, True, ns, False, cfg), rep=50)
        results.append(Result("configs_linear_norm", name, T, B, dict(H=H, K=D, V=D, ns=ns), fwd_ms=fwd,
                              fwdbwd_ms=fwd + bwd, extra={"bwd_ms": bwd}))
    del q, k, v, do
    H, K, V = 4, 128, 256
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, T, H, V, device="cuda", dtype=torch.bfloat16)
    g = (F.logsigmoid(torch.randn(B, T, H, K, device="cuda")) / 16).bfloat16()
    do = torch.randn_like(v)
    ns = gla_auto(q, v, None)
    for name, cfg in (("default", None), ("w4", {"A": (4, 1), "fwd": (4, 1), "dv": (4, 1), "dqkg": (4, 1)}),
                      ("s2", {"A": (8, 2), "fwd": (8, 2), "dv": (8, 2), "dqkg": (8, 2)}),
                      ("dqkg_bk32", {"dqkg_tile": (32, 256)}), ("dqkg_bk32_w4", {"dqkg_tile": (32, 256), "dqkg": (4, 1)})):
        o, ht, A, hs = gla_fwd(q, k, v, g, None, None, K**-0.5, ns, cfg)
        fwd = median_ms(lambda: gla_fwd(q, k, v, g, None, None, K**-0.5, ns, cfg), rep=50)
        bwd = median_ms(lambda: gla_bwd(q, k, v, g, A, hs, do, None, None, None, K**-0.5, ns, False, cfg), rep=50)
        results.append(Result("configs_gla", name, T, B, dict(H=H, K=K, V=V, ns=ns), fwd_ms=fwd, fwdbwd_ms=fwd + bwd,
                              extra={"bwd_ms": bwd}))
