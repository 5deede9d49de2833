"""Bench case of Transformer-VQ attention: the Triton backend and the chunked PyTorch form of
:func:`lintime.ops.vq_attention` against PyTorch SDPA at the same width, measured in the same run.

Shape: vq-base's attention -- ``H = 1``, queries / keys ``K = 128``, values ``V = 1536`` (``e = 2 x 768``),
``S = 512`` codes, blocks of ``L = 512``, the window bias ``[B, T, 1, 2L]``; bf16 inputs drawn from N(0, 1)
(queries and the codebook scaled by ``K ** -0.25``: scores of unit scale), random codes, ``k_hat`` gathered
from the codebook inside the timed call (so the codebook's gradient is part of the backward, as in the
layer).  32k tokens per batch (``B = max(1, 32768 // T)``), ``T`` from 2k to 32k.

Anchor: SDPA causal with 12 heads of 128 (``q, k, v`` each ``[B, 12, T, 128]``): the 1536-wide values as
FlashAttention-width heads, each head's queries / keys as wide as VQ's.  It does 12 times VQ's query-key
products (one shared 128-wide score per token pair in VQ), so it is the cost of quadratic attention at the
layer's value width, not the same arithmetic.

Work counted (``flops_fwdbwd``, FlashAttention's convention: backward 2.5x forward): VQ -- every query scores
its window (on average ``1.5 L`` visible keys for a full block) and the ``S`` codes, ``2 (K + V)`` flops each;
SDPA -- ``T (T + 1) / 2`` causal pairs per head, ``4 x 128`` flops each.  ``extra.vq_kernels_ms`` /
``extra.all_kernels_ms``: device time of the ``vq_*`` Triton kernels / of every kernel in one forward +
backward (torch.profiler), so the PyTorch bookkeeping's share is visible.

Two times per configuration, as in the linear / GLA cases: eager (``fwd_ms``, ``fwdbwd_ms``: host launch overhead
included -- the op's block layout and cache bookkeeping are PyTorch calls) and CUDA-graph replay
(``extra.fwd_graph_ms``, ``extra.fwdbwd_graph_ms``: device time, what the graph-captured training step sees);
``extra.speedup_fwdbwd_vs_sdpa`` / ``extra.speedup_fwdbwd_graph_vs_sdpa`` on the Triton rows.

Run: ``lintime bench ops --cases vq --out DIR`` (CUDA only; ``--quick``: T = 2k, 8k, 32k).
"""

from __future__ import annotations

import torch

from lintime.bench import Result
from lintime.bench.measure import fwd_fwdbwd_graph_ms, fwd_fwdbwd_ms

TOKENS = 32 * 1024
TS = (2048, 4096, 8192, 16384, 32768)
QUICK_TS = (2048, 8192, 32768)
K, V, S, L = 128, 1536, 512, 512
SDPA_HEADS = V // 128


def vq_flops(T: int, B: int, L: int = L, S: int = S, K: int = K, V: int = V) -> float:
    """Useful flops of one forward + backward of VQ attention (see the module docstring)."""
    return B * T * (1.5 * L + S) * 2 * (K + V) * 3.5


def sdpa_flops(T: int, B: int, H: int = SDPA_HEADS, D: int = 128) -> float:
    return B * H * T * (T + 1) / 2 * 4 * D * 3.5


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale).requires_grad_()


def _kernel_ms(f, inputs) -> tuple[float, float]:
    """Device ms of the ``vq_*`` kernels and of all kernels in one forward + backward (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    out = f(*inputs)
    do = torch.randn_like(out)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(f(*inputs), leaves, do)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]  # not the ops
    return (sum(e.self_device_time_total for e in kernels if e.key.startswith("vq_")) / 1e3,
            sum(e.self_device_time_total for e in kernels) / 1e3)


def case_vq(results, quick=False, Ts=TS, tokens=TOKENS, impls=("triton", "chunk"), anchor=True):
    """VQ attention (Triton, chunked PyTorch) and SDPA at the same tokens, fwd and fwd + bwd."""
    from lintime.ops import vq_attention
    from lintime.ops.utils import mark_checked

    for T in QUICK_TS if quick else Ts:
        B = max(1, tokens // T)
        q = _rand(B, T, 1, K, scale=K**-0.25)
        v = _rand(B, T, 1, V)
        bias = _rand(B, T, 1, 2 * L, scale=0.1)
        codebook = _rand(1, S, K, scale=K**-0.25)
        codes = torch.randint(0, S, (B, T, 1), device="cuda")
        mark_checked(codes)  # as the layer marks its argmin codes: no range read-back (a host sync) per call
        heads = torch.zeros_like(codes)
        shape = {"H": 1, "K": K, "V": V, "S": S, "L": L}
        for impl in impls:
            def f(q, v, bias, codebook, _impl=impl):
                k_hat = codebook[heads, codes]  # [B, T, 1, K]
                return vq_attention(q, k_hat, codes, v, codebook, block_len=L, bias=bias, backend=_impl)[0]

            inputs = [q, v, bias, codebook]
            try:
                fwd, fb = fwd_fwdbwd_ms(f, inputs)
                extra = dict(zip(("fwd_graph_ms", "fwdbwd_graph_ms"), fwd_fwdbwd_graph_ms(f, inputs)))
                if impl == "triton":
                    try:  # the split is a diagnostic: a profiler failure must not cost the times
                        extra["vq_kernels_ms"], extra["all_kernels_ms"] = _kernel_ms(f, inputs)
                    except Exception as e:  # noqa: BLE001
                        extra["profile_error"] = f"{type(e).__name__}: {e}"
            except torch.OutOfMemoryError:
                fwd = fb = None
                extra = {"oom": True}
            torch.cuda.empty_cache()
            results.append(Result("vq", impl, T, B, shape, fwd, fb, flops_fwdbwd=vq_flops(T, B), extra=extra))
            print(f"vq             {impl:8s} T={T:6d} B={B:3d}  fwd {fwd}  fwd+bwd {fb}  {extra}", flush=True)
        del q, v, bias, codebook
        if not anchor:
            continue
        qs, ks, vs = (_rand(B, SDPA_HEADS, T, 128, scale=128**-0.25) for _ in range(3))

        def sdpa(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        fwd, fb = fwd_fwdbwd_ms(sdpa, [qs, ks, vs])
        extra = dict(zip(("fwd_graph_ms", "fwdbwd_graph_ms"), fwd_fwdbwd_graph_ms(sdpa, [qs, ks, vs])))
        results.append(Result("vq", f"sdpa_h{SDPA_HEADS}_d128", T, B, {"H": SDPA_HEADS, "D": 128, "causal": True},
                              fwd, fb, flops_fwdbwd=sdpa_flops(T, B), extra=extra))
        print(f"vq             sdpa     T={T:6d} B={B:3d}  fwd {fwd:.3f}  fwd+bwd {fb:.3f}  {extra}", flush=True)
        for r in results:  # the Triton row of this T against the anchor
            if r.case == "vq" and r.impl == "triton" and r.T == T and r.fwdbwd_ms:
                r.extra["speedup_fwdbwd_vs_sdpa"] = fb / r.fwdbwd_ms
                if r.extra.get("fwdbwd_graph_ms") and extra.get("fwdbwd_graph_ms"):
                    r.extra["speedup_fwdbwd_graph_vs_sdpa"] = extra["fwdbwd_graph_ms"] / r.extra["fwdbwd_graph_ms"]
        del qs, ks, vs
        torch.cuda.empty_cache()
