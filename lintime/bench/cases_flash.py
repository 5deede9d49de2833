"""Bench cases of the FLASH ops: mixed chunk attention, GAU attention and a whole FLASH layer,
with the anchors measured in the same run -- PyTorch SDPA (causal, ``H = 16, D = 64``), fla 0.6.0
``chunk_linear_attn`` at FLASH's linear shape (``H = 1, K = 128, V = 2048``) and lucidrains'
``flash-pytorch`` 0.1.9 ``FLASH`` layer -- when installed.

bf16 inputs drawn from N(0, 1) (queries / keys scaled by 0.5), 32k tokens per batch
(``B = max(1, 32768 // T)``).  Mixed chunk: ``H = 1, S = 128, E = 2048, C = 256``, causal, with the
Toeplitz bias; GAU: ``H = 1, S = 128, E = 2048``, causal, bias ``[1, 2T - 1]``.  Times are the
medians of :mod:`lintime.bench.measure` (eager calls: the host's launch overhead is included);
``profile`` adds the per-kernel device time of one forward + backward (torch.profiler) and
``graph`` (not run by default) the replay time of CUDA graphs.  ``flops_fwdbwd`` counts the useful
work of the algorithm (no recomputation): see :func:`mixed_chunk_flops`.

Run: ``lintime bench ops --cases flash --out DIR`` (CUDA only; ``benchmarks/gpu_flash.sh``).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from lintime.bench import Result
from lintime.bench.measure import fwd_fwdbwd_graph_ms, fwd_fwdbwd_ms

TOKENS = 32 * 1024
T_MIXED = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
T_GAU = T_MIXED  # the T list for every case: 1k..64k at 32k tokens per batch (64k: one sequence)
QUICK_TS = (2048, 8192, 32768)
MEM_T = (8192, 32768, 131072)
DEFAULT_CASES = ("mixed_chunk", "mixed_chunk_memory", "gau", "fla_linear", "flash_layer", "profile")


def _timings(f, inputs):
    return fwd_fwdbwd_ms(f, inputs)


def _peak_mib(f, inputs) -> float:
    """Peak memory of one forward + backward above what was allocated before it."""
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = f(*inputs)
    o = o[0] if isinstance(o, tuple) else o
    torch.autograd.grad(o, leaves, torch.ones_like(o))
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale).requires_grad_()


def mixed_chunk_flops(T, B, S, E, C, causal=True) -> float:
    """Useful flops of one forward + backward (no recomputation counted): in-chunk pairs
    ``p`` (causal ``C (C + 1) / 2`` per full chunk) cost ``2S + 2E`` forward and ``4S + 4E``
    backward; every token costs ``4SE`` forward (``k^T v``, ``q . H``) and ``8SE`` backward."""
    full, rest = divmod(T, C)
    per = (lambda c: c * (c + 1) / 2) if causal else (lambda c: c * c)
    pairs = B * (full * per(C) + per(rest))
    return pairs * (6 * S + 6 * E) + B * T * 12 * S * E


def gau_flops(T, B, S, E, causal=True) -> float:
    pairs = B * (T * (T + 1) / 2 if causal else T * T)
    return pairs * (6 * S + 6 * E)


def sdpa_flops(T, B, H, D, causal=True) -> float:
    pairs = B * H * (T * (T + 1) / 2 if causal else T * T)
    return pairs * 4 * D * 3.5  # forward 4D per pair, backward 2.5x (FlashAttention's count)


# ------------------------------------------------------------------------------------ cases


def case_mixed_chunk(results, quick=False, Ts=T_MIXED, S=128, E=2048, C=256, tokens=TOKENS,
                     impls=("triton", "chunk"), blocks=None, tag="mixed_chunk"):
    """Triton kernels and the chunked PyTorch form, fwd and fwd + bwd, T from 1k to 64k."""
    from lintime.ops import mixed_chunk_attention

    for T in QUICK_TS if quick else Ts:
        B = max(1, tokens // T)
        xs = [_rand(B, T, 1, S, scale=0.5) for _ in range(4)] + [_rand(B, T, 1, E)]
        rb = _rand(1, 2 * C - 1, scale=0.1)
        for impl in impls:
            if impl == "chunk" and B * T > tokens:
                continue
            if blocks is not None and impl == "triton":
                from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention

                def f(*a, _b=blocks):
                    return triton_mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, blocks=_b)[0]
            else:
                def f(*a, _impl=impl):
                    return mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, backend=_impl)[0]
            try:
                fwd, fb = _timings(f, xs + [rb])
            except torch.OutOfMemoryError:
                fwd = fb = None
            torch.cuda.empty_cache()
            results.append(Result(tag, impl, T, B, {"H": 1, "S": S, "E": E, "C": C, "causal": True}, fwd, fb,
                                  flops_fwdbwd=mixed_chunk_flops(T, B, S, E, C),
                                  extra={} if blocks is None else {"blocks": blocks.to_list()}))
            print(f"{tag:14s} {impl:8s} T={T:6d} B={B:3d}  fwd {fwd}  fwd+bwd {fb}", flush=True)


def case_mixed_chunk_memory(results, quick=False, Ts=MEM_T, S=128, E=2048, C=256):
    """Peak memory of one forward + backward at T = 8k, 32k, 128k (one sequence)."""
    from lintime.ops import mixed_chunk_attention

    for T in Ts:
        xs = [_rand(1, T, 1, S, scale=0.5) for _ in range(4)] + [_rand(1, T, 1, E)]
        rb = _rand(1, 2 * C - 1, scale=0.1)

        def f(*a):
            return mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C)[0]

        f(*xs, rb)
        inputs_mib = sum(x.numel() * x.element_size() for x in xs) / 2**20
        peak = _peak_mib(f, xs + [rb])
        results.append(Result("mixed_chunk_memory", "triton", T, 1, {"H": 1, "S": S, "E": E, "C": C}, peak_mib=peak,
                              extra={"inputs_mib": inputs_mib, "peak_per_token_kib": peak * 1024 / T}))
        print(f"mixed_chunk memory T={T}: peak {peak:.1f} MiB over inputs {inputs_mib:.1f} MiB", flush=True)
        del xs
        torch.cuda.empty_cache()


def case_gau(results, quick=False, Ts=T_GAU, S=128, E=2048, tokens=TOKENS, impls=("triton",), blocks=None,
             tag="gau", anchor=True):
    """GAU attention against SDPA (causal, H = 16, D = 64) at the same tokens."""
    from lintime.ops import gau_attention
    from lintime.ops.gau.triton import triton_gau_attention

    for T in (2048, 8192) if quick else Ts:
        B = max(1, tokens // T)
        q, k = _rand(B, T, 1, S, scale=0.5), _rand(B, T, 1, S, scale=0.5)
        v = _rand(B, T, 1, E)
        rb = _rand(1, 2 * T - 1, scale=0.1)
        for impl in impls:
            def f(q, k, v, rb, _impl=impl):
                if blocks is not None:
                    return triton_gau_attention(q, k, v, rel_bias=rb, scale=1.0 / 128, blocks=blocks)
                return gau_attention(q, k, v, rel_bias=rb, scale=1.0 / 128, backend=_impl)

            fwd, fb = _timings(f, [q, k, v, rb])
            results.append(Result(tag, impl, T, B, {"H": 1, "S": S, "E": E, "causal": True}, fwd, fb,
                                  flops_fwdbwd=gau_flops(T, B, S, E),
                                  extra={} if blocks is None else {"blocks": blocks.to_list()}))
            print(f"{tag:14s} {impl:8s} T={T:6d} B={B:3d}  fwd {fwd:.3f}  fwd+bwd {fb:.3f}", flush=True)
        del q, k, v
        if not anchor:
            continue
        # anchor: SDPA causal H16 D64 at the same tokens
        qs, ks, vs = (_rand(B, 16, T, 64) for _ in range(3))

        def sdpa(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        fwd, fb = _timings(sdpa, [qs, ks, vs])
        results.append(Result("gau", "sdpa_h16_d64", T, B, {"H": 16, "D": 64, "causal": True}, fwd, fb,
                              flops_fwdbwd=sdpa_flops(T, B, 16, 64)))
        print(f"gau            sdpa     T={T:6d} B={B:3d}  fwd {fwd:.3f}  fwd+bwd {fb:.3f}", flush=True)
        del qs, ks, vs
        torch.cuda.empty_cache()


def case_fla_linear(results, quick=False, Ts=T_MIXED, K=128, V=2048, tokens=TOKENS):
    """Anchor: fla's chunk_linear_attn (unnormalised) at FLASH's linear shape."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as e:  # noqa: BLE001 - the anchor is optional
        print(f"fla not available: {e!r}")
        return
    import fla

    for T in QUICK_TS if quick else Ts:
        B = max(1, tokens // T)
        q, k = _rand(B, T, 1, K, scale=0.5), _rand(B, T, 1, K, scale=0.5)
        v = _rand(B, T, 1, V)

        def f(q, k, v):
            return chunk_linear_attn(q, k, v, normalize=False)[0]

        fwd, fb = _timings(f, [q, k, v])
        results.append(Result("fla_chunk_linear_attn", f"fla-{fla.__version__}", T, B, {"H": 1, "K": K, "V": V}, fwd, fb))
        print(f"fla linear     T={T:6d} B={B:3d}  fwd {fwd:.3f}  fwd+bwd {fb:.3f}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def flash_block(d: int = 1024):
    """The benchmarked FLASH block: pre-LayerNorm, the FLASH layer (``e = 2d, s = 128, C = 256``,
    causal, Toeplitz bias) and the residual; ``forward(x, positions)``."""
    from torch import nn

    from lintime.layers.flash import FLASH

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.mixer = FLASH(d, expansion_dim=2 * d, key_dim=128, chunk_size=256, causal=True)

        def forward(self, x, pos):
            return x + self.mixer(self.norm(x), positions=pos)[0]

    return Block()


def case_flash_layer(results, quick=False, Ts=T_MIXED, d=1024, tokens=TOKENS):
    """A whole FLASH layer (pre-norm, projections, RoPE, four scale/offset heads, mixed chunk
    attention with the Toeplitz bias, gate, output projection, residual) vs lucidrains'."""
    from lintime.layers.positional import token_positions

    ours = flash_block(d).cuda().to(torch.bfloat16)
    theirs = None
    try:
        from flash_pytorch import FLASH as LucidFLASH
        from rotary_embedding_torch import RotaryEmbedding

        theirs = LucidFLASH(dim=d, group_size=256, query_key_dim=128, expansion_factor=2.0, causal=True,
                            rotary_pos_emb=RotaryEmbedding(dim=32)).cuda().to(torch.bfloat16)
    except Exception as e:  # noqa: BLE001 - the anchor is optional
        print(f"flash-pytorch not available: {e!r}")
    for T in (4096,) if quick else Ts:
        B = max(1, tokens // T)
        x = _rand(B, T, d)
        pos = token_positions(B, T, device="cuda")
        try:
            fwd, fb = _timings(lambda x, _pos=pos: ours(x, _pos), [x])
        except torch.OutOfMemoryError:
            fwd = fb = None
        results.append(Result("flash_layer", "lintime", T, B, {"d": d, "e": 2 * d, "s": 128, "C": 256}, fwd, fb))
        print(f"FLASH layer    lintime  T={T:6d} B={B:3d}  fwd {fwd}  fwd+bwd {fb}", flush=True)
        if theirs is not None:
            try:
                fwd, fb = _timings(lambda x: theirs(x), [x])
            except torch.OutOfMemoryError:
                fwd = fb = None
            results.append(Result("flash_layer", "flash-pytorch-0.1.9", T, B, {"d": d, "group": 256}, fwd, fb))
            print(f"FLASH layer    lucid    T={T:6d} B={B:3d}  fwd {fwd}  fwd+bwd {fb}", flush=True)
        del x
        torch.cuda.empty_cache()


def _variant_jobs(Ts, T_gau, S, E, C, tokens):
    """``(case, name, T, B, shape, flops, overrides, blocks, f, inputs)`` for every launch variant of
    both ops (``LAUNCH_VARIANTS`` of :mod:`lintime.ops.mixed_chunk.triton.mixed_chunk` and
    :mod:`lintime.ops.gau.triton.gau`), the blocks from :func:`variant_blocks` -- the ones their CUDA
    tests check.  Inputs are allocated once per length and shared by the variants."""
    from lintime.ops.gau.triton import triton_gau_attention
    from lintime.ops.gau.triton.gau import LAUNCH_VARIANTS as GAU_VARIANTS
    from lintime.ops.gau.triton.plan import variant_blocks
    from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention
    from lintime.ops.mixed_chunk.triton.mixed_chunk import (
        LAUNCH_VARIANTS as MC_VARIANTS,
    )

    # LINTIME_VARIANTS="default,walk_" times only the variants whose names start with one of the
    # comma-separated prefixes (a GPU call's minutes are counted)
    prefixes = tuple(p for p in os.environ.get("LINTIME_VARIANTS", "").split(",") if p)
    if prefixes:
        MC_VARIANTS = [(n, o) for n, o in MC_VARIANTS if n.startswith(prefixes)]
        GAU_VARIANTS = [(n, o) for n, o in GAU_VARIANTS if n.startswith(prefixes)]
    jobs = []
    for T in Ts:
        B = max(1, tokens // T)
        inputs = [_rand(B, T, 1, S, scale=0.5) for _ in range(4)] + [_rand(B, T, 1, E), _rand(1, 2 * C - 1, scale=0.1)]
        shape = {"H": 1, "S": S, "E": E, "C": C, "causal": True}
        for name, overrides in MC_VARIANTS:
            blocks = variant_blocks(overrides, S, E, torch.bfloat16, C)

            def f(*a, _b=blocks):
                return triton_mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, blocks=_b)[0]

            jobs.append(("variants_mixed_chunk", name, T, B, shape, mixed_chunk_flops(T, B, S, E, C), overrides,
                         blocks, f, inputs))
    if T_gau:
        B = max(1, tokens // T_gau)
        inputs = [_rand(B, T_gau, 1, S, scale=0.5), _rand(B, T_gau, 1, S, scale=0.5), _rand(B, T_gau, 1, E),
                  _rand(1, 2 * T_gau - 1, scale=0.1)]
        shape = {"H": 1, "S": S, "E": E, "causal": True}
        for name, overrides in GAU_VARIANTS:
            blocks = variant_blocks(overrides, S, E, torch.bfloat16)

            def f(q, k, v, rb, _b=blocks):
                return triton_gau_attention(q, k, v, rel_bias=rb, scale=1.0 / S, blocks=_b)

            jobs.append(("variants_gau", name, T_gau, B, shape, gau_flops(T_gau, B, S, E), overrides, blocks, f,
                         inputs))
    return jobs


def case_variants(results, quick=False, Ts=(2048, 32768), T_gau=4096, graph=True, S=128, E=2048, C=256,
                  tokens=TOKENS):
    """Every launch variant of mixed chunk attention (T = 2k and 32k, or ``LINTIME_VARIANT_TS``) and GAU
    (T = 4k), exactly the lists their CUDA tests run (``test_launch_variants``), bf16, 32k tokens per batch.  First the
    eager medians of all of them (launch overhead included), then, with ``graph``, the device time of
    the same calls replayed from CUDA graphs (``extra["fwd_graph_ms"]`` / ``["fwdbwd_graph_ms"]``;
    after the first failed capture the rest are skipped: a failed capture can spoil the context).
    One line per variant as soon as it is measured.  Rows: ``variants_mixed_chunk`` /
    ``variants_gau`` with the variant's name as impl; ``extra`` holds the overrides and the blocks."""
    env_ts = [int(t) for t in os.environ.get("LINTIME_VARIANT_TS", "").split(",") if t]
    Ts = env_ts or Ts  # LINTIME_VARIANT_TS=4096,8192: the mixed chunk lengths to time instead
    jobs = _variant_jobs((Ts[-1],) if quick else Ts, T_gau, S, E, C, tokens)
    rows = []
    for case, name, T, B, shape, flops, overrides, blocks, f, inputs in jobs:
        extra = {"overrides": overrides, "blocks": blocks.to_list()}
        try:
            fwd, fb = _timings(f, inputs)
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is a result too
            fwd = fb = None
            extra["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            torch.cuda.empty_cache()
        r = Result(case, name, T, B, shape, fwd, fb, flops_fwdbwd=flops, extra=extra)
        results.append(r)
        rows.append((r, f, inputs))
        what = f"fwd {fwd:.3f}  fwd+bwd {fb:.3f} ms" if fb is not None else f"FAILED {extra['error'][:200]}"
        print(f"{case:21s} {name:14s} T={T:6d} B={B:3d}  eager {what}", flush=True)
    if not graph:
        return
    for r, f, inputs in rows:
        if r.fwdbwd_ms is None:
            continue
        fwd_g, fb_g = fwd_fwdbwd_graph_ms(f, inputs, rep=50)
        r.extra.update(fwd_graph_ms=fwd_g, fwdbwd_graph_ms=fb_g)
        print(f"{r.case:21s} {r.impl:14s} T={r.T:6d} B={r.B:3d}  graph fwd {fwd_g}  fwd+bwd {fb_g} ms", flush=True)
        if fwd_g is None or fb_g is None:
            print("graph capture failed: remaining graph timings skipped", flush=True)
            break


def case_profile(results, quick=False, T=None, S=128, E=2048, C=256, tokens=TOKENS):
    """Per-kernel device time of one mixed chunk forward + backward (torch.profiler), to see what
    bounds the total; also the same for GAU at T = 4096.  ``T`` (mixed chunk) defaults to 32k, or the
    comma-separated lengths in ``LINTIME_PROFILE_TS``."""
    Ts = [T] if T is not None else [int(t) for t in os.environ.get("LINTIME_PROFILE_TS", "32768").split(",") if t]
    for t in Ts:
        _profile_mixed_chunk(results, t, S, E, C, tokens)
    _profile_gau(results, S, E, tokens)


def profile_device(fn, n: int = 5, warmup: int = 1):
    """``torch.profiler`` over ``n`` calls of ``fn`` (CUDA activity only) after ``warmup`` calls; also used
    by ``benchmarks/profile_flash_layer.py``."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof


def _profile_report(results, tag, fn, T, B, n=5):
    prof = profile_device(fn, n)
    rows = []
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dt > 0:
            rows.append((dt / n / 1000.0, ev.key[:60], ev.count // n))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"profile {tag}: device total {total:.3f} ms per call", flush=True)
    for ms, key, cnt in rows[:14]:
        print(f"   {ms:8.3f} ms  x{cnt:<3d} {key}", flush=True)
    results.append(Result(f"profile:{tag}", "triton", T, B, {}, extra={
        "device_ms": total, "kernels": [[k, ms, c] for ms, k, c in rows[:20]]}))


def _profile_mixed_chunk(results, T, S, E, C, tokens):
    from lintime.ops import mixed_chunk_attention
    from lintime.ops.gau.triton.plan import variant_blocks
    from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention
    from lintime.ops.mixed_chunk.triton.mixed_chunk import LAUNCH_VARIANTS as MC_VARIANTS

    B = max(1, tokens // T)
    xs = [_rand(B, T, 1, S, scale=0.5) for _ in range(4)] + [_rand(B, T, 1, E)]
    rb = _rand(1, 2 * C - 1, scale=0.1)
    do = torch.randn(B, T, 1, E, device="cuda", dtype=torch.bfloat16)

    def mc(blocks=None):
        if blocks is None:
            o, _ = mixed_chunk_attention(*xs, rel_bias=rb, chunk_size=C)
        else:
            o, _ = triton_mixed_chunk_attention(*xs, rel_bias=rb, chunk_size=C, blocks=blocks)
        torch.autograd.grad(o, xs + [rb], do)

    _profile_report(results, f"mixed_chunk T={T}", mc, T, B)
    # LINTIME_PROFILE_VARIANTS="one_seg,...": the same profile for those mixed chunk launch variants
    for name in (n for n in os.environ.get("LINTIME_PROFILE_VARIANTS", "").split(",") if n):
        overrides = dict(MC_VARIANTS)[name]
        _profile_report(results, f"mixed_chunk {name} T={T}",
                        functools.partial(mc, variant_blocks(overrides, S, E, torch.bfloat16, C)), T, B)


def _profile_gau(results, S, E, tokens):
    from lintime.ops import gau_attention

    Tg = 4096
    Bg = tokens // Tg
    q, k = _rand(Bg, Tg, 1, S, scale=0.5), _rand(Bg, Tg, 1, S, scale=0.5)
    v = _rand(Bg, Tg, 1, E)
    rbg = _rand(1, 2 * Tg - 1, scale=0.1)
    dog = torch.randn_like(v)

    def gau():
        o = gau_attention(q, k, v, rel_bias=rbg, scale=1.0 / 128)
        torch.autograd.grad(o, [q, k, v, rbg], dog)

    _profile_report(results, f"gau T={Tg}", gau, Tg, Bg)


def case_graph(results, quick=False, tokens=TOKENS, S=128, E=2048, C=256):
    """Device-bound timings (CUDA-graph replay) of the main cases (the launch variants' device
    times are in :func:`case_variants`).  Not run by default (``flash.graph``): its first version (H100,
    2026-11-22) captured the forward but not the backward; this one (``measure.fwd_fwdbwd_graph_ms``:
    side-stream warm-up, no autograd graph kept alive, ``None`` for a call that cannot be captured) ran
    on H200s in four calls of 2026-11-22 with every case captured."""

    from lintime.layers.positional import token_positions
    from lintime.ops import gau_attention
    from lintime.ops.gau.triton import triton_gau_attention
    from lintime.ops.gau.triton.plan import default_blocks
    from lintime.ops.mixed_chunk.triton import triton_mixed_chunk_attention

    def log(tag, impl, T, B, shape, fwd, fb, flops=None, extra=None):
        results.append(Result(tag, impl, T, B, shape, fwd, fb, flops_fwdbwd=flops, extra=extra or {}))
        print(f"{tag:22s} {impl:22s} T={T:6d} B={B:3d}  fwd {fwd}  fwd+bwd {fb}", flush=True)

    blocks = default_blocks(S, E, torch.bfloat16, C)  # the launch variants' device times: case_variants
    for T in T_MIXED:
        B = max(1, tokens // T)
        xs = [_rand(B, T, 1, S, scale=0.5) for _ in range(4)] + [_rand(B, T, 1, E)]
        rb = _rand(1, 2 * C - 1, scale=0.1)

        def f(*a):
            return triton_mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, blocks=blocks)[0]

        fwd, fb = fwd_fwdbwd_graph_ms(f, xs + [rb])
        log("graph:mixed_chunk", "default", T, B, {"H": 1, "S": S, "E": E, "C": C}, fwd, fb,
            mixed_chunk_flops(T, B, S, E, C), {"blocks": blocks.to_list()})
        del xs
        torch.cuda.empty_cache()
    gau_tiled = dataclasses.replace(default_blocks(S, E, torch.bfloat16), slab=0)
    for T in T_GAU:
        B = max(1, tokens // T)
        q, k = _rand(B, T, 1, S, scale=0.5), _rand(B, T, 1, S, scale=0.5)
        v = _rand(B, T, 1, E)
        rbg = _rand(1, 2 * T - 1, scale=0.1)
        fwd, fb = fwd_fwdbwd_graph_ms(lambda q, k, v, b: gau_attention(q, k, v, rel_bias=b, scale=1 / 128), [q, k, v, rbg])
        log("graph:gau", "triton", T, B, {"H": 1, "S": S, "E": E}, fwd, fb, gau_flops(T, B, S, E))
        # the tiled (FlashAttention-shaped) kernels, the default before the slab path, in the same run
        fwd, fb = fwd_fwdbwd_graph_ms(lambda q, k, v, b: triton_gau_attention(q, k, v, rel_bias=b, scale=1 / 128,
                                                                              blocks=gau_tiled), [q, k, v, rbg])
        log("graph:gau", "triton_tiled", T, B, {"H": 1, "S": S, "E": E}, fwd, fb, gau_flops(T, B, S, E))
        del q, k, v
        qs, ks, vs = (_rand(B, 16, T, 64) for _ in range(3))
        fwd, fb = fwd_fwdbwd_graph_ms(
            lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), [qs, ks, vs])
        log("graph:gau", "sdpa_h16_d64", T, B, {"H": 16, "D": 64}, fwd, fb, sdpa_flops(T, B, 16, 64))
        del qs, ks, vs
        torch.cuda.empty_cache()
    try:
        from fla.ops.linear_attn import chunk_linear_attn

        for T in (2048, 32768):
            B = tokens // T
            q, k = _rand(B, T, 1, 128, scale=0.5), _rand(B, T, 1, 128, scale=0.5)
            v = _rand(B, T, 1, 2048)
            fwd, fb = fwd_fwdbwd_graph_ms(lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)[0], [q, k, v])
            log("graph:fla_linear", "fla-0.6.0", T, B, {"H": 1, "K": 128, "V": 2048}, fwd, fb)
    except Exception as e:  # noqa: BLE001
        print(f"fla graph timing skipped: {e!r}"[:300])
    d = 1024
    ours = flash_block(d).cuda().to(torch.bfloat16)
    try:
        from flash_pytorch import FLASH as LucidFLASH
        from rotary_embedding_torch import RotaryEmbedding

        theirs = LucidFLASH(dim=d, group_size=256, query_key_dim=128, expansion_factor=2.0, causal=True,
                            rotary_pos_emb=RotaryEmbedding(dim=32)).cuda().to(torch.bfloat16)
    except Exception:  # noqa: BLE001
        theirs = None
    for T in (4096, 32768):
        B = tokens // T
        x = _rand(B, T, d)
        pos = token_positions(B, T, device="cuda")
        fwd, fb = fwd_fwdbwd_graph_ms(lambda x, _pos=pos: ours(x, _pos), [x])
        log("graph:flash_layer", "lintime", T, B, {"d": d}, fwd, fb)
        if theirs is not None:
            fwd, fb = fwd_fwdbwd_graph_ms(lambda x: theirs(x), [x])
            log("graph:flash_layer", "flash-pytorch-0.1.9", T, B, {"d": d}, fwd, fb)
