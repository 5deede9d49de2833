"""gau_attention, backend 'triton': the fused kernels against the naive form (forward and the
gradients of q, k, v and rel_bias) -- on the CPU through the Triton interpreter at small sizes
(fp32 exact, fp16 by the half-precision rule), on CUDA at real sizes (bf16 / fp16 by the
half-precision rule, fp32 exact).

Without CUDA, tests/ops/conftest.py sets ``TRITON_INTERPRET=1``.  Under the interpreter the kernels use 16-wide blocks
(:func:`lintime.ops.gau.triton.launch.default_launch`), so small shapes cross several query/key
tiles, ``S`` tiles and ``E`` tiles, with partial tiles.
"""

import dataclasses

import pytest
import torch

from lintime.ops import gau_attention
from lintime.ops.gau.triton.launch import GauLaunch, default_launch
from tolerances import assert_exact, assert_half_rule

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
NAMES = ("o", "dq", "dk", "dv", "drel_bias")


def _inputs(B, T, H, S, E, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed * 1000 + T * 7 + S)
    q = torch.randn(B, T, H, S, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, S, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, E, generator=g, dtype=torch.float64)
    b = 0.5 * torch.randn(H, 2 * T - 1, generator=g, dtype=torch.float64)
    do = torch.randn(B, T, H, E, generator=g, dtype=torch.float64)
    return [x.to(device, dtype) for x in (q, k, v, b, do)]


def _run(backend, q, k, v, b, do, launch=None, **kw):
    """Output and the gradients of q, k, v (and rel_bias when given), by name.  With ``launch``
    the call goes to the Triton entry with that launch configuration (``backend`` is then ignored)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    bias = None if b is None else b.detach().clone().requires_grad_()
    if launch is None:
        o = gau_attention(*leaves, rel_bias=bias, backend=backend, **kw)
    else:
        from lintime.ops.gau.triton import triton_gau_attention

        o = triton_gau_attention(*leaves, rel_bias=bias, launch=launch, **kw)
    grads = torch.autograd.grad(o, leaves + ([] if bias is None else [bias]), do)
    return dict(zip(NAMES, (o, *grads)))


def _path_launch(path, S, E):
    """The default launch configuration with the slab path on (``slab``: the defaults' slabs -- 32 rows of 16-row
    tiles under the interpreter -- or 512 rows where the defaults keep it off) or off (``tiled``)."""
    launch = default_launch(S, E)
    if path == "tiled":
        return dataclasses.replace(launch, slab=0)
    return launch if launch.slab else dataclasses.replace(launch, slab=512)


@pytest.fixture
def slab_calls(monkeypatch):
    """Counts the slab path's launchers (forward, backward) as the GAU entry calls them."""
    from lintime.ops.gau.triton import gau as g

    calls = []
    for name in ("slab_fwd", "slab_bwd"):
        real = getattr(g, name)
        monkeypatch.setattr(g, name, lambda *a, _real=real, **kw: calls.append(1) or _real(*a, **kw))
    return calls


# ------------------------------------------------------------------------ interpreter (CPU)

cpu_only = pytest.mark.skipif(CUDA, reason="interpreter tests: the CUDA tests below cover the compiled kernels")


@cpu_only
@pytest.mark.parametrize("path", ["tiled", "slab"])
@pytest.mark.parametrize(
    "causal, bias, B, T, H, S, E",
    [
        (True, True, 2, 37, 2, 20, 12),  # two S tiles (S-tiled dq/dk path), partial tiles
        (False, True, 2, 37, 1, 12, 40),  # one S tile (register dq path), three E tiles
        (True, False, 2, 1, 1, 4, 4),
        (False, False, 2, 33, 1, 8, 16),
        (True, True, 2, 63, 1, 60, 12),
        (True, True, 1, 129, 1, 8, 20),  # 9 query / key tiles and 5 slabs, the last of each one row
    ],
)
def test_matches_naive_fp32(path, causal, bias, B, T, H, S, E, slab_calls):
    """Both paths of the Triton backend: the tiled kernels and the slab path (slabs of 32 rows, 16-row score
    tiles under the interpreter: several slabs, a partial last slab and partial tiles)."""
    q, k, v, b, do = _inputs(B, T, H, S, E, torch.float32)
    kw = {"causal": causal, "scale": S**-0.5}
    ref = _run("naive", q, k, v, b if bias else None, do, **kw)
    out = _run("triton", q, k, v, b if bias else None, do, launch=_path_launch(path, S, E), **kw)
    assert slab_calls == ([1, 1] if path == "slab" else [])  # forward and backward took the path asked for
    assert sorted(ref) == sorted(out)
    for name in ref:
        assert out[name].dtype == ref[name].dtype
        assert_exact(f"gau triton {name} (T={T}, causal={causal}, bias={bias})", ref[name], out[name])


@cpu_only
@pytest.mark.parametrize("path", ["tiled", "masked"])
@pytest.mark.parametrize("causal", [True, False])
def test_packing_matches_naive(causal, path, slab_calls):
    """Packed sequences (one of length 1, one empty): no token attends across a boundary, and
    the bias index ``i - j`` is taken inside each sequence of the packed length's table -- on the tiled kernels
    and on the slab path over the call's one row with pairs across sequences masked (``slab_masked``)."""
    lens = [13, 1, 0, 20]
    q, k, v, b, do = _inputs(1, sum(lens), 1, 8, 6, torch.float32, seed=3)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"causal": causal, "scale": 0.3, "cu_seqlens": cu}
    launch = dataclasses.replace(_path_launch("slab", 8, 6), slab_masked=2 if path == "masked" else 0)
    ref, out = _run("naive", q, k, v, b, do, **kw), _run("triton", q, k, v, b, do, launch=launch, **kw)
    assert slab_calls == ([1, 1] if path == "masked" else [])
    for name in ref:
        assert_exact(f"gau packed {path} {name} (causal={causal})", ref[name], out[name])


# two rows, of several sequences each (empty and one-token ones too): a training batch's layout (lintime.data.packing:
# every row starts a sequence), with the row length and the slabs' bounds (32-row slabs, 16-row tiles): the first key
# any query row of a slab sees (k0) and one past the last query row that sees a key of the slab (hi).  "split" (rows
# of 64): the second slab's keys start past 0; "cut" (rows of 48): every row cut at 32, so the first slab's keys are
# seen by its own query rows only
_ROWS = {"whole": ([64, 20, 1, 0, 43], 64, [0, 0], [64, 64]),
         "split": ([20, 44, 30, 1, 33], 64, [0, 16], [64, 64]),
         "cut": ([32, 16, 32, 1, 15], 48, [0, 32], [32, 48])}


@cpu_only
@pytest.mark.parametrize("rows", sorted(_ROWS))
@pytest.mark.parametrize("causal", [True, False])
def test_masked_rows_match_naive(rows, causal, slab_calls):
    """The slab path over a packed call's rows with pairs across sequences masked (``slab_masked``, 2: whatever the
    work rule says): two heads, the bias, slabs of 32 rows over rows of 64 / 48 tokens (slab and sequence boundaries
    not aligned, a partial last slab); output and every gradient exact against naive."""
    from lintime.ops.gau.triton.slab import packed_rows
    from lintime.ops.utils import sequence_bounds

    lens, L, k0, hi = _ROWS[rows]
    N = sum(lens)
    q, k, v, b, do = _inputs(1, N, 2, 8, 16, torch.float32, seed=21)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    launch = dataclasses.replace(default_launch(8, 16), slab_masked=2)
    mask = packed_rows(*sequence_bounds(1, N, cu), N, N, launch, 8, causal, cu, torch.device("cpu"))
    assert mask is not None and (mask.L, mask.R, mask.k0, mask.hi) == (L, 32, k0, hi)
    kw = {"causal": causal, "scale": 0.3, "cu_seqlens": cu}
    ref, out = _run("naive", q, k, v, b, do, **kw), _run("triton", q, k, v, b, do, launch=launch, **kw)
    assert slab_calls == [1, 1]
    for name in ref:
        assert_exact(f"gau masked rows {rows} {name} (causal={causal})", ref[name], out[name])


@cpu_only
def test_packed_host_work_cached_per_cu_seqlens(monkeypatch):
    """A packed call's split, masked rows and tile tables are built once per ``cu_seqlens`` tensor: the backward and
    further calls with the same tensor (a model's layers) reuse them; an in-place write to it, or another tensor,
    rebuilds them -- and the results stay exact."""
    from lintime.ops.gau.triton import gau as g

    reads = []
    real = g.sequence_bounds
    monkeypatch.setattr(g, "sequence_bounds", lambda *a: reads.append(1) or real(*a))
    lens = [20, 12, 15, 17]
    q, k, v, b, do = _inputs(1, sum(lens), 1, 8, 16, torch.float32, seed=25)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for path in ("masked", "tiled"):
        launch = dataclasses.replace(_path_launch("slab", 8, 16), slab_masked=2 if path == "masked" else 0)
        kw = {"causal": True, "scale": 0.3, "cu_seqlens": cu, "launch": launch}
        reads.clear()
        out = [_run("triton", q, k, v, b, do, **kw) for _ in range(2)]
        assert len(reads) == 1, (path, reads)  # two forwards and backwards, one read of cu_seqlens
        cu[2] = 30  # in place: another layout of the same tensor
        moved = _run("triton", q, k, v, b, do, **kw)
        assert len(reads) == 2
        ref = _run("naive", q, k, v, b, do, **{**kw, "launch": None})
        for name in ref:
            assert_exact(f"gau cached {path} {name}", ref[name], moved[name])
        cu[2] = 32
        again = _run("triton", q, k, v, b, do, **{**kw, "cu_seqlens": cu.clone()})  # another tensor
        assert len(reads) == 3
        for name in out[0]:
            assert torch.equal(out[0][name], out[1][name]) and torch.equal(out[0][name], again[name])


def test_packed_rows_rule():
    """:func:`~lintime.ops.gau.triton.slab.packed_rows`: the rows are the smallest length at least the longest
    sequence whose multiples are all boundaries; they are taken when the slabs' work is at most ``SLAB_PAIR_RATIO``
    times the tiled kernels' (whole-document rows: yes; one long row of short sequences: no); never with the slab
    path or ``slab_masked`` off, ``S`` too wide or rows longer than the call's ``T``."""
    from lintime.ops.gau.triton.slab import packed_rows

    def rule(lens, cfg, S=16, causal=True, T_max=None):
        lens = torch.tensor(lens)
        N = int(lens.sum())
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)])
        m = packed_rows(torch.cumsum(lens, 0) - lens, lens, N, T_max or N, cfg, S, causal, cu, torch.device("cpu"))
        return None if m is None else m.L

    on = GauLaunch(slab=32, bm_slab=16, bm=16, slab_masked=1)
    train = [128, 128, 128, 40, 1, 0, 87] * 2  # rows of 128: three in four one document
    assert rule(train, on) == 128
    assert rule(train, on, causal=False) == 128
    assert rule([60, 70, 126], on) == 256  # 128 is not a boundary: one row of all 256 tokens
    short = [5, 6] * 40 + [64]  # one 504-token row of short sequences: 128-row slabs do far more work than tiles
    assert rule(short, dataclasses.replace(on, slab=128)) is None
    assert rule(short, dataclasses.replace(on, slab=128, slab_masked=2)) == 504  # (forced)
    assert rule(train, dataclasses.replace(on, slab_masked=0)) is None
    assert rule(train, dataclasses.replace(on, slab=0)) is None
    assert rule(train, on, S=300) is None
    assert rule(train, on, T_max=100) is None


@cpu_only
@pytest.mark.parametrize("tma", [1, 0], ids=["tma", "pointers"])
@pytest.mark.parametrize("causal", [True, False])
def test_tma_and_pointer_paths(tma, causal, monkeypatch):
    """Both load paths at a shape where ``S`` is one whole step and ``E`` a multiple of the E tiles, so
    ``GauLaunch.tma`` decides which one runs: two heads (a head's tile is a column offset of the
    [B T, H D] view), packed sequences whose tiles end past their region (whole-tile loads read the
    next region's rows), an empty and a one-token sequence, the bias; output and every gradient vs
    naive (fp32 exact)."""
    from lintime.ops.gau.triton import gau as g

    taken = []
    real = g.tma_descriptors
    monkeypatch.setattr(g, "tma_descriptors", lambda *specs: taken.append(real(*specs) is not None) or real(*specs))
    lens, H, S, E = [37, 1, 0, 20], 2, 16, 48
    launch = dataclasses.replace(default_launch(S, E), tma=bool(tma), slab_masked=0)  # the tiled kernels
    q, k, v, b, do = _inputs(1, sum(lens), H, S, E, torch.float32, seed=13)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"causal": causal, "scale": S**-0.5, "cu_seqlens": cu}
    out = _run("triton", q, k, v, b, do, launch=launch, **kw)
    # the TMA run loaded through descriptors in all three kernels
    assert taken == ([True] * 3 if tma else []), taken
    ref = _run("naive", q, k, v, b, do, **kw)
    for name in ref:
        assert_exact(f"gau tma={tma} {name} (causal={causal})", ref[name], out[name])


@cpu_only
def test_gradient_subsets():
    """Only some inputs need gradients (no bias gradient asked): the others still match."""
    q, k, v, b, do = _inputs(1, 20, 1, 6, 5, torch.float32, seed=5)
    qr = q.clone().requires_grad_()
    o = gau_attention(qr, k, v, rel_bias=b, scale=0.4, backend="triton")
    (dq,) = torch.autograd.grad(o, [qr], do)
    qn = q.clone().requires_grad_()
    (dq_ref,) = torch.autograd.grad(gau_attention(qn, k, v, rel_bias=b, scale=0.4, backend="naive"), [qn], do)
    assert_exact("dq only", dq_ref, dq)


@cpu_only
def test_fp16_half_precision_rule():
    q, k, v, b, do = _inputs(2, 40, 1, 32, 24, torch.float64, seed=6)
    kw = {"causal": True, "scale": 32**-0.5}
    ref = _run("naive", q, k, v, b, do, **kw)
    half = [x.half() for x in (q, k, v, b, do)]
    base, out = _run("naive", *half, **kw), _run("triton", *half, **kw)
    assert out["o"].dtype == torch.float16
    for name in ref:
        assert_half_rule(f"gau fp16 {name}", ref[name], out[name], base[name])


@cpu_only
def test_torch_compile_traces_the_custom_ops():
    """``torch.compile`` (aot_eager: fake tensors, no code generation) traces forward and
    backward through ``lintime::gau_fwd`` / ``gau_bwd`` and gives the eager result."""
    q, k, v, b, do = _inputs(1, 18, 1, 4, 6, torch.float32, seed=2)

    def f(q, k, v, b):
        return gau_attention(q, k, v, rel_bias=b, scale=0.5, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, b)]
    g1 = torch.autograd.grad(compiled(*leaves), leaves, do)
    leaves2 = [x.clone().requires_grad_() for x in (q, k, v, b)]
    g2 = torch.autograd.grad(f(*leaves2), leaves2, do)
    for a, c in zip(g2, g1):
        assert_exact("compiled grad", a, c)


@cpu_only
def test_opcheck():
    """``torch.library.opcheck``: schema, fake tensors, autograd registration and AOT tracing of
    ``lintime::gau_fwd`` (packed, with a bias)."""
    from lintime.ops.gau.triton.gau import gau_fwd

    q, k, v, b, _ = _inputs(1, 20, 1, 8, 12, torch.float32, seed=7)
    q, k, v, b = (x.requires_grad_() for x in (q, k, v, b))
    cu = torch.tensor([0, 9, 20], dtype=torch.int32)
    torch.library.opcheck(gau_fwd.op, (q, k, v, b, cu, 0.3, True, default_launch(8, 12).to_ints()))


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_slab_fp16_half_precision_rule(causal, slab_calls):
    """The slab path in fp16 (scores, ``dS`` and the GEMMs' operands in fp16, fp32 accumulation) by the
    half-precision rule against the fp64 naive form."""
    q, k, v, b, do = _inputs(2, 45, 1, 16, 24, torch.float64, seed=8)
    kw = {"causal": causal, "scale": 16**-0.5}
    ref = _run("naive", q, k, v, b, do, **kw)
    half = [x.half() for x in (q, k, v, b, do)]
    base = _run("naive", *half, **kw)
    out = _run("triton", *half, launch=_path_launch("slab", 16, 24), **kw)
    assert slab_calls == [1, 1]
    for name in ref:
        assert out[name].dtype == torch.float16
        assert_half_rule(f"gau slab fp16 {name} (causal={causal})", ref[name], out[name], base[name])


@cpu_only
def test_slab_height_not_a_tile_multiple_and_longer_than_T(slab_calls):
    """A slab height that is no multiple of the tile (rounded down to one) and one taller than the sequence
    (one slab): both exact."""
    q, k, v, b, do = _inputs(1, 29, 1, 8, 8, torch.float32, seed=10)
    kw = {"causal": True, "scale": 0.3}
    ref = _run("naive", q, k, v, b, do, **kw)
    for slab in (40, 1000):
        launch = dataclasses.replace(_path_launch("slab", 8, 8), slab=slab)
        out = _run("triton", q, k, v, b, do, launch=launch, **kw)
        for name in ref:
            assert_exact(f"gau slab={slab} {name}", ref[name], out[name])
    assert slab_calls == [1, 1, 1, 1]


@cpu_only
def test_slab_falls_back_to_tiles_for_short_packed_and_wide_inputs(slab_calls):
    """Packed sequences of mixed lengths (no :func:`~lintime.ops.gau.triton.slab.one_length_run`; masked rows off)
    and ``S``
    wider than the slab kernels' tile take the tiled kernels even with ``slab`` set, and are still exact."""
    from lintime.ops.gau.triton.slab import MAX_S, slab_applies

    launch = dataclasses.replace(_path_launch("slab", 8, 6), slab_masked=0)
    assert slab_applies(launch, MAX_S, None) and not slab_applies(launch, MAX_S + 1, None)
    assert not slab_applies(launch, 8, torch.tensor([0, 3]))
    assert not slab_applies(dataclasses.replace(launch, slab=0), 8, None)
    lens = [13, 1, 0, 20]
    q, k, v, b, do = _inputs(1, sum(lens), 1, 8, 6, torch.float32, seed=3)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"causal": True, "scale": 0.3, "cu_seqlens": cu}
    ref, out = _run("naive", q, k, v, b, do, **kw), _run("triton", q, k, v, b, do, launch=launch, **kw)
    assert slab_calls == []
    for name in ref:
        assert_exact(f"gau packed with slab set {name}", ref[name], out[name])


def test_one_length_run_of_a_packed_call():
    """:func:`~lintime.ops.gau.triton.slab.one_length_run`: a packed call whose non-empty sequences all have one
    length is one ``[n, L]`` run from its first non-empty sequence's first token, whatever its size; mixed lengths,
    the slab path off or ``S`` too wide give none."""
    from lintime.ops.gau.triton.slab import one_length_run

    on = GauLaunch(slab=32, bm_slab=16)

    def run(lens, cfg=on, S=16):
        lens = torch.tensor(lens)
        return one_length_run(torch.cumsum(lens, 0) - lens, lens, cfg, S)

    assert run([0, 20, 20, 0, 20]) == (0, 3, 20)
    assert run([0, 0, 7]) == (0, 1, 7)
    assert run([40, 40, 7]) is None
    assert run([0, 0]) is None
    assert run([20, 20], dataclasses.replace(on, slab=0)) is None
    assert run([20, 20], S=300) is None


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_slab_packed_one_length_by_default(causal, slab_calls):
    """A packed call whose sequences all have one length (rows of one document each, an empty sequence between
    them: ``lintime bench model``'s batches) takes the slab path by default as one ``[n, L]`` batch: exact."""
    lens = [37, 37, 0, 37]
    q, k, v, b, do = _inputs(1, sum(lens), 2, 8, 16, torch.float32, seed=18)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"causal": causal, "scale": 0.3, "cu_seqlens": cu}
    ref, out = _run("naive", q, k, v, b, do, **kw), _run("triton", q, k, v, b, do, **kw)
    assert slab_calls == [1, 1]
    for name in ref:
        assert_exact(f"gau packed one length {name} (causal={causal})", ref[name], out[name])


@cpu_only
def test_slab_packed_one_length_fp16(slab_calls):
    """A packed call of one length with no empty sequence (3 x 64 tokens: one ``[3, 64]`` batch), fp16 by the
    half rule."""
    lens = [64, 64, 64]
    q, k, v, b, do = _inputs(1, sum(lens), 1, 16, 24, torch.float64, seed=16)
    cu = torch.tensor([0, 64, 128, 192], dtype=torch.int32)
    kw = {"causal": True, "scale": 0.25, "cu_seqlens": cu}
    ref = _run("naive", q, k, v, b, do, **kw)
    half = [x.half() for x in (q, k, v, b, do)]
    base = _run("naive", *half, **kw)
    out = _run("triton", *half, launch=_path_launch("slab", 16, 24), **kw)
    assert slab_calls == [1, 1]
    for name in ref:
        assert_half_rule(f"gau packed one length fp16 {name}", ref[name], out[name], base[name])


@cpu_only
def test_slab_opcheck_and_compile():
    """The custom ops with the slab path on: ``torch.library.opcheck`` of ``lintime::gau_fwd`` (fake tensors,
    autograd, AOT tracing) and a ``torch.compile`` (aot_eager) trace whose gradients equal the eager ones."""
    from lintime.ops.gau.triton import triton_gau_attention
    from lintime.ops.gau.triton.gau import gau_fwd

    launch = _path_launch("slab", 8, 12)
    q, k, v, b, do = _inputs(1, 35, 1, 8, 12, torch.float32, seed=11)  # two slabs, the last one partial
    leaves = [x.clone().requires_grad_() for x in (q, k, v, b)]
    torch.library.opcheck(gau_fwd.op, (*leaves[:4], None, 0.3, True, launch.to_ints()))

    def f(q, k, v, b):
        return triton_gau_attention(q, k, v, rel_bias=b, scale=0.3, launch=launch)

    torch._dynamo.reset()
    g1 = torch.autograd.grad(torch.compile(f, backend="aot_eager")(*leaves), leaves, do)
    leaves2 = [x.clone().requires_grad_() for x in (q, k, v, b)]
    g2 = torch.autograd.grad(f(*leaves2), leaves2, do)
    for a, c in zip(g2, g1):
        assert_exact("compiled slab grad", a, c)


# ------------------------------------------------------------------------ CUDA, real sizes

cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@cuda
@needs_cuda
@pytest.mark.parametrize("path", ["default", "tiled"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_real_size_half_rule(path, dtype, causal, slab_calls):
    """GAU's shape (H = 1, S = 128, E = 2048) at T = 1100 in half precision vs the fp64 naive: the default
    (the slab path for unpacked calls) and the tiled kernels."""
    B, T, H, S, E = 2, 1100, 1, 128, 2048
    q, k, v, b, do = _inputs(B, T, H, S, E, torch.float64, device="cuda", seed=1)
    q, k = q * 0.5, k * 0.5
    kw = {"causal": causal, "scale": 1.0 / 128}
    ref = _run("naive", q, k, v, b, do, **kw)
    half = [x.to(dtype) for x in (q, k, v, b, do)]
    base = _run("naive", *half, **kw)
    if path == "default":
        out = _run("triton", *half, **kw)
        assert slab_calls == [1, 1]  # the default takes the slab path at this shape
    else:
        out = _run("triton", *half, launch=_path_launch("tiled", S, E), **kw)
        assert slab_calls == []
    for name in ref:
        assert_half_rule(f"cuda gau {dtype} {name} (causal={causal})", ref[name], out[name], base[name])


@cuda
@needs_cuda
@pytest.mark.parametrize("S, E", [(160, 300), (128, 512)])
def test_cuda_fp32_exact_packed(S, E):
    """fp32 kernels (exact fp32 products) vs naive fp32: packed, two heads; S = 160 (two S tiles),
    E = 300, and S = 128, E = 512 -- a shape whose 16-bit inputs take the TMA path, which fp32 inputs
    do not (their 512-wide tiles' TMA buffers exceed the shared memory: the pointer path runs)."""
    from lintime.ops.gau.triton.gau import _tma
    dev = torch.device("cuda")
    assert not _tma(default_launch(S, E), S, E, dev, torch.float32)
    assert _tma(default_launch(S, E), S, E, dev, torch.bfloat16) == (
        S == 128 and torch.cuda.get_device_capability(dev)[0] >= 9)
    lens = [600, 1, 0, 333]
    q, k, v, b, do = _inputs(1, sum(lens), 2, S, E, torch.float32, device="cuda", seed=4)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kw = {"causal": True, "scale": S**-0.5, "cu_seqlens": cu}
    ref, out = _run("naive", q, k, v, b, do, **kw), _run("triton", q, k, v, b, do, **kw)
    for name in ref:
        assert_exact(f"cuda gau fp32 {name}", ref[name], out[name])


@cuda
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_slab_fp32_exact_two_heads(causal, slab_calls):
    """The slab path in fp32 (exact fp32 GEMMs and products) vs naive fp32: two heads (per-head strided GEMM
    operands), T = 1500 (several slabs, a partial last one), S = 96 (a padded score tile), E = 320."""
    q, k, v, b, do = _inputs(2, 1500, 2, 96, 320, torch.float32, device="cuda", seed=12)
    kw = {"causal": causal, "scale": 96**-0.5}
    ref = _run("naive", q, k, v, b, do, **kw)
    out = _run("triton", q, k, v, b, do, launch=_path_launch("slab", 96, 320), **kw)
    assert slab_calls == [1, 1]
    for name in ref:
        assert_exact(f"cuda gau slab fp32 {name} (causal={causal})", ref[name], out[name])


def _cuda_packed_bf16(lens, causal, seed):
    """A packed call of ``lens`` at GAU's widths (S = 128, E = 2048) on CUDA: its keywords, the fp64 naive results
    and the bf16 inputs (for the half-precision rule)."""
    q, k, v, b, do = _inputs(1, sum(lens), 1, 128, 2048, torch.float64, device="cuda", seed=seed)
    q, k = q * 0.5, k * 0.5
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kw = {"causal": causal, "scale": 1.0 / 128, "cu_seqlens": cu}
    return kw, _run("naive", q, k, v, b, do, **kw), [x.bfloat16() for x in (q, k, v, b, do)]


@cuda
@needs_cuda
def test_cuda_packed_one_length_half_rule(slab_calls):
    """A packed bf16 call of two 1100-token sequences at GAU's shape (one length: one ``[2, 1100]`` batch by the
    slab path, by default).  Output and every gradient by the half rule."""
    kw, ref, half = _cuda_packed_bf16([1100, 1100], True, seed=17)
    base, out = _run("naive", *half, **kw), _run("triton", *half, **kw)
    assert slab_calls == [1, 1]
    for name in ref:
        assert_half_rule(f"cuda gau packed one length {name}", ref[name], out[name], base[name])


@cuda
@needs_cuda
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_masked_rows_half_rule(causal, slab_calls):
    """A training-like packed batch (``[1, 4096]``: rows of 1024, one split into 333 + 1 + 0 + 690 tokens) at GAU's
    widths in bf16 takes the masked slab path by default (the work rule) and meets the half-precision rule."""
    kw, ref, half = _cuda_packed_bf16([1024, 333, 1, 0, 690, 1024, 1024], causal, seed=23)
    base, out = _run("naive", *half, **kw), _run("triton", *half, **kw)
    assert slab_calls == [1, 1]
    for name in ref:
        assert_half_rule(f"cuda gau masked rows {name} (causal={causal})", ref[name], out[name], base[name])


@cuda
@needs_cuda
def test_cuda_dispatch_picks_triton(impl_calls):
    import lintime.ops.gau as gau_module

    calls = impl_calls(gau_module, "triton")
    q, k, v, b, _ = _inputs(1, 64, 1, 16, 16, torch.bfloat16, device="cuda")
    gau_attention(q, k, v, rel_bias=b, scale=0.25)
    assert calls == [1]


def test_slab_rows_rule():
    """The slab height: a multiple of the score tile, no taller than ``T`` rounded up to one tile nor than the larger
    of ``slab`` and ``slab_max``; ``slab`` (rounded to the tile) up to 4096 tokens, non-decreasing in ``T``, and
    growing only with ``slab_max`` (then reaching it on long sequences)."""
    from lintime.ops.gau.triton.slab import slab_rows

    Ts = (1, 63, 64, 65, 300, 4096, 4097, 16384, 16385, 1 << 16, 1 << 20)
    for cfg in (GauLaunch(slab=512, slab_max=2048, bm_slab=64), GauLaunch(slab=512, slab_max=0, bm_slab=64),
                GauLaunch(slab=600, slab_max=0, bm_slab=64), GauLaunch(), default_launch(16, 32)):
        bm, prev = cfg.bm_slab, 0
        if not cfg.slab:
            continue
        for T in Ts:
            R = slab_rows(T, cfg)
            assert R % bm == 0 and bm <= R <= max(bm, -(-T // bm) * bm), (T, R)
            assert R <= max(cfg.slab, cfg.slab_max) and R >= prev, (T, R)
            if T <= 4096 or not cfg.slab_max:
                assert R == max(bm, min(cfg.slab // bm * bm, -(-T // bm) * bm)), (T, R)
            prev = R
        if cfg.slab_max > cfg.slab:
            assert slab_rows(1 << 30, cfg) == cfg.slab_max // bm * bm


@cpu_only
@pytest.mark.parametrize("causal", [True, False])
def test_slab_never_holds_a_TxT_tensor(causal, slab_calls):
    """The slab path's memory is linear in ``T``: no tensor any torch op produces during its forward and backward
    (buffers of scores, GEMM outputs, gradients, bias tiles) has more than ``B T max(R, H S, H E)`` elements, far
    below ``T x T`` (the dense matrix the naive form shows the probe)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for x in out if isinstance(out, (tuple, list)) else (out,):
                # (floating tensors: the interpreter moves kernel arguments through byte copies of their storage)
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    Largest.largest = max(Largest.largest, x.numel())
            return out

    B, T, H, S, E, R = 1, 128, 1, 8, 8, 32  # the bound (B T max(R, H S, H E)) is T / 4 of T x T
    q, k, v, b, do = _inputs(B, T, H, S, E, torch.float32, seed=14)
    launch = dataclasses.replace(_path_launch("slab", S, E), slab=R)
    with Largest():
        _run("triton", q, k, v, b, do, launch=launch, causal=causal, scale=0.3)
    slab_peak, Largest.largest = Largest.largest, 0
    with Largest():
        _run("naive", q, k, v, b, do, causal=causal, scale=0.3)
    assert slab_calls == [1, 1]
    assert Largest.largest >= T * T  # the probe sees the dense matrix when there is one
    assert 0 < slab_peak <= B * T * max(R, H * S, H * E), slab_peak
