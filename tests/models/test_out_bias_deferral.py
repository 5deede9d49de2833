"""FLASH / GAU's output bias left to the next norm (``Mixer.deferrable_bias``, ``add_normalize``'s ``branch_bias``):
in fp32 a fused model that defers it gives the unfused model's logits and every parameter's gradient (the bias
added in the product), over the full sequence and over prefill + token-by-token decoding, first-to-all and an FFN
included; the mixers' outputs really lack the bias and its gradient still arrives; the unfused paths keep it."""

import dataclasses

import pytest
import torch

from lintime.layers.flash import FLASH
from lintime.layers.gau import GAU
from lintime.models import CausalLM, get_preset
from lintime.models.config import FFNConfig
from tolerances import HALF_FACTOR, HALF_FLOOR, assert_exact, rel_rms
from model_helpers import decode_in_pieces

CASES = {  # name: (preset, top-level overrides, mixer overrides)
    "flash": ("flash-tiny", {}, {}),
    "flash-rmsnorm-no-final-norm": ("flash-tiny", {"norm": "rmsnorm", "final_norm": False}, {}),
    "flash-first-to-all": ("flash-tiny", {}, {"first_to_all": True}),
    "gau": ("flash-quad-tiny", {}, {}),
    "gau-ffn": ("flash-quad-tiny", {"ffn": FFNConfig(kind="glu", expansion=2.0)}, {}),
}


def _model(case, **overrides):
    preset, top, mixer = CASES[case]
    cfg = get_preset(preset, n_layers=2, d_model=32, vocab_size=64, **{**top, **overrides})
    fields = {f.name for f in dataclasses.fields(cfg.mixer)}
    mixer = {**{k: v for k, v in (("s", 16), ("chunk_size", 8), ("max_len", 64)) if k in fields}, **mixer}
    torch.manual_seed(0)
    model = CausalLM(dataclasses.replace(cfg, mixer=dataclasses.replace(cfg.mixer, **mixer)))
    with torch.no_grad():  # biases away from their zero init, so a lost or doubled bias shows
        for blk in model.backbone.blocks:
            blk.mixer.out.bias.normal_(0, 0.5)
    return model


def _mixer_outputs(model):
    """Forward hooks that record every mixer's output ``y`` and whether it was asked to defer its bias."""
    seen = []
    for blk in model.backbone.blocks:
        blk.mixer.register_forward_hook(
            lambda m, args, kwargs, out: seen.append((out[0].detach(), kwargs.get("defer_bias", False))),
            with_kwargs=True)
    return seen


def _loss_and_grads(model, ids, targets):
    model.zero_grad(set_to_none=True)
    loss = model(ids, targets=targets)
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("case", list(CASES))
def test_deferred_bias_is_the_unfused_function(case):
    """Logits, loss and every gradient of the deferring model equal the unfused model's (fp32 exact rule); each
    mixer's output is the unfused one less its bias, whose gradient the norm's backward still delivers."""
    model = _model(case)
    seen = _mixer_outputs(model)
    gen = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, 64, (2, 19), generator=gen) for _ in range(2))
    assert model.backbone.fuses_residual() and model.backbone.defer_bias
    deferred = _loss_and_grads(model, ids, targets)
    deferred_y, seen[:] = list(seen), []
    with torch.no_grad():
        logits = model(ids)
    model.backbone.fused = False
    seen.clear()
    plain = _loss_and_grads(model, ids, targets)
    plain_y = list(seen)
    with torch.no_grad():
        assert_exact(f"{case} logits", model(ids), logits)
    for name, want in plain.items():
        assert_exact(f"{case} {name}", want, deferred[name])
    # behaviour: the deferring mixers were asked to, returned y without the bias, and the bias still got its grad
    blocks = model.backbone.blocks
    assert [d for _, d in deferred_y] == [True] * len(blocks) and [d for _, d in plain_y] == [False] * len(blocks)
    for i, (blk, (y_def, _), (y, _)) in enumerate(zip(blocks, deferred_y, plain_y)):
        assert_exact(f"{case} block {i} y + bias", y, y_def + blk.mixer.out.bias.detach())
        assert deferred[f"backbone.blocks.{i}.mixer.out.bias"].abs().sum() > 0


def test_deferred_bias_through_the_triton_norm_kernels(monkeypatch):
    """The same with the norm ops sent to their Triton kernels (the interpreter on the CPU): the bias's gradient from
    the backward kernel's partial rows."""
    import lintime.modules.norm as norm_mod

    monkeypatch.setattr(norm_mod, "select", lambda op, backend, impls, x: impls[backend or "triton"])
    model = _model("flash")
    gen = torch.Generator().manual_seed(2)
    ids, targets = (torch.randint(0, 64, (1, 11), generator=gen) for _ in range(2))
    deferred = _loss_and_grads(model, ids, targets)
    model.backbone.defer_bias = False  # fused adds, the bias in the product
    plain = _loss_and_grads(model, ids, targets)
    for name, want in plain.items():
        assert_exact(f"triton {name}", want, deferred[name])


@pytest.mark.parametrize("case", ["flash", "flash-first-to-all", "gau"])
def test_deferred_bias_prefill_and_decoding(case):
    """Prefill + token-by-token decoding (the mixers' state paths, deferring) gives the unfused full-sequence
    logits."""
    model = _model(case).eval()
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(3))
    seen = _mixer_outputs(model)
    with torch.no_grad():
        pieces, state = decode_in_pieces(model, ids, [9])
        assert seen and all(d for _, d in seen)
        model.backbone.fused = False
        full = model(ids)
    assert_exact(f"{case} prefill + decoding", full, pieces)
    assert state.offset.tolist() == [21, 21]


def test_fused_decode_step_defers_the_bias():
    """FLASH's in-place one-token step (static state, backend='triton': the interpreter) returns ``y`` less
    ``out``'s bias when asked to, and updates the state it was given as without deferral."""
    torch.manual_seed(0)
    layer = FLASH(16, expansion_dim=16, key_dim=8, chunk_size=4, backend="triton").eval()
    torch.nn.init.normal_(layer.out.bias)
    x = torch.randn(2, 1, 16)
    pos = torch.tensor([[5], [2]])
    st = layer.init_state(2, "cpu", torch.float32)
    with torch.no_grad():
        _, st = layer(torch.randn(2, 5, 16), st, positions=torch.arange(5).expand(2, 5))
        states = [st.with_capacity(8), st.with_capacity(8)]
        assert layer._fused_step(x, states[0], None)
        y, new = layer(x, states[0], positions=pos)
        y_def, new_def = layer(x, states[1], positions=pos, defer_bias=True)
    assert new is states[0] and new_def is states[1]  # the in-place step
    assert_exact("step y", y, y_def + layer.out.bias)
    assert_exact("step state", new.mc.kv, new_def.mc.kv)


@pytest.mark.parametrize("why", ["unfused backbone", "unfused mixer", "defer_bias off", "dropout"])
def test_mixers_keep_their_bias_off_the_fused_path(why):
    """The mixer adds its own bias whenever the block is not on the deferring path: no deferral is asked for."""
    model = _model("flash", dropout=0.1 if why == "dropout" else 0.0)
    if why == "unfused backbone":
        model.backbone.fused = False
    elif why == "unfused mixer":
        for blk in model.backbone.blocks:
            blk.mixer.fused = False
            assert blk.mixer.deferrable_bias() is None
    elif why == "defer_bias off":
        model.backbone.defer_bias = False
    seen = _mixer_outputs(model)
    model(torch.randint(0, 64, (1, 9)))
    assert seen and not any(d for _, d in seen)


def test_only_flash_and_gau_offer_a_bias():
    assert FLASH(16, expansion_dim=16, key_dim=8).deferrable_bias() is not None
    assert GAU(16, expansion_dim=16, key_dim=8, max_len=16).deferrable_bias() is not None
    assert GAU(16, expansion_dim=16, key_dim=8, max_len=16, bias=False).deferrable_bias() is None
    for name in ("gla-tiny", "transformer-pp-tiny"):
        model = CausalLM(get_preset(name, n_layers=1, d_model=32))
        assert model.backbone.blocks[0].mixer.deferrable_bias() is None


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["flash-tiny", "flash-quad-tiny"])
def test_cuda_deferred_bias_under_autocast(preset):
    """Under bf16 autocast the deferred bias is added to the unrounded bf16 branch in fp32 (the product with its
    bias rounds their sum to bf16 instead): against the fp32 model, the deferring model's loss and every gradient
    are within the half rule of the model with the bias in its product."""
    torch.manual_seed(0)
    model = CausalLM(get_preset(preset)).cuda()
    gen = torch.Generator().manual_seed(1)
    ids, targets = (torch.randint(0, model.config.vocab_size, (2, 200), generator=gen).cuda() for _ in range(2))
    ref = _loss_and_grads(model, ids, targets)  # fp32
    with torch.autocast("cuda", torch.bfloat16):
        out = _loss_and_grads(model, ids, targets)
        model.backbone.defer_bias = False
        base = _loss_and_grads(model, ids, targets)
    for name, want in ref.items():
        e_out, e_base = rel_rms(want, out[name]), rel_rms(want, base[name])
        bound = HALF_FACTOR * e_base + HALF_FLOOR[torch.bfloat16]
        assert e_out <= bound, f"{preset} {name}: {e_out:.3e} > {bound:.3e}"
