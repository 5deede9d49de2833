"""``vq_decode_step_``: one Transformer-VQ token, the state updated in place.

Chain: the in-place PyTorch composite (``backend="recurrent"``) equals ``vq_attention`` on one token with a state
(the op's own decoding call; fp64, exact rule), and the fused kernels (``backend="triton"``, through the
interpreter on the CPU) equal the composite token by token -- output and every state field -- in fp32 (exact rule)
and fp16 / bf16 (half rule against the fp64 composite), over tokens that cross block ends with and without a
previous block, rows at different positions (a packed prefill), with and without the window bias and the relative
table, several heads, key splits and value tiles (partial ones too), score blocks across the window's end.  On CUDA
the same at the vq-base shape in bf16.
"""

from __future__ import annotations

import pytest
import torch

from lintime.ops import VQState, vq_attention, vq_decode_step_
from tolerances import assert_close, assert_exact, assert_half_rule

FIELDS = ("cache_mean", "cache_count", "k_hat", "v", "codes", "pos")


def _tokens(g, N, T, H, K, V, S, L, cb, dtype):
    q = (torch.randn(N, T, H, K, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    z = torch.randint(0, S, (N, T, H), generator=g)
    k_hat = cb[torch.arange(H)[None, None].expand(N, T, H), z].to(dtype)
    v = torch.randn(N, T, H, V, generator=g, dtype=torch.float64).to(dtype)
    bias = (0.3 * torch.randn(N, T, H, 2 * L, generator=g, dtype=torch.float64)).to(dtype)
    return q, k_hat, z, v, bias


def _prefilled(g, H, K, V, S, L, cb, dtype, lens=(11, 5)):
    """A state of len(lens) sequences at positions ``lens`` (a packed call: rows at different positions)."""
    T = sum(lens)
    q, k_hat, z, v, bias = _tokens(g, 1, T, H, K, V, S, L, cb, dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    _, st = vq_attention(q, k_hat, z, v, cb, block_len=L, bias=bias, cu_seqlens=cu, output_final_state=True,
                         initial_state=VQState.initial(len(lens), H, S, K, V, L, dtype=dtype), backend="chunk")
    return st


def _copy(st: VQState, dtype=None) -> VQState:
    return VQState(*(getattr(st, f).clone() if dtype is None or not getattr(st, f).is_floating_point()
                     else getattr(st, f).to(dtype) for f in FIELDS))


def test_composite_equals_the_op_on_one_token():
    g = torch.Generator().manual_seed(0)
    H, K, V, S, L = 2, 8, 6, 7, 4
    cb = torch.randn(H, S, K, generator=g, dtype=torch.float64)
    st = _prefilled(g, H, K, V, S, L, cb, torch.float64, lens=(6, 3))
    ref, mine = _copy(st), _copy(st)
    for t in range(9):  # positions 6..14 and 3..11: block ends with and without a previous block
        q, k_hat, z, v, bias = _tokens(g, 2, 1, H, K, V, S, L, cb, torch.float64)
        o_ref, ref = vq_attention(q, k_hat, z, v, cb, block_len=L, bias=bias, initial_state=ref,
                                  output_final_state=True, backend="recurrent")
        kept = [getattr(mine, f) for f in FIELDS]
        o = vq_decode_step_(q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb, mine, bias=bias[:, 0], backend="recurrent")
        assert all(getattr(mine, f) is x for f, x in zip(FIELDS, kept))  # in place: the same tensors
        assert_exact(f"token {t} o", o_ref[:, 0], o)
        for f in FIELDS:
            assert_exact(f"token {t} {f}", getattr(ref, f).double(), getattr(mine, f).double())


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("bias, H, V", [(True, 2, 16), (False, 1, 24)])
def test_fused_step_equals_the_composite_fp32(bias, H, V):
    g = torch.Generator().manual_seed(1)
    K, S, L = 16, 20, 8  # two code tiles of the interpreter's 16 (and two value tiles for V = 24)
    cb = torch.randn(H, S, K, generator=g) * 0.5
    st = _prefilled(g, H, K, V, S, L, cb, torch.float32)
    ref, fused = _copy(st), _copy(st)
    for t in range(12):  # positions 11..22 (a block end at 15) and 5..16 (at 7 without a previous block, at 15)
        q, k_hat, z, v, b = _tokens(g, 2, 1, H, K, V, S, L, cb, torch.float32)
        b = b[:, 0] if bias else None
        o_ref = vq_decode_step_(q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb, ref, bias=b, backend="recurrent")
        o = vq_decode_step_(q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb, fused, bias=b, backend="triton")
        assert_exact(f"token {t} o", o_ref, o)
        for f in FIELDS:
            assert_exact(f"token {t} {f}", getattr(ref, f).double(), getattr(fused, f).double())
    assert fused.pos.tolist() == [23, 17]


def _half_steps(g, st, cb, H, K, V, S, L, dtype, steps):
    """``steps`` tokens of 2 rows from ``st`` (half-precision window, fp32 cache) through the fused step and the
    composite in ``dtype`` and fp64: the fused output within the half rule, the states equal to the composite's."""
    dev = st.pos.device
    ref64, ref16, fused = _copy(st, torch.float64), _copy(st), _copy(st)
    for t in range(steps):
        q, k_hat, z, v, b = (x.to(dev) for x in _tokens(g, 2, 1, H, K, V, S, L, cb.cpu(), dtype))
        args = (q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0])
        o64 = vq_decode_step_(*(x.double() if x.is_floating_point() else x for x in args), cb.double(), ref64,
                              bias=b[:, 0].double(), backend="recurrent")
        o16 = vq_decode_step_(*args, cb, ref16, bias=b[:, 0], backend="recurrent")
        o = vq_decode_step_(*args, cb, fused, bias=b[:, 0], backend="triton")
        assert_half_rule(f"token {t} o", o64, o, o16)
        assert torch.equal(ref16.codes, fused.codes) and torch.equal(ref16.pos, fused.pos)
        assert torch.equal(ref16.k_hat, fused.k_hat) and torch.equal(ref16.v, fused.v)
        assert_exact(f"token {t} cache_count", ref16.cache_count, fused.cache_count)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_step_half_rule(dtype):
    """fp16 / bf16 window buffers and inputs, fp32 cache: the fused output within the half rule of the composite
    in ``dtype``, both against the fp64 composite from the same (rounded) inputs; the states stay equal to the
    composite's."""
    g = torch.Generator().manual_seed(2)
    H, K, V, S, L = 1, 16, 32, 16, 8
    cb = torch.randn(H, S, K, generator=g) * 0.5
    st = _prefilled(g, H, K, V, S, L, cb, dtype, lens=(7, 12))
    _half_steps(g, st, cb, H, K, V, S, L, dtype, 12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("splits, L, bias", [(1, 8, False), (2, 6, True), (5, 8, True)])
def test_key_splits_equal_the_composite(splits, L, bias):
    """The values kernel's key splits (flash-decoding: each split's share of the output summed by the combine
    kernel; 1 = one program per value tile walks every key) equal the composite: splits inside the window, inside
    the cache and across both, with the relative bias (and the dense bias beside it), across block ends, two value
    tiles (one partial) (fp32, exact rule, interpreter).  ``L = 6``: the scores kernel's 16-key blocks and the
    splits' chunks cross from the window's 12 slots into the codes."""
    from lintime.ops.vq.triton.decode import triton_decode_step_

    g = torch.Generator().manual_seed(8)
    H, K, V, S = 1, 16, 24, 20  # 2L + S = 36 or 32 keys; heads are test_fused_step_equals_the_composite_fp32's
    cb = torch.randn(H, S, K, generator=g) * 0.5
    st = _prefilled(g, H, K, V, S, L, cb, torch.float32)
    ref, fused = _copy(st), _copy(st)
    r = torch.randn(L + 1, H, K, generator=g) * 0.3
    for t in range(6):  # L = 8: positions 11..16 (a block end at 15) and 5..10 (at 7); L = 6: block ends at 11, 5
        q, k_hat, z, v, b = _tokens(g, 2, 1, H, K, V, S, L, cb, torch.float32)
        qv = torch.randn(2, H, K, generator=g)
        args = (q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb)
        b = b[:, 0] if bias else None
        o_ref = vq_decode_step_(*args, ref, bias=b, rel_bias=(qv, r), backend="recurrent")
        o = triton_decode_step_(*args, fused, bias=b, rel_bias=(qv, r), splits=splits)
        assert_exact(f"splits {splits} token {t} o", o_ref, o)
        for f in FIELDS:
            assert_exact(f"splits {splits} token {t} {f}", getattr(ref, f).double(), getattr(fused, f).double())


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
def test_relative_bias_is_the_dense_window_bias():
    """``rel_bias = (qv, r)`` equals passing the dense ``[N, H, 2L]`` bias built position by position from the
    definition (distance ``m = L + pos % L - j`` in ``[0, L]``; fp64 composite), and the fused step with the
    table equals the composite with it (fp32, exact rule; rows at different positions, across a block end)."""
    g = torch.Generator().manual_seed(5)
    H, K, V, S, L = 2, 16, 16, 20, 8
    cb = torch.randn(H, S, K, generator=g) * 0.5
    st = _prefilled(g, H, K, V, S, L, cb, torch.float32)
    dense, table = _copy(st, torch.float64), _copy(st, torch.float64)
    ref, fused = _copy(st), _copy(st)
    r = torch.randn(L + 1, H, K, generator=g, dtype=torch.float64) * 0.3
    for t in range(6):  # positions 11..16 (a block end at 15) and 5..10 (at 7)
        q, k_hat, z, v, _ = _tokens(g, 2, 1, H, K, V, S, L, cb, torch.float64)
        qv = torch.randn(2, H, K, generator=g, dtype=torch.float64)
        bias = torch.zeros(2, H, 2 * L, dtype=torch.float64)
        for n in range(2):
            a = int(dense.pos[n]) % L
            for j in range(2 * L):
                if 0 <= L + a - j <= L:
                    bias[n, :, j] = (qv[n] * r[L + a - j]).sum(-1)
        args = (q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0])
        o_dense = vq_decode_step_(*args, cb.double(), dense, bias=bias, backend="recurrent")
        o_table = vq_decode_step_(*args, cb.double(), table, rel_bias=(qv, r), backend="recurrent")
        assert_exact(f"token {t} o, table vs dense", o_dense, o_table)
        args32 = [x.float() if x.is_floating_point() else x for x in args]
        o_ref = vq_decode_step_(*args32, cb, ref, rel_bias=(qv.float(), r.float()), backend="recurrent")
        o = vq_decode_step_(*args32, cb, fused, rel_bias=(qv.float(), r.float()), backend="triton")
        assert_exact(f"token {t} o, fused", o_ref, o)
        for f in FIELDS:
            assert_exact(f"token {t} {f}", getattr(ref, f).double(), getattr(fused, f).double())


def test_checks():
    g = torch.Generator().manual_seed(3)
    H, K, V, S, L = 1, 4, 4, 3, 2
    cb = torch.randn(H, S, K, generator=g)
    st = VQState.initial(2, H, S, K, V, L)
    q, k_hat, z, v, b = _tokens(g, 2, 1, H, K, V, S, L, cb, torch.float32)
    with pytest.raises(ValueError, match="q must have shape"):
        vq_decode_step_(q[:1, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb, st)
    with pytest.raises(TypeError, match="share a floating dtype"):
        vq_decode_step_(q[:, 0].double(), k_hat[:, 0], z[:, 0], v[:, 0], cb, st)
    with pytest.raises(ValueError, match="bias must have shape"):
        vq_decode_step_(q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb, st, bias=b[:, 0, :, :1])
    with pytest.raises(TypeError, match="VQState"):
        vq_decode_step_(q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb, None)
    with pytest.raises(ValueError, match="rel_bias r must have shape"):
        vq_decode_step_(q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0], cb, st, rel_bias=(q[:, 0], torch.zeros(L, H, K)))


@pytest.mark.cuda
def test_fused_step_cuda_bf16_vq_base_shape():
    """vq-base's layer shape (H = 1, K = 128, V = 1536, S = L = 512) in bf16 with an fp32 cache, 6 tokens across a
    block end: the fused step against the composite (half rule against the fp64 composite), states equal."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(4)
    H, K, V, S, L = 1, 128, 1536, 512, 512
    cb = (torch.randn(H, S, K, generator=g) * K**-0.25).to(dev)
    st = _prefilled(g, H, K, V, S, L, cb.cpu(), torch.bfloat16, lens=(1533, 700)).to(dev)
    _half_steps(g, st, cb, H, K, V, S, L, torch.bfloat16, 6)  # the first row completes its block at 1535


@pytest.mark.cuda
def test_fused_step_cuda_bf16_batch1_relative_bias():
    """Batch 1 at the vq-base shape with the relative bias: the attention's keys split over many programs (the
    combine kernel merges them); half rule against the fp64 composite, window and codes equal."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(6)
    H, K, V, S, L = 1, 128, 1536, 512, 512
    cb = (torch.randn(H, S, K, generator=g) * K**-0.25).to(dev)
    st = _prefilled(g, H, K, V, S, L, cb.cpu(), torch.bfloat16, lens=(1534,)).to(dev)
    ref64, ref16, fused = _copy(st, torch.float64), _copy(st), _copy(st)
    r = (torch.randn(L + 1, H, K, generator=g) * K**-0.5).to(torch.bfloat16).to(dev)
    for t in range(4):  # completes the block at position 1535
        q, k_hat, z, v, _ = (x.to(dev) for x in _tokens(g, 1, 1, H, K, V, S, L, cb.cpu(), torch.bfloat16))
        qv = (torch.randn(1, H, K, generator=g) * 0.5).to(torch.bfloat16).to(dev)
        args = (q[:, 0], k_hat[:, 0], z[:, 0], v[:, 0])
        o64 = vq_decode_step_(*(x.double() if x.is_floating_point() else x for x in args), cb.double(), ref64,
                              rel_bias=(qv.double(), r.double()), backend="recurrent")
        o16 = vq_decode_step_(*args, cb, ref16, rel_bias=(qv, r), backend="recurrent")
        o = vq_decode_step_(*args, cb, fused, rel_bias=(qv, r), backend="triton")
        assert_half_rule(f"token {t} o", o64, o, o16)
        assert torch.equal(ref16.codes, fused.codes) and torch.equal(ref16.k_hat, fused.k_hat)


# ---------------------------------------------------------------------------------------------
# the layer: a static state takes the fused step in eval mode, in place; other calls keep the op's path


def _tiny_vq():
    import dataclasses

    from lintime.models import CausalLM, get_preset

    cfg = get_preset("vq-tiny", vocab_size=64, n_layers=2)
    cfg = dataclasses.replace(cfg, d_model=32, mixer=dataclasses.replace(cfg.mixer, n_codes=16, block_len=4, d_k=16))
    torch.manual_seed(0)
    return CausalLM(cfg).eval()


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
@pytest.mark.parametrize("autocast", [False, True])
def test_static_decoding_takes_the_fused_step_and_gives_the_eager_tokens(autocast, eager_and_static_decode):
    """Greedy decoding of 2 rows through ``StaticDecoder`` with the fused step (interpreter) against the eager
    decoding (the op's recurrent form, a new state per token): tokens equal, logits by the exact rule; every layer
    of every step took the fused op and returned the state it was given.  ``autocast``: fp32 weights under fp16
    autocast (how ``lintime bench model`` decodes), fp16 window buffers; both forms round an fp32 attention output
    (summed in different orders) to fp16, so the logits' rule is fp16's: 2^-10 relative RMS."""
    import contextlib

    from lintime.layers.vq import VQAttention

    m = _tiny_vq()
    ids = torch.tensor([[3, 14, 15, 9, 26], [5, 35, 8, 9, 7]])
    steps = 9  # positions 5..13: two block ends (L = 4), the cache in use
    calls = []
    real = VQAttention._fused_step
    VQAttention._fused_step = lambda self, *a: real(self, *a) and not calls.append(1)  # counts the fused steps
    ctx = torch.autocast("cpu", dtype=torch.float16) if autocast else contextlib.nullcontext()
    try:
        with torch.no_grad(), ctx:
            eager, ref, fused, out, dec = eager_and_static_decode(m, ids, steps)
    finally:
        VQAttention._fused_step = real
    assert len(calls) == steps * len(m.backbone.blocks)
    assert torch.equal(eager, fused)
    ref, out = ref.float(), out.float()
    if autocast:  # both compute in fp32 and round the attention output to fp16: a few ulps (2^-11) apart
        assert_close("logits", ref, out, 2.0**-10)
    else:
        assert_exact("logits", ref, out)
    assert dec.state.offset.tolist() == [ids.shape[1] + steps] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU tensors)")
def test_layer_keeps_the_op_path_where_the_fused_step_does_not_apply():
    """A non-static state, the CPU without backend='triton', training mode (the EMA update) and gradients take
    the op's path: a new state object."""
    m = _tiny_vq()
    layer = m.backbone.blocks[0].mixer
    x = torch.randn(2, 1, 32)
    pos = torch.zeros(2, 1, dtype=torch.long)
    static = layer.init_state(2, "cpu", torch.float32).with_capacity(8)
    with torch.no_grad():
        assert layer(x, layer.init_state(2, "cpu", torch.float32), positions=pos)[1] is not None
        _, new = layer(x, static, positions=pos)  # CPU, backend None
        assert new is not static
        layer.backend = "triton"
        _, new = layer(x, static, positions=pos)
        assert new is static
        layer.train()
        _, new = layer(x, static, positions=pos)
        assert new is not static
        layer.eval()
    x.requires_grad_(True)
    _, new = layer(x, static, positions=pos)
    assert new is not static


def _quantize_case(seed, N, tie_code, dtype):
    """Keys ``[N, 1, 2, 24]`` in ``dtype`` and a ``[2, 37, 24]`` codebook (partial tiles) whose code ``tie_code``
    repeats the first key's nearest codeword (a tie, placed later); the PyTorch quantize's results on them and
    ``(k, codebook, ||codebook||^2)`` on the test device."""
    from lintime.layers.vq import VQAttention

    g = torch.Generator().manual_seed(seed)
    H, K, S = 2, 24, 37
    cb = torch.randn(H, S, K, generator=g)
    k = (torch.randn(N, 1, H, K, generator=g) * 1.2).to(dtype)
    codes_ref, _, _ = VQAttention.quantize(k, cb)
    cb[:, tie_code] = cb[torch.arange(H), codes_ref[0, 0]]
    ref = VQAttention.quantize(k, cb)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    return ref, (k[:, 0].to(dev), cb.to(dev), cb.pow(2).sum(-1)[:, None, :].to(dev))


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_kernel_equals_the_layer_quantize(dtype, splits):
    """The decoding step's quantisation kernels (distances, first argmin, the codeword in the keys' dtype) equal
    the layer's PyTorch quantize: codes equal, k_hat bit for bit; two heads, 37 codes (partial tiles), the codes
    walked by one program or split over 3 and merged (a tie between splits keeps the first index: a copy of an
    earlier codeword placed later, in the last split)."""
    pytest.importorskip("triton")
    from lintime.ops.vq.triton.quantize import quantize_step

    (codes_ref, k_hat_ref, _), args = _quantize_case(9, 5, 30, dtype)
    codes, k_hat = quantize_step(*args, splits)
    assert torch.equal(codes.cpu(), codes_ref[:, 0]) and codes.dtype == torch.long
    assert torch.equal(k_hat.cpu(), k_hat_ref[:, 0]) and k_hat.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_assign_kernel_equals_the_pytorch_quantize(dtype):
    """The many-token quantisation kernel (the layer's path for CUDA keys: tensor-core distances, first argmin,
    the fp32 codeword) equals the PyTorch quantize (fp32 GEMM, argmin, gather): codes equal, ``c_z`` bit for bit;
    two heads, 70 rows and 37 codes (partial tiles), a tie across code tiles keeps the first index.  The CPU runs
    it through the interpreter; on CUDA it is the compiled kernel with TF32x3 products."""
    pytest.importorskip("triton")
    from lintime.ops.vq.triton.quantize import assign_codes

    (codes_ref, _, cz_ref), args = _quantize_case(10, 70, 33, dtype)
    codes, c_z = assign_codes(*args)
    assert codes.dtype == torch.long and c_z.dtype == torch.float32
    assert torch.equal(codes.cpu(), codes_ref[:, 0]) and torch.equal(c_z.cpu(), cz_ref[:, 0])
