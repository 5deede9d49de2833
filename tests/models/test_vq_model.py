"""Family ``vq`` (Transformer-VQ) as a model: parallel == prefill + decoding across block boundaries for every option
(non-zero XL biases, the codebook unmoved), the documented constant-size decoding state, the codebook's EMA in
training mode only, the commitment loss through the model, bf16 autocast, the 190M preset against the paper,
config round trips, weight decay.  The layer (Definition 3.1, the codebook, gradients): ``tests/layers/test_vq_layer.py``;
what every family passes: ``test_every_family.py``.

(Not ``test_vq.py``: that basename belongs to ``tests/ops/``.)"""

import dataclasses

import pytest
import torch
from model_helpers import CausalLM, check_prefill_plus_decoding, decode_in_pieces, state_numel

from lintime.layers.vq import VQAttentionState
from lintime.models import ModelConfig, get_preset
from lintime.models.config import BYTE_VOCAB
from lintime.models.families.vq import VQConfig
from tolerances import assert_close

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


# ----------------------------------------------------------------------------- parallel == recurrent
OPTIONS = [
    dict(),  # the defaults, with non-zero XL biases (vq-tiny in test_every_family.py has them at their zero init)
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
    """Eval mode, T = 26 across six block boundaries (L = 4), prefill pieces ending on and inside
    blocks, then token-by-token; the codebook does not move."""
    m = model(cfg(**opts))
    before = codebook_buffers(m)
    state = check_prefill_plus_decoding(m, f"vq {opts}", T=26, B=2, splits=([4], [3, 9, 13]))
    assert isinstance(state.layers[0], VQAttentionState)
    L = m.config.mixer.block_len
    assert state.layers[0].vq.pos.tolist() == [26, 26]
    # everything before the last two blocks is in the compressed cache, per head
    assert state.layers[0].vq.cache_count.sum((-1,)).tolist() == [[(26 // L - 1) * L] * m.config.mixer.n_heads] * 2
    assert all(torch.equal(a, b) for a, b in zip(before, codebook_buffers(m)))


def test_decoding_state_is_the_documented_one():
    """O(1) decoding memory in T (seed Theorem 3.7): per layer the cache's per-code means and counts,
    the window's keys, values and codes, the position; the cache has absorbed every key older than
    the window."""
    m = model(cfg())
    with torch.no_grad():
        for T in (10, 29):
            _, state = m(torch.randint(0, V, (1, T)), return_state=True)
            assert state.layers[0].vq.cache_count.sum().item() == (T // 4 - 1) * 4
    n_layers, H, S, K, E, L = 2, 1, 8, 8, 64, 4
    per_layer = H * S * E + H * S + 2 * L * H * (K + E + 1) + 1  # cache mean, counts, window k/v/codes, pos
    assert state_numel(state) == n_layers * per_layer  # (the model's offset is not a layer state)


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



# ----------------------------------------------------------------------------- the commitment loss
def test_commitment_loss_value_and_gradient_to_k_only():
    """The model collects one ``vq_commit`` (seed Eq. 37, summed over layers) only when given a dict; its
    gradient reaches W_K and what feeds the keys, not the last layer's other parameters nor the classifier."""
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
    # no aux dict, no loss anywhere (nothing stored on the module)
    m(ids)
    assert not any("commit" in n for n in vars(layers[0]))


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
    """Per layer (seed Definition 3.1): W_Q [d, K], W_K / W_V / W_G [d, K + 2 E], W_O [E, d], the XL bias's
    R [d, K] and u, v [K], the RMSNorm gain [d]; plus the untied embedding and classifier.  The EMA statistics
    (per code a sum [K] and a count) are parameters in the authors' Flax code: with or without them, 190M."""
    c = get_preset("vq-190m")
    d, K, E, S, L = c.d_model, c.mixer.d_k, c.mixer.value_dim(c.d_model), c.mixer.n_codes, c.n_layers
    per_layer = d * K + d * (K + 2 * E) + E * d + d * K + 2 * K + d
    with torch.device("meta"):
        m = CausalLM(c)
    got = m.num_parameters()
    codebook = sum(b.numel() for n, b in m.named_buffers() if "codebook" in n)
    assert got == L * per_layer + 2 * c.vocab_size * d
    assert codebook == L * (S * K + S)
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



def test_json_round_trip_of_varied_options():
    """Every preset round-trips (``test_config.py``); so does a sub-config far from the defaults."""
    c = get_preset("vq-small")
    varied = dataclasses.replace(c, mixer=VQConfig(n_codes=256, n_heads=2, gamma=0.9, rel_bias=False, reduction="assoc"))
    assert ModelConfig.from_json(varied.to_json()) == varied


def test_bad_model_level_configs():
    with pytest.raises(ValueError, match="n_heads=3 does not divide D_v"):
        cfg(n_heads=3)
    with pytest.raises(ValueError, match="rel_bias needs an even d_model"):
        dataclasses.replace(cfg(), d_model=33)


def test_no_weight_decay_on_xl_biases():
    m = CausalLM(cfg())
    decay, no_decay = m.param_groups(0.1)
    names = {id(p): n for n, p in m.named_parameters()}
    assert {names[id(p)].split(".")[-1] for p in no_decay["params"]} == {"weight", "xl_u", "xl_v"}  # norms' gains
    assert all(p.dim() == 2 and "xl_" not in names[id(p)] for p in decay["params"])

