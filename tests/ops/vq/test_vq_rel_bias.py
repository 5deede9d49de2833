"""vq_attention's ``rel_bias = (qv, r)``: the window bias given as a relative table equals the dense ``[B, T, H, 2L]``
bias built position by position from the definition (the key at distance ``m = i - j`` gets ``qv_i . r[m]`` for
``0 <= m <= L``), in every form -- output, final state and the gradients of ``q``, ``v``, ``qv`` and ``r`` -- with
packing, states mid-block and at block ends (fp64 for the PyTorch forms; fp32 for the Triton interpreter, exact
rule).  And :func:`lintime.ops.vq.bias.rel_window`, the strided shift, equals its definition with its gradient."""

import pytest
import torch
from test_vq import FIELDS, FLOAT_FIELDS, _gather, _inputs, _make_state, _state

from lintime.ops import vq_attention
from lintime.ops.vq.bias import dense_rel_bias, rel_window, token_offsets
from tolerances import assert_exact, assert_half_rule

CUDA = torch.cuda.is_available()


def _definition_bias(qv, r, L, lens, pos0):
    """``[B, T, H, 2L]`` from the definition, token by token (``lens`` the packed lengths of row 0, or ``None``:
    each row one sequence; ``pos0`` the sequences' initial positions)."""
    B, T, H, _ = qv.shape
    rows = []
    for b in range(B):
        seq = [(b, t) for t in range(T)] if lens is None else [
            (n, t) for n, ln in enumerate(lens) for t in range(ln)]
        out = []
        for i, (n, t) in enumerate(seq):
            a = (pos0[n] + t) % L
            cols = [(qv[b, i] * r[L + a - c]).sum(-1) if 0 <= L + a - c <= L else qv.new_zeros(H)
                    for c in range(2 * L)]
            out.append(torch.stack(cols, -1))  # [H, 2L]
        rows.append(torch.stack(out))
    return torch.stack(rows)


def _run(backend, inp, qv, r, L, dense, lens=None, sd=None, device="cpu"):
    """One call and the gradients of its float leaves; ``dense``: ``"definition"`` (the loop above), ``"gather"``
    (:func:`dense_rel_bias`, the reference forms' path) or ``False`` (``rel_bias``)."""
    leaves = {"q": inp["q"], "v": inp["v"], "codebook": inp["codebook"], "qv": qv, "r": r}
    leaves = {k: x.detach().to(device).requires_grad_() for k, x in leaves.items()}
    inp = {**inp, "codes": inp["codes"].to(device)}
    sd = None if sd is None else {k: x.to(device) for k, x in sd.items()}
    B = inp["q"].shape[0]
    pos0 = [0] * (B if lens is None else len(lens)) if sd is None else sd["pos"].tolist()
    cu = None if lens is None else torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device)
    state = None if sd is None else _make_state(sd, leaves["codebook"].detach())
    if dense == "definition":
        kw = dict(bias=_definition_bias(leaves["qv"], leaves["r"], L, lens, pos0))
    elif dense == "gather":
        off = token_offsets(B, inp["q"].shape[1], L, cu, None if sd is None else sd["pos"], device)
        kw = dict(bias=dense_rel_bias(leaves["qv"], leaves["r"], off))
    else:
        kw = dict(rel_bias=(leaves["qv"], leaves["r"]))
    o, fin = vq_attention(leaves["q"], _gather(leaves["codebook"], inp["codes"]), inp["codes"], leaves["v"],
                          leaves["codebook"], block_len=L, initial_state=state, output_final_state=True,
                          cu_seqlens=cu, backend=backend, **kw)
    g = torch.Generator().manual_seed(3)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(device)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o, fin, dict(zip(leaves, grads))


def _same(name, a, b):
    assert_exact(f"{name} o", a[0], b[0])
    for f in FIELDS:
        x, y = getattr(a[1], f), getattr(b[1], f)
        if f in FLOAT_FIELDS:
            assert_exact(f"{name} state.{f}", x, y)
        else:
            assert torch.equal(x, y), (name, f)
    for k in a[2]:
        assert_exact(f"{name} d{k}", a[2][k], b[2][k])


CASES = [  # B, T, lens (packed row 0), state positions (None: no state)
    (2, 21, None, None),
    (2, 13, None, [11, 4]),  # mid-block states, one with a previous block
    (1, 23, [9, 14], [3, 8]),  # packed sequences continuing states, one at a block end
]


@pytest.mark.parametrize("backend", ["naive", "chunk", "recurrent"])
@pytest.mark.parametrize("B, T, lens, pos", CASES)
def test_relative_table_is_the_dense_bias(backend, B, T, lens, pos):
    H, K, V, S, L = 2, 6, 5, 7, 4
    dt = torch.float64
    inp = _inputs(B, T, H, K, V, S, L, dt, seed=B + T)
    g = torch.Generator().manual_seed(T)
    qv = torch.randn(B, T, H, K, generator=g, dtype=dt)
    r = torch.randn(L + 1, H, K, generator=g, dtype=dt) * 0.5
    sd = None if pos is None else _state(pos, H, K, V, S, L, dt)
    _same(f"{backend} {lens} {pos}", _run(backend, inp, qv, r, L, "definition", lens, sd),
          _run(backend, inp, qv, r, L, False, lens, sd))


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
@pytest.mark.parametrize("B, T, lens, pos", [(1, 45, None, None), (1, 41, [9, 32], [3, 16])])
def test_triton_relative_table_is_the_dense_bias(B, T, lens, pos):
    """Through the interpreter (16-wide tiles: L = 20 crosses query and window tiles), fp32, exact rule."""
    pytest.importorskip("triton")
    H, K, V, S, L = 1, 16, 24, 10, 20
    dt = torch.float32
    inp = _inputs(B, T, H, K, V, S, L, dt, seed=T)
    g = torch.Generator().manual_seed(T)
    qv = torch.randn(B, T, H, K, generator=g).to(dt)
    r = (torch.randn(L + 1, H, K, generator=g) * 0.5).to(dt)
    sd = None if pos is None else _state(pos, H, K, V, S, L, dt)
    _same("triton", _run("triton", inp, qv, r, L, "definition", lens, sd),
          _run("triton", inp, qv, r, L, False, lens, sd))


def test_rel_window_is_its_definition():
    g = torch.Generator().manual_seed(0)
    NQ, L, H = 3, 5, 2
    qr = torch.randn(NQ, L, H, L + 1, generator=g, dtype=torch.float64, requires_grad=True)
    want = torch.zeros(NQ, L, H, 2 * L, dtype=torch.float64)
    for a in range(L):
        for c in range(2 * L):
            if 0 <= c - a <= L:
                want[:, a, :, c] = qr[:, a, :, c - a].detach()
    out = rel_window(qr)
    assert torch.equal(out, want)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (d,) = torch.autograd.grad((out * w).sum(), qr)
    want_d = torch.stack([w[:, a, :, a:a + L + 1] for a in range(L)], 1)
    assert torch.equal(d, want_d)


@pytest.mark.parametrize("L", [5, 7])  # L + 1 = 6 pads to 8; 8 needs no padding
def test_padded_table_is_the_table_then_zeros(L):
    from lintime.ops.vq.bias import rel_table, rel_table_padded

    g = torch.Generator().manual_seed(1)
    qv = torch.randn(2, 3, 2, 4, generator=g, dtype=torch.float64)
    r = torch.randn(L + 1, 2, 4, generator=g, dtype=torch.float64)
    out = rel_table_padded(qv, r)
    assert out.shape[-1] % 8 == 0 and out.shape[-1] >= L + 1
    assert torch.equal(out[..., :L + 1], rel_table(qv, r)) and (out[..., L + 1:] == 0).all()


def _cuda_inputs(B, T, H, K, V, S, L, dtype, seed):
    inp = _inputs(B, T, H, K, V, S, L, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    qv = (torch.randn(B, T, H, K, generator=g) * K**-0.5).to(dtype)
    r = (torch.randn(L + 1, H, K, generator=g) * K**-0.5).to(dtype)
    return inp, qv, r


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("B, T, lens, pos", [(2, 512, None, None), (1, 700, [300, 400], [70, 256])])
def test_cuda_fp32_relative_table_is_the_dense_bias(B, T, lens, pos):
    """The compiled kernels, fp32: rows of whole blocks (the training call's layout) and packed rows from states;
    exact rule against the gathered dense bias (equal to the definition by the CPU tests)."""
    H, K, V, S, L = 1, 64, 192, 64, 128
    inp, qv, r = _cuda_inputs(B, T, H, K, V, S, L, torch.float32, seed=T)
    sd = None if pos is None else _state(pos, H, K, V, S, L, torch.float32)
    _same("cuda fp32", _run("triton", inp, qv, r, L, "gather", lens, sd, "cuda"),
          _run("triton", inp, qv, r, L, False, lens, sd, "cuda"))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_vq_base_bf16_relative_table():
    """bf16 at the vq-base shape (K = 128, V = 1536, S = L = 512), two rows of 2048 tokens: the half rule against
    the fp64 chunked form with the dense bias, the base being the bf16 kernels given the dense bias."""
    B, T, H, K, V, S, L = 2, 2048, 1, 128, 1536, 512, 512
    inp, qv, r = _cuda_inputs(B, T, H, K, V, S, L, torch.bfloat16, seed=1)
    to64 = {k: x.double() if x.is_floating_point() else x for k, x in inp.items()}
    ref = _run("chunk", to64, qv.double(), r.double(), L, "gather", device="cuda")
    base = _run("triton", inp, qv, r, L, "gather", device="cuda")
    out = _run("triton", inp, qv, r, L, False, device="cuda")
    assert_half_rule("bf16 o", ref[0], out[0], base[0])
    for k in ref[2]:
        assert_half_rule(f"bf16 d{k}", ref[2][k], out[2][k], base[2][k])
