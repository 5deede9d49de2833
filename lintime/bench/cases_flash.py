"""Bench cases of the FLASH ops: mixed chunk attention, GAU attention and a whole FLASH layer,
with the anchors measured in the same run -- PyTorch SDPA (causal, ``H = 16, D = 64``), fla 0.6.0
``chunk_linear_attn`` at FLASH's linear shape (``H = 1, K = 128, V = 2048``) and lucidrains'
``flash-pytorch`` 0.1.9 ``FLASH`` layer -- when installed.

bf16 inputs drawn from N(0, 1) (queries / keys scaled by 0.5), 32k tokens per batch
(``B = max(1, 32768 // T)``).  Mixed chunk: ``H = 1, S = 128, E = 2048, C = 256``, causal, with the
Toeplitz bias; GAU: ``H = 1, S = 128, E = 2048``, causal, bias ``[1, 2T - 1]``.  Times are the
medians of :mod:`lintime.bench.measure` (eager calls: the host's launch overhead is included);
``graph`` (not run by default: ``--cases flash.graph``) gives the device time of the same calls
replayed from CUDA graphs.  ``flops_fwdbwd`` counts the useful work of the algorithm (no
recomputation): see :func:`mixed_chunk_flops`.

Run: ``lintime bench ops --cases flash --out DIR`` (CUDA only; ``benchmarks/gpu_flash.sh``).
"""

from __future__ import annotations

import torch

from lintime.bench import Result
from lintime.bench.measure import fwd_fwdbwd_graph_ms, fwd_fwdbwd_ms

TOKENS = 32 * 1024
T_MIXED = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
T_GAU = T_MIXED  # the T list for every case: 1k..64k at 32k tokens per batch (64k: one sequence)
QUICK_TS = (2048, 8192, 32768)
MEM_T = (8192, 32768, 131072)
DEFAULT_CASES = ("mixed_chunk", "mixed_chunk_memory", "gau", "fla_linear", "flash_layer")


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
                     impls=("triton", "chunk")):
    """Triton kernels and the chunked PyTorch form, fwd and fwd + bwd, T from 1k to 64k."""
    from lintime.ops import mixed_chunk_attention

    for T in QUICK_TS if quick else Ts:
        B = max(1, tokens // T)
        xs = [_rand(B, T, 1, S, scale=0.5) for _ in range(4)] + [_rand(B, T, 1, E)]
        rb = _rand(1, 2 * C - 1, scale=0.1)
        for impl in impls:
            if impl == "chunk" and B * T > tokens:
                continue
            def f(*a, _impl=impl):
                return mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, backend=_impl)[0]
            try:
                fwd, fb = _timings(f, xs + [rb])
            except torch.OutOfMemoryError:
                fwd = fb = None
            torch.cuda.empty_cache()
            results.append(Result("mixed_chunk", impl, T, B, {"H": 1, "S": S, "E": E, "C": C, "causal": True}, fwd, fb,
                                  flops_fwdbwd=mixed_chunk_flops(T, B, S, E, C)))
            print(f"mixed_chunk    {impl:8s} T={T:6d} B={B:3d}  fwd {fwd}  fwd+bwd {fb}", flush=True)


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


def case_gau(results, quick=False, Ts=T_GAU, S=128, E=2048, tokens=TOKENS, impls=("triton",), anchor=True):
    """GAU attention against SDPA (causal, H = 16, D = 64) at the same tokens."""
    from lintime.ops import gau_attention

    for T in (2048, 8192) if quick else Ts:
        B = max(1, tokens // T)
        q, k = _rand(B, T, 1, S, scale=0.5), _rand(B, T, 1, S, scale=0.5)
        v = _rand(B, T, 1, E)
        rb = _rand(1, 2 * T - 1, scale=0.1)
        for impl in impls:
            def f(q, k, v, rb, _impl=impl):
                return gau_attention(q, k, v, rel_bias=rb, scale=1.0 / 128, backend=_impl)

            fwd, fb = _timings(f, [q, k, v, rb])
            results.append(Result("gau", impl, T, B, {"H": 1, "S": S, "E": E, "causal": True}, fwd, fb,
                                  flops_fwdbwd=gau_flops(T, B, S, E)))
            print(f"gau            {impl:8s} T={T:6d} B={B:3d}  fwd {fwd:.3f}  fwd+bwd {fb:.3f}", flush=True)
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


def _lucid_flash(d: int):
    """lucidrains' FLASH layer at the benchmarked shape (bf16, CUDA), ``None`` when not installed."""
    try:
        from flash_pytorch import FLASH as LucidFLASH
        from rotary_embedding_torch import RotaryEmbedding
    except Exception as e:  # noqa: BLE001 - the anchor is optional
        print(f"flash-pytorch not available: {e!r}")
        return None
    return LucidFLASH(dim=d, group_size=256, query_key_dim=128, expansion_factor=2.0, causal=True,
                      rotary_pos_emb=RotaryEmbedding(dim=32)).cuda().to(torch.bfloat16)


def case_flash_layer(results, quick=False, Ts=T_MIXED, d=1024, tokens=TOKENS):
    """A whole FLASH layer (pre-norm, projections, RoPE, four scale/offset heads, mixed chunk
    attention with the Toeplitz bias, gate, output projection, residual) vs lucidrains'."""
    from lintime.layers.positional import token_positions

    ours = flash_block(d).cuda().to(torch.bfloat16)
    theirs = _lucid_flash(d)
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


def case_graph(results, quick=False, tokens=TOKENS, S=128, E=2048, C=256):
    """Device time (CUDA-graph replay, :func:`lintime.bench.measure.fwd_fwdbwd_graph_ms`) of the main
    cases with their anchors: mixed chunk, GAU against SDPA, fla's linear kernel, the FLASH layer
    against lucidrains'.  A call that cannot be captured gives ``None`` times."""
    from lintime.layers.positional import token_positions
    from lintime.ops import gau_attention, mixed_chunk_attention

    def log(tag, impl, T, B, shape, fwd, fb, flops=None):
        results.append(Result(tag, impl, T, B, shape, fwd, fb, flops_fwdbwd=flops))
        print(f"{tag:22s} {impl:22s} T={T:6d} B={B:3d}  fwd {fwd}  fwd+bwd {fb}", flush=True)

    for T in QUICK_TS if quick else T_MIXED:
        B = max(1, tokens // T)
        xs = [_rand(B, T, 1, S, scale=0.5) for _ in range(4)] + [_rand(B, T, 1, E)]
        rb = _rand(1, 2 * C - 1, scale=0.1)

        def f(*a):
            return mixed_chunk_attention(*a[:5], rel_bias=a[5], chunk_size=C, backend="triton")[0]

        fwd, fb = fwd_fwdbwd_graph_ms(f, xs + [rb])
        log("graph:mixed_chunk", "triton", T, B, {"H": 1, "S": S, "E": E, "C": C}, fwd, fb,
            mixed_chunk_flops(T, B, S, E, C))
        del xs
        torch.cuda.empty_cache()
    for T in QUICK_TS if quick else T_GAU:
        B = max(1, tokens // T)
        q, k = _rand(B, T, 1, S, scale=0.5), _rand(B, T, 1, S, scale=0.5)
        v = _rand(B, T, 1, E)
        rbg = _rand(1, 2 * T - 1, scale=0.1)
        fwd, fb = fwd_fwdbwd_graph_ms(lambda q, k, v, b: gau_attention(q, k, v, rel_bias=b, scale=1 / 128,
                                                                       backend="triton"), [q, k, v, rbg])
        log("graph:gau", "triton", T, B, {"H": 1, "S": S, "E": E}, fwd, fb, gau_flops(T, B, S, E))
        del q, k, v
        qs, ks, vs = (_rand(B, 16, T, 64) for _ in range(3))
        fwd, fb = fwd_fwdbwd_graph_ms(
            lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), [qs, ks, vs])
        log("graph:gau", "sdpa_h16_d64", T, B, {"H": 16, "D": 64}, fwd, fb, sdpa_flops(T, B, 16, 64))
        del qs, ks, vs
        torch.cuda.empty_cache()
    try:
        import fla
        from fla.ops.linear_attn import chunk_linear_attn

        for T in (2048, 32768):
            B = tokens // T
            q, k = _rand(B, T, 1, 128, scale=0.5), _rand(B, T, 1, 128, scale=0.5)
            v = _rand(B, T, 1, 2048)
            fwd, fb = fwd_fwdbwd_graph_ms(lambda q, k, v: chunk_linear_attn(q, k, v, normalize=False)[0], [q, k, v])
            log("graph:fla_linear", f"fla-{fla.__version__}", T, B, {"H": 1, "K": 128, "V": 2048}, fwd, fb)
    except Exception as e:  # noqa: BLE001 - the anchor is optional
        print(f"fla graph timing skipped: {e!r}"[:300])
    d = 1024
    ours = flash_block(d).cuda().to(torch.bfloat16)
    theirs = _lucid_flash(d)
    for T in (4096, 32768):
        B = tokens // T
        x = _rand(B, T, d)
        pos = token_positions(B, T, device="cuda")
        fwd, fb = fwd_fwdbwd_graph_ms(lambda x, _pos=pos: ours(x, _pos), [x])
        log("graph:flash_layer", "lintime", T, B, {"d": d}, fwd, fb)
        if theirs is not None:
            fwd, fb = fwd_fwdbwd_graph_ms(lambda x: theirs(x), [x])
            log("graph:flash_layer", "flash-pytorch-0.1.9", T, B, {"d": d}, fwd, fb)
