"""The training loop: exact resume, gradient accumulation, auxiliary losses, budgets, MLM."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from lintime.data import BatchIterator, open_prepared
from lintime.layers.base import Mixer
from lintime.models import CausalLM, ModelConfig, get_preset
from lintime.models.config import FFNConfig
from lintime.models import registry
from lintime.models.registry import register_family
from lintime.training import load_model, train
from lintime.training import step as step_mod
from lintime.training import trainer as trainer_mod
from lintime.training.metrics import read_metrics
from lintime.training.rng import rng_state, set_rng_state


def _run(cfg, tmp_path, name, **kw):
    return train(cfg, out=tmp_path, name=name, progress=False, echo=None, **kw)


def _losses(run_dir):
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(run_dir) if "loss" in r]


def test_resume_after_a_crash_repeats_the_uninterrupted_losses_exactly(tmp_path, tiny_config, monkeypatch):
    cfg = tiny_config(steps=8, save_every=3, keep=2, eval_every=4)
    straight = _run(cfg, tmp_path, "straight")

    # the same run, killed during step 5 (after the step-3 checkpoint, with step 4 already logged)
    real = trainer_mod.forward_backward
    calls = {"n": 0}

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "forward_backward", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(cfg, tmp_path, "crashed")
    monkeypatch.setattr(trainer_mod, "forward_backward", real)
    run = tmp_path / "crashed"
    assert max(r["step"] for r in read_metrics(run)) == 4  # step 4 was logged before the crash
    resumed = train(cfg, resume=run, progress=False, echo=None)

    assert resumed.step == straight.step == 8
    a, b = _losses(straight.run_dir), _losses(run)
    assert [s for s, *_ in b] == list(range(1, 9))  # the rows after the checkpoint were replaced, not duplicated
    assert a == b  # loss, lr and grad norm of every step, bit for bit
    wa = load_file(straight.checkpoint / "model.safetensors")
    wb = load_file(resumed.checkpoint / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert resumed.val == straight.val


def test_step_numbers_are_read_once_per_logged_step(tmp_path, tiny_config, monkeypatch):
    """The step's loss, aux loss and grad norm stay on the device until a logged step reads them
    all at once: with ``log_every=3`` the 7 steps are read at steps 3, 6 and 7 (the end), and the
    rows hold what a run that reads every step logs -- the window's mean loss, the logged step's
    grad norm -- bit for bit."""
    every = _run(tiny_config(steps=7), tmp_path, "every")
    reads = []
    real = step_mod.StepStats.read

    def counted(self):
        out = real(self)
        reads.append([s for s, *_ in out])
        return out

    monkeypatch.setattr(step_mod.StepStats, "read", counted)
    sparse = _run(tiny_config(steps=7, log_every=3), tmp_path, "sparse")
    assert [r for r in reads if r] == [[1, 2, 3], [4, 5, 6], [7]]
    per_step = {r["step"]: r for r in read_metrics(every.run_dir) if "loss" in r}
    rows = [r for r in read_metrics(sparse.run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [3, 6]
    for r in rows:
        window = [per_step[s]["loss"] for s in range(r["step"] - 2, r["step"] + 1)]
        assert r["loss"] == sum(window) / 3  # the same floats, added in the same order
        assert r["grad_norm"] == per_step[r["step"]]["grad_norm"] and r["lr"] == per_step[r["step"]]["lr"]
    assert (sparse.first_loss, sparse.last_loss) == (every.first_loss, every.last_loss)


def test_a_divergence_between_logged_steps_is_reported_at_its_step(tmp_path, tiny_config, monkeypatch):
    """A non-finite loss at step 5 of a run that logs every 4 steps and saves every 6: found when
    step 6 is read (before its checkpoint), named as step 5, and no checkpoint holds it."""
    real, calls = trainer_mod.forward_backward, []

    def fb(*args, **kwargs):
        calls.append(1)
        loss, aux = real(*args, **kwargs)
        return (loss * float("nan") if len(calls) == 5 else loss), aux

    monkeypatch.setattr(trainer_mod, "forward_backward", fb)
    cfg = tiny_config(steps=8, log_every=4, save_every=6, sample_tokens=0)
    with pytest.raises(ValueError, match=r"diverged at step 5 \(the loss is nan\)"):
        _run(cfg, tmp_path, "nan")
    assert len(calls) == 6 and not (tmp_path / "nan" / "checkpoints").exists()


def test_resume_refuses_other_settings(tmp_path, tiny_config):
    first = _run(tiny_config(steps=2), tmp_path, "r")
    with pytest.raises(ValueError, match="context_len=64"):
        train(tiny_config(steps=4, context_len=64), resume=first.run_dir, progress=False, echo=None)
    with pytest.raises(ValueError, match="already holds a run"):
        _run(tiny_config(steps=2), tmp_path, "r")
    more = train(tiny_config(steps=4), resume=first.run_dir, progress=False, echo=None)  # a longer budget is fine
    assert more.step == 4


def _batch(token_cache, rows=4, T=32):
    ds = open_prepared(token_cache, "train")
    from lintime.data import ByteTokenizer

    return next(BatchIterator(ds, batch_size=rows, context_len=T, tokenizer=ByteTokenizer(), seed=3))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("micro_rows", [1, 2])
def test_gradient_accumulation_equals_the_big_batch(token_cache, micro_rows):
    batch = _batch(token_cache)
    torch.manual_seed(0)
    model = CausalLM(get_preset("transformer-pp-tiny", vocab_size=260)).double()
    loss_big, _ = step_mod.forward_backward(model, batch, micro_rows=4)
    big = _grads(model)
    model.zero_grad(set_to_none=True)
    loss_acc, _ = step_mod.forward_backward(model, batch, micro_rows=micro_rows)
    acc = _grads(model)
    assert loss_acc == pytest.approx(loss_big, rel=1e-12)
    assert big.keys() == acc.keys() and len(big) > 0
    for n in big:
        torch.testing.assert_close(acc[n], big[n], rtol=1e-10, atol=1e-13, msg=n)
    # and the big batch is the mean loss over its predicted tokens
    model.zero_grad(set_to_none=True)
    logits = model(batch.input_ids.reshape(1, -1), cu_seqlens=batch.cu_seqlens)
    ref = F.cross_entropy(logits[0], batch.targets.reshape(-1), ignore_index=-100)
    assert ref.item() == pytest.approx(loss_big, rel=1e-12)


def test_forward_backward_on_the_device_holds_the_host_numbers(token_cache):
    """``to_host=False`` (the trainer's form: 0-d fp64 device tensors, no read) gives the floats of
    ``to_host=True`` exactly, and the same gradients, with accumulation over 2 micro-batches."""
    batch = _batch(token_cache)
    torch.manual_seed(0)
    model = CausalLM(get_preset("transformer-pp-tiny", vocab_size=260))
    loss, aux = step_mod.forward_backward(model, batch, micro_rows=2)
    host = _grads(model)
    model.zero_grad(set_to_none=True)
    loss_t, aux_t = step_mod.forward_backward(model, batch, micro_rows=2, to_host=False)
    assert isinstance(loss_t, torch.Tensor) and loss_t.dtype == torch.float64 and loss_t.dim() == 0
    assert (float(loss_t), float(aux_t)) == (loss, aux)
    for n, g in _grads(model).items():
        assert torch.equal(g, host[n]), n


# -- auxiliary losses: a test mixer that reports one, as Transformer-VQ reports its commit loss


@dataclasses.dataclass(frozen=True)
class _AuxConfig:
    pass


class _AuxMixer(Mixer):
    causal = True

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x, state=None, *, positions, cu_seqlens=None, aux_losses=None):
        y = self.proj(x)
        if aux_losses is not None:
            aux_losses["test_commit"] = aux_losses.get("test_commit", 0.0) + (y.float() ** 2).mean()
        return y, state

    def init_state(self, batch_size, device, dtype):
        return None


@pytest.fixture
def auxtest_family():
    """The ``auxtest`` family, registered for one test only: a family left in the registry would show up in every
    module collected after this one (the tiny-preset table checks it covers every family)."""
    register_family("auxtest", _AuxConfig, lambda config, layer_idx, causal: _AuxMixer(config.d_model))
    yield
    registry._FAMILIES.pop("auxtest", None)


def test_aux_losses_are_added_with_their_weight(token_cache, auxtest_family):
    batch = _batch(token_cache)
    cfg = ModelConfig(vocab_size=260, d_model=16, n_layers=2, family="auxtest", ffn=FFNConfig())
    torch.manual_seed(0)
    model = CausalLM(cfg).double()
    w = 0.5
    loss, aux = step_mod.forward_backward(model, batch, micro_rows=4, aux_weight=w)
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    terms = {}
    logits = model(batch.input_ids.reshape(1, -1), cu_seqlens=batch.cu_seqlens, aux_losses=terms)
    ce = F.cross_entropy(logits[0], batch.targets.reshape(-1), ignore_index=-100)
    (ce + w * terms["test_commit"]).backward()
    assert aux == pytest.approx(w * terms["test_commit"].item(), rel=1e-12) and aux > 0
    assert loss == pytest.approx(ce.item(), rel=1e-12)  # the logged loss is the cross-entropy alone
    for n, g in _grads(model).items():
        torch.testing.assert_close(got[n], g, rtol=1e-10, atol=1e-13, msg=n)
    # with accumulation the micro-batches' aux losses are weighted by their share of the rows
    model.zero_grad(set_to_none=True)
    _, aux_acc = step_mod.forward_backward(model, batch, micro_rows=2, aux_weight=w)
    assert aux_acc == pytest.approx(aux, rel=0.5)


def test_rng_state_round_trips_through_weights_only_load(tmp_path):
    torch.manual_seed(1), np.random.seed(1), random.seed(1)
    state = rng_state()
    torch.save(state, tmp_path / "s.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]


def test_loss_falls_and_budgets(tmp_path, tiny_config):
    res = _run(tiny_config(steps=30, lr=3e-3), tmp_path, "falls")
    assert res.last_loss < res.first_loss - 1.0, (res.first_loss, res.last_loss)
    assert res.val["val_bpb"] == pytest.approx(res.val["val_loss"] / np.log(2))
    res = _run(tiny_config(steps=None, tokens=300), tmp_path, "tokens")  # ceil(300 / 128) = 3 steps
    assert res.step == 3 and res.tokens == 384
    res = _run(tiny_config(steps=None, time_minutes=1e-6), tmp_path, "time")  # the first step exhausts it
    assert res.step == 1


def test_masked_lm_objective(tmp_path, tiny_config):
    res = _run(tiny_config(objective="mlm", steps=3, eval_every=2), tmp_path, "mlm")
    assert res.sample is None and res.step == 3 and np.isfinite(res.val["val_loss"])
    loaded = load_model(res.run_dir)
    assert type(loaded.model).__name__ == "MaskedLM" and loaded.config["objective"] == "mlm"


def test_vq_commitment_loss_and_codebook_updates_are_wired_in(tmp_path, tiny_config):
    from lintime.data import open_prepared

    cfg = tiny_config(preset="vq-tiny", recipe="vq", steps=3, sample_tokens=0)
    res = _run(cfg, tmp_path, "vq")
    rows = [r for r in read_metrics(res.run_dir) if "loss" in r]
    assert len(rows) == 3 and all(r["aux_loss"] > 0 for r in rows)  # beta * commit loss, logged per step
    trained = load_model(res.run_dir).model
    torch.manual_seed(cfg.seed)
    fresh = CausalLM(get_preset("vq-tiny", vocab_size=260))
    books = {n: b for n, b in trained.named_buffers() if "codebook" in n}
    assert books and any(not torch.equal(b, dict(fresh.named_buffers())[n]) for n, b in books.items())  # EMA moved
    # validation runs in eval mode: it leaves the codebooks alone
    before = {n: b.clone() for n, b in books.items()}
    step_mod.evaluate(trained, open_prepared(cfg.cache_dir, "validation"), context_len=32, rows=2, max_tokens=128,
                         tokenizer=load_model(res.run_dir).tokenizer)
    assert all(torch.equal(before[n], b) for n, b in trained.named_buffers() if n in before)


def test_the_summary_states_the_speed_after_the_first_steps(tmp_path, tiny_config):
    """The ``done:`` line ends with the tokens per second of the steps after the first ``STEADY_AFTER`` (those hold the
    capture and compilation): with a row per step, that is the later rows' tokens over the sum of their seconds."""
    lines = []
    cfg = tiny_config(steps=trainer_mod.STEADY_AFTER + 4, log_every=1)
    res = train(cfg, out=tmp_path, name="speed", progress=False, echo=lines.append)
    done = next(line for line in lines if line.startswith("done: "))
    shown = float(done.split(" (")[1].split(" tokens/s")[0].replace(",", ""))
    rows = [r for r in read_metrics(res.run_dir) if "loss" in r and r["step"] > trainer_mod.STEADY_AFTER]
    assert len(rows) == 4
    seconds = sum(cfg.tokens_per_batch / r["tokens_per_s"] for r in rows)
    assert shown == pytest.approx(4 * cfg.tokens_per_batch / seconds, rel=1e-3, abs=1)
    few = []
    train(tiny_config(steps=trainer_mod.STEADY_AFTER), out=tmp_path, name="few", progress=False, echo=few.append)
    assert "tokens/s" not in next(line for line in few if line.startswith("done: "))
