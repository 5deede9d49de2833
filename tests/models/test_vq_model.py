"""Family ``vq`` (Transformer-VQ): the layer against seed Definition 3.1 written out as a dense
quadratic formula, parallel == prefill + decoding across block boundaries with packing, the EMA
k-means codebook (training mode only, towards the assigned keys, exact update rule), the
commitment loss (value, gradient to k only), straight-through key gradients (exact inside the
window; the seed's detached codebook beyond it), a constant-size decoding state, the 190M preset
against the paper, config validation, training.

(Not ``test_vq.py``: that basename belongs to ``tests/ops/`` and pytest's default import mode
refuses two test modules with one basename.)"""

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

from lintime.layers.vq import VQAttention, VQAttentionState
from lintime.models import CausalLM, MaskedLM, ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from lintime.models.families.vq import VQConfig
from tolerances import assert_close, assert_exact
from model_helpers import check_packed_decode_and_select, decode_in_pieces, packed, state_numel

V = BYTE_VOCAB


def cfg(**mixer) -> ModelConfig:
    """A small 2-layer Transformer-VQ (d=32, D_v=64, d_k=8, S=8 codes, L=4) with the given options."""
    return ModelConfig(vocab_size=V, d_model=32, n_layers=2, family="vq",
                       mixer=VQConfig(**{"n_codes": 8, "block_len": 4, "d_k": 8, **mixer}), ffn=None,
                       norm="rmsnorm", final_norm=False, tie_embeddings=False)


_MODELS = {}


def model(config, dtype=torch.float64):
    key = (config.to_json(), dtype)
    if key not in _MODELS:
        torch.manual_seed(1)
        m = CausalLM(config).to(dtype).eval()
        with torch.no_grad():  # non-zero XL biases, so the tests see them
            for blk in m.backbone.blocks:
                if blk.mixer.xl_u is not None:
                    blk.mixer.xl_u.normal_()
                    blk.mixer.xl_v.normal_()
        _MODELS[key] = m
    return _MODELS[key]




def codebook_buffers(m):
    return [b.clone() for n, b in m.named_buffers() if "codebook" in n]


# ----------------------------------------------------------------------------- seed Definition 3.1
def _layer(H=1, rel_bias=True, L=4, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    layer = VQAttention(16, key_dim=6, value_dim=24, n_codes=5, block_len=L, n_heads=H, rel_bias=rel_bias,
                        sin_base=50.0, **kw).to(dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    return layer


def _seed_reference(layer: VQAttention, x):
    """Seed Definition 3.1 (Eqs. 8-15 without the block's norm and residual) with the XL bias,
    as a dense causal softmax over all ``T`` keys, one head at a time.  ``x [B, T, d]``, one
    sequence per row starting at position 0."""
    B, T, d = x.shape
    H, K, E, L = layer.H, layer.K, layer.E, layer.L
    tau = math.sqrt(K)
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).add(layer.norm_eps).sqrt()
    Wk, Wv, Wg = layer.kvg_proj.weight.split([H * K, H * E, H * E])
    q = rms((x @ layer.q_proj.weight.T).view(B, T, H, K)) / math.sqrt(tau)  # Eq. 8
    k = rms((x @ Wk.T).view(B, T, H, K)) / math.sqrt(tau)  # Eq. 9
    v = F.silu(x @ Wv.T).view(B, T, H, E)  # Eq. 10
    g = F.silu(x @ Wg.T)  # Eq. 11
    C = layer.codebook_sum / layer.codebook_count[..., None]  # counts are 1 here: no clip
    i = torch.arange(T)
    dist = i[:, None] - i[None, :]  # [T, T] i - j
    out = []
    for h in range(H):
        z = ((k[:, :, h, None, :] - C[h]) ** 2).sum(-1).argmin(-1)  # Eq. 5, [B, T]
        k_hat = C[h][z]  # Eq. 12 (forward value)
        scores = q[:, :, h] @ k_hat.transpose(1, 2)  # [B, T, T]
        if layer.r_proj is not None:
            u = layer.xl_u[h] / math.sqrt(tau)
            vv = layer.xl_v[h] / math.sqrt(tau)
            m = torch.arange(T, dtype=x.dtype)[:, None]
            f = layer.sin_base ** -(torch.arange(d // 2, dtype=x.dtype) / (d // 2))
            sin = torch.cat([torch.sin(m * f), torch.cos(m * f)], -1)  # [T, d], distance m
            r = (sin @ layer.r_proj.weight.T).view(T, H, K)[:, h] / math.sqrt(tau)  # [T, K]
            content = (q[:, :, h] + u) @ k_hat.transpose(1, 2)
            position = torch.einsum("bik,ijk->bij", q[:, :, h] + vv, r[dist.clamp(0, T - 1)])
            scores = content + position * ((dist >= 0) & (dist <= L))  # Theorem 3.6 window
        scores = scores.masked_fill(dist < 0, -math.inf)  # causal
        out.append(torch.softmax(scores, -1) @ v[:, :, h])  # Eq. 13
    o = torch.stack(out, 2).reshape(B, T, H * E)
    return (o * g) @ layer.out.weight.T  # Eqs. 14-15


@pytest.mark.parametrize("H,rel_bias", [(1, True), (2, True), (1, False)])
def test_layer_is_seed_definition(H, rel_bias):
    """Linear-time layer (blocks of 4, compressed cache from block 2 on) == the quadratic
    definition, fp64, T = 19 (four full blocks and a partial one)."""
    layer = _layer(H, rel_bias).eval()
    x = torch.randn(2, 19, 16, dtype=torch.float64)
    y, state = layer(x, positions=torch.arange(19).expand(2, 19))
    assert state is None
    assert_exact(f"VQAttention vs Definition 3.1 H={H} xl={rel_bias}", _seed_reference(layer, x), y)


# ----------------------------------------------------------------------------- parallel == recurrent
OPTIONS = [
    dict(),
    dict(n_heads=2),
    dict(reduction="matmul"),
    dict(reduction="assoc"),
    dict(rel_bias=False),
    dict(block_len=5, n_codes=3),
]


def _id(o):
    return ",".join(f"{k}={v}" for k, v in o.items()) or "seed"


@pytest.mark.parametrize("opts", OPTIONS, ids=_id)
def test_full_sequence_equals_prefill_plus_decoding(opts):
    """Eval mode, T = 26 across six block boundaries (L = 4), prefill pieces ending inside and on
    blocks, then token-by-token; the codebook does not move."""
    m = model(cfg(**opts))
    before = codebook_buffers(m)
    ids = torch.randint(0, V, (2, 26))
    with torch.no_grad():
        full = m(ids)
        for splits in ([1], [4], [3, 9, 13]):
            pieces, state = decode_in_pieces(m, ids, splits)
            assert_exact(f"vq {opts} prefill {splits}", full, pieces)
    assert state.offset.tolist() == [26, 26]
    assert isinstance(state.layers[0], VQAttentionState)
    L = m.config.mixer.block_len
    assert state.layers[0].vq.pos.tolist() == [26, 26]
    # everything before the last two blocks is in the compressed cache, per head
    assert state.layers[0].vq.cache_count.sum((-1,)).tolist() == [[(26 // L - 1) * L] * m.config.mixer.n_heads] * 2
    assert all(torch.equal(a, b) for a, b in zip(before, codebook_buffers(m)))


def test_fp32_decoding():
    m = model(cfg(), torch.float32)
    ids = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        assert_exact("vq fp32", m(ids), decode_in_pieces(m, ids, [7])[0])


def test_packed_equals_separate():
    m = model(cfg())
    seqs, ids, cu = packed([7, 1, 0, 19, 12])
    with torch.no_grad():
        ref = torch.cat([m(s) for s in seqs if s.shape[1]], 1)
        assert_exact("vq packed", ref, m(ids, cu_seqlens=cu))


def test_packed_prefill_then_decoding_and_select():
    m = model(cfg())
    check_packed_decode_and_select(m, "vq", steps=9, vocab=V)



def test_decoding_state_size_is_constant_in_T():
    """O(1) decoding memory in T (seed Theorem 3.7): the state after 10, 100 or 333 tokens holds
    the same numbers, and the cache has absorbed every key older than the window."""
    m = model(cfg())
    sizes = []
    with torch.no_grad():
        for T in (10, 100, 333):
            _, state = m(torch.randint(0, V, (1, T)), return_state=True)
            sizes.append(state_numel(state))
            assert state.layers[0].vq.cache_count.sum().item() == (T // 4 - 1) * 4
            _, state = m(torch.randint(0, V, (1, 1)), state, return_state=True)
            sizes.append(state_numel(state))
    assert len(set(sizes)) == 1, sizes
    n_layers, H, S, K, E, L = 2, 1, 8, 8, 64, 4
    per_layer = H * S * E + H * S + 2 * L * H * (K + E + 1) + 1  # cache mean, counts, window k/v/codes, pos
    assert sizes[0] == n_layers * per_layer + 0  # (the model's offset is not a layer state)


# ----------------------------------------------------------------------------- codebook
def test_codebook_updates_only_in_training_mode():
    m = CausalLM(cfg())
    ids = torch.randint(0, V, (2, 13))
    before = codebook_buffers(m)
    m.eval()
    with torch.no_grad():
        m(ids)
        _, st = m(ids[:, :5], return_state=True)
        m(ids[:, 5:6], st, return_state=True)
    assert all(torch.equal(a, b) for a, b in zip(before, codebook_buffers(m))), "eval / decoding moved the codebook"
    assert not any(b.requires_grad for n, b in m.named_buffers())
    assert not any("codebook" in n for n, _ in m.named_parameters())  # buffers: the optimizer never sees them
    assert {n.split(".")[-1] for n in m.state_dict() if "codebook" in n} == {"codebook_sum", "codebook_count"}
    m.train()
    m(ids)
    after = codebook_buffers(m)
    assert not any(torch.equal(a, b) for a, b in zip(before, after)), "training mode did not update the codebook"


def test_codebook_ema_moves_used_codes_toward_their_keys():
    """One training-mode call: ``count <- g count + (1-g) n``, ``sum <- g sum + (1-g) sum of keys``;
    every used codeword gets closer to the mean of its assigned keys (a convex combination of the
    old codeword and that mean); unused codewords keep their value."""
    layer = _layer(H=2, rel_bias=True, gamma=0.9)
    x = torch.randn(3, 11, 16, dtype=torch.float64)
    pos = torch.arange(11).expand(3, 11)
    c0 = layer.codebook().clone()
    n0, s0 = layer.codebook_count.clone(), layer.codebook_sum.clone()
    q, k, v, g = layer.project(x)
    codes, _, _ = layer.quantize(k, c0)
    layer.train()
    layer(x, positions=pos)
    c1 = layer.codebook()
    for h in range(2):
        for s in range(layer.S):
            mask = codes[..., h] == s
            n = int(mask.sum())
            ksum = k.detach()[..., h, :][mask].sum(0)
            assert torch.allclose(layer.codebook_count[h, s], 0.9 * n0[h, s] + 0.1 * n)
            assert torch.allclose(layer.codebook_sum[h, s], 0.9 * s0[h, s] + 0.1 * ksum)
            if n == 0:
                assert torch.allclose(c1[h, s], c0[h, s])
                continue
            mean = ksum / n
            w = 0.9 * n0[h, s] / (0.9 * n0[h, s] + 0.1 * n)
            assert torch.allclose(c1[h, s], w * c0[h, s] + (1 - w) * mean)
            assert (c1[h, s] - mean).norm() < (c0[h, s] - mean).norm()


def test_kmeans_lowers_the_quantisation_error():
    """Repeated training-mode calls on the same keys are EMA k-means: the mean squared distance of
    the keys to their codewords falls."""
    layer = _layer(H=1, rel_bias=False, gamma=0.5).train()
    x = torch.randn(4, 16, 16, dtype=torch.float64)
    pos = torch.arange(16).expand(4, 16)
    with torch.no_grad():
        k = layer.project(x)[1]
        err = []
        for _ in range(8):
            _, _, c_z = layer.quantize(k, layer.codebook())
            err.append((k - c_z).pow(2).sum(-1).mean().item())
            layer(x, positions=pos)
    assert err[-1] < 0.5 * err[0], err


# ----------------------------------------------------------------------------- losses and gradients
def _commit(layer, x):
    """Seed Eq. 37 for one layer, from its keys only."""
    k = layer.project(x)[1]
    c_z = layer.quantize(k, layer.codebook())[2]
    return (k - c_z).pow(2).sum((-2, -1)).mean()


def test_commitment_loss_value_and_gradient_to_k_only():
    m = CausalLM(cfg(n_heads=2)).double().train()
    ids = torch.randint(0, V, (2, 13))
    layers = [blk.mixer for blk in m.backbone.blocks]
    codebooks = [lay.codebook().clone() for lay in layers]
    # the expected value: per layer, mean over tokens of sum over heads ||k - C_z||^2; summed over layers
    ks = []
    hooks = [lay.register_forward_hook(lambda mod, inp, out: ks.append(mod.project(inp[0])[1].detach()))
             for lay in layers]
    aux = {}
    m(ids, aux_losses=aux)
    for hk in hooks:
        hk.remove()
    assert set(aux) == {"vq_commit"}
    want = sum((k - lay.quantize(k, c)[2]).pow(2).sum((-2, -1)).mean() for k, lay, c in zip(ks, layers, codebooks))
    assert torch.allclose(aux["vq_commit"], want)
    assert aux["vq_commit"].item() > 0
    # its gradient reaches W_K and what feeds the keys (embedding, norms, earlier layers), not the
    # last layer's W_Q / W_V / W_G / W_O / XL parameters nor the classifier
    m.zero_grad()
    aux["vq_commit"].backward()
    HK = 2 * 8
    last = layers[-1]
    assert last.kvg_proj.weight.grad[:HK].abs().sum() > 0
    assert torch.count_nonzero(last.kvg_proj.weight.grad[HK:]) == 0  # W_V, W_G
    for p in (last.q_proj.weight, last.out.weight, last.r_proj.weight, last.xl_u, last.xl_v, m.lm_head.weight):
        assert p.grad is None or torch.count_nonzero(p.grad) == 0
    assert m.backbone.embed.weight.grad.abs().sum() > 0
    # one layer on its own: d commit / d x flows through k only
    layer = _layer(H=2).eval()  # (training mode would move the codebook under the check)
    x = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    aux = {}
    layer(x, positions=torch.arange(9).expand(2, 9), aux_losses=aux)
    aux["vq_commit"].backward()
    assert_exact("d commit / d x (through k alone)", torch.autograd.grad(_commit(layer, x), x)[0], x.grad)
    assert torch.count_nonzero(layer.kvg_proj.weight.grad[2 * 6:]) == 0
    for p in (layer.q_proj.weight, layer.out.weight, layer.r_proj.weight, layer.xl_u, layer.xl_v):
        assert p.grad is None or torch.count_nonzero(p.grad) == 0
    # no aux dict, no loss anywhere (nothing stored on the module)
    m(ids)
    assert not any("commit" in n for n in vars(layers[0]))


def _key_value_grads(layer, x, pos, backend, queries):
    """Gradients of ``sum(y[:, queries])`` w.r.t. the layer's keys ``k`` and values ``v``."""
    saved = {}
    project = VQAttention.project.__get__(layer)

    def keep(inp):
        q, k, v, g = project(inp)
        k.retain_grad()
        v.retain_grad()
        saved.update(k=k, v=v)
        return q, k, v, g

    layer.project, layer.backend = keep, backend
    try:
        y, _ = layer(x, positions=pos)
        y[:, queries].sum().backward()
    finally:
        del layer.project
        layer.backend = None
    return saved["k"].grad, saved["v"].grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_straight_through_gradient_reaches_the_key_projection():
    """Inside the two-block window the linear-time layer's gradients are exactly the quadratic
    straight-through ones (the op's naive form): ``d k = d k_hat`` for every key, every parameter
    (W_K included) gets the same gradient."""
    x = torch.randn(2, 8, 16, dtype=torch.float64)  # T = 2L: every key is in every later query's window
    pos = torch.arange(8).expand(2, 8)
    got = _key_value_grads(_layer().eval(), x, pos, None, slice(None))
    ref = _key_value_grads(_layer().eval(), x, pos, "naive", slice(None))
    assert got[0].abs().sum() > 0
    assert_exact("d k (window)", ref[0], got[0])
    assert_exact("d v (window)", ref[1], got[1])
    for name in ref[2]:
        assert_exact(f"d {name}", ref[2][name], got[2][name])
    Wk = got[2]["kvg_proj.weight"][: _layer().H * 6]
    assert Wk.abs().sum() > 0


def test_keys_beyond_the_window_send_no_gradient_to_k():
    """The seed's choice (Code 1, authors' ``get_codebook`` = ``sg(c_sum / c_count)``): a key older
    than the window reaches the query through the detached EMA codebook, so its ``k`` gets no
    gradient from that query, while its value does.  The quadratic form (exact straight-through
    for every key) differs exactly there."""
    x = torch.randn(1, 19, 16, dtype=torch.float64)
    pos = torch.arange(19).expand(1, 19)
    last = slice(16, 19)  # block 4: window = blocks 3 and 4, cache = blocks 0-2 (keys 0..11)
    dk, dv, _ = _key_value_grads(_layer().eval(), x, pos, None, last)
    dk_q, dv_q, _ = _key_value_grads(_layer().eval(), x, pos, "naive", last)
    assert torch.count_nonzero(dk[:, :12]) == 0
    assert dk[:, 12:].abs().sum() > 0 and dk_q[:, :12].abs().sum() > 0
    assert_exact("d k in the window", dk_q[:, 12:], dk[:, 12:])
    assert dv[:, :12].abs().sum() > 0  # values of cached keys do learn (seed Section 3.4.2)
    assert_exact("d v (cache means carry the exact value gradient)", dv_q, dv)


# ----------------------------------------------------------------------------- dtypes
def test_bf16_autocast_runs_and_matches_fp32():
    m = model(cfg(), torch.float32)
    ids = torch.randint(0, V, (2, 21))
    with torch.no_grad():
        ref = m(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(ids)
            steps, _ = decode_in_pieces(m, ids, [9])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert_close("bf16 autocast forward", ref, out, 5e-2)
    assert_close("bf16 autocast decoding", ref, steps, 5e-2)


# ----------------------------------------------------------------------------- presets, config
PAPER_PARAMS = 190e6  # seed Section 5.2.1 / Table 10: "a Transformer-VQ with 190M parameters"


def test_parameter_count_matches_the_paper():
    with torch.device("meta"):
        m = CausalLM(get_preset("vq-190m"))
    got = m.num_parameters()
    codebook = sum(b.numel() for n, b in m.named_buffers() if "codebook" in n)
    assert got == 184_473_600  # 48 x 3,834,880 per unit + 2 x 260 x 768 (untied embedding / classifier)
    assert codebook == 48 * (512 * 128 + 512)  # EMA statistics (parameters in the authors' Flax code)
    for n in (got, got + codebook):
        assert abs(n - PAPER_PARAMS) <= 0.05 * PAPER_PARAMS, n


def test_seed_table_row():
    c = get_preset("vq-190m")
    m = c.mixer
    assert (c.d_model, c.n_layers, m.d_k, m.value_dim(c.d_model), m.n_codes, m.block_len) == (768, 48, 128, 1536, 512, 512)
    assert (m.n_heads, m.gamma, m.sin_base, m.reduction) == (1, 0.99, 1e5, "serial")
    assert c.ffn is None and c.norm == "rmsnorm" and c.position == "none"
    assert not c.final_norm and not c.tie_embeddings  # App. C.2, the small model's classifier
    assert c.vocab_size == 260  # Enwik8's 256 bytes + lintime's 4 byte-tokenizer specials
    assert (c.dropout, m.sin_dropout) == (0.5, 0.2)  # Table 10, Enwik8 column


def test_byte_vocabulary_is_the_byte_tokenizer():
    from lintime.data.tokenizer import ByteTokenizer

    assert get_preset("vq-tiny").vocab_size == ByteTokenizer().vocab_size


@pytest.mark.parametrize("name", ["vq-tiny", "vq-small", "vq-190m"])
def test_json_round_trip(name):
    c = get_preset(name)
    d = json.loads(c.to_json())
    assert d["family"] == "vq" and isinstance(d["mixer"], dict)
    assert ModelConfig.from_json(c.to_json()) == c
    varied = dataclasses.replace(c, mixer=VQConfig(n_codes=256, n_heads=2, gamma=0.9, rel_bias=False, reduction="assoc"))
    assert ModelConfig.from_json(varied.to_json()) == varied


BAD = [
    (dict(n_codes=0), "n_codes must be an int >= 1"),
    (dict(block_len=64.0), "block_len must be an int >= 1"),
    (dict(d_k=-1), "d_k must be an int >= 1"),
    (dict(gamma=1.0), r"gamma must be a number in \[0, 1\)"),
    (dict(gamma=True), r"gamma must be a number in \[0, 1\)"),
    (dict(reduction="cumsum"), "reduction must be one of"),
    (dict(sin_dropout=1.0), r"sin_dropout must be in \[0, 1\)"),
    (dict(sin_base=1), "sin_base must be a number > 1"),
    (dict(rel_bias="yes"), "rel_bias must be a bool"),
    (dict(expansion=0), "expansion must be a positive number"),
]


@pytest.mark.parametrize("kwargs,msg", BAD)
def test_bad_configs_fail_clearly(kwargs, msg):
    with pytest.raises(ValueError, match=f"VQConfig: {msg}"):
        VQConfig(**kwargs)


def test_bad_model_level_configs_and_masked_lm():
    with pytest.raises(ValueError, match="n_heads=3 does not divide D_v"):
        cfg(n_heads=3)
    with pytest.raises(ValueError, match="rel_bias needs an even d_model"):
        dataclasses.replace(cfg(), d_model=33)
    with pytest.raises(ValueError, match="cannot build a MaskedLM"):
        MaskedLM(cfg())
    with pytest.raises(ValueError, match="Transformer-VQ is causal"):
        VQAttention(16, key_dim=4, value_dim=32, causal=False)
    m = model(cfg())
    with pytest.raises(ValueError, match="holds 2 sequences"):
        m(torch.randint(0, V, (3, 1)), m.init_state(2))


def test_no_weight_decay_on_xl_biases():
    m = CausalLM(cfg())
    decay, no_decay = m.param_groups(0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert {names[id(p)].split(".")[-1] for p in no_decay["params"]} == {"weight", "xl_u", "xl_v"}  # norms' gains
    assert all(p.dim() == 2 and "xl_" not in names[id(p)] for p in decay["params"])


# ----------------------------------------------------------------------------- training
def test_tiny_preset_overfits():
    """30 AdamW steps on a fixed batch, with the commitment loss at the seed's beta: the loss
    falls from ~ln(260) to < 10 %, and the codebook trains alongside."""
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (4, 33))
    m = CausalLM(get_preset("vq-tiny")).train()
    before = codebook_buffers(m)
    opt = torch.optim.AdamW(m.param_groups(0.01), lr=3e-3)
    losses = []
    for _ in range(30):
        aux = {}
        logits = m(ids[:, :-1], aux_losses=aux)
        loss = F.cross_entropy(logits.reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        (loss + 1e-4 * aux["vq_commit"]).backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 5.0
    assert losses[-1] < 0.1 * losses[0], losses[::10]
    assert not any(torch.equal(a, b) for a, b in zip(before, codebook_buffers(m)))
