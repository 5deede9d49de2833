"""Recipes and learning-rate schedules against the seeds' numbers and formulas."""

from __future__ import annotations

import math

import pytest

from lintime.training import RECIPES, TrainConfig
from lintime.training.config import DEFAULT_STEPS, SMALL_MODEL_LR
from lintime.training.schedule import lr_at_progress, lr_at_step

N, W = 125_000, 10_000  # FLASH Tables 6-7 and Transformer-VQ App. C: 125K steps, 10K warm-up


def _lr(recipe: str, step: int, total: int = N) -> float:
    r = RECIPES[recipe]
    return lr_at_step(step, total, peak=r.lr, warmup=r.warmup, decay=r.decay, final_lr_ratio=r.final_lr_ratio)


def test_recipe_numbers_are_the_seeds():
    f = RECIPES["flash"]  # FLASH seed Tables 6 and 7
    assert (f.lr, f.betas, f.eps, f.weight_decay, f.decay, f.final_lr_ratio, f.clip) == (7e-4, (0.9, 0.999), 1e-6, 0.01, "linear", 0.0, 0.1)
    assert round(f.warmup * N) == W
    v = RECIPES["vq"]  # Transformer-VQ App. C (AdamW, Enwik8 column of Table 10)
    assert (v.lr, v.betas, v.eps, v.weight_decay, v.decay, v.final_lr_ratio, v.clip, v.aux_weight) == (
        4e-4, (0.9, 0.98), 1e-9, 2e-4, "cosine", 0.1, 0.1, 1e-4)
    assert round(v.warmup * N) == W
    g = RECIPES["gla"]  # GLA seed: AdamW, 3e-4, cosine
    assert (g.lr, g.decay) == (3e-4, "cosine")


def test_flash_linear_warmup_then_linear_decay_to_zero():
    peak = 7e-4
    # warm-up: lr(s) = peak * (s + 1) / W
    for s in (0, 1, 4_999, W - 1):
        assert _lr("flash", s) == pytest.approx(peak * (s + 1) / W, rel=1e-12)
    assert _lr("flash", W) == pytest.approx(peak)
    # linear decay: lr = peak * (1 - (s - W) / (N - W))
    for s in (W + 1, 60_000, 100_000, N - 1):
        assert _lr("flash", s) == pytest.approx(peak * (1 - (s - W) / (N - W)), rel=1e-12)
    assert _lr("flash", N) == 0.0


def test_vq_cosine_decays_by_ten():
    peak = 4e-4
    assert _lr("vq", W - 1) == pytest.approx(peak)
    for s in (W, 30_000, 67_500, 110_000, N):
        q = (s - W) / (N - W)
        assert _lr("vq", s) == pytest.approx(peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * q))), rel=1e-12)
    assert _lr("vq", N) == pytest.approx(0.1 * peak)  # "decayed by a 10x factor"
    assert _lr("vq", (N + W) // 2) == pytest.approx(0.55 * peak)


def test_gla_cosine_to_zero_and_monotone():
    lrs = [_lr("gla", s, 1000) for s in range(1000)]
    w = round(RECIPES["gla"].warmup * 1000)
    assert max(lrs) == pytest.approx(3e-4)
    assert all(a <= b for a, b in zip(lrs[:w], lrs[1:w]))
    assert all(a >= b for a, b in zip(lrs[w:], lrs[w + 1 :]))
    assert _lr("gla", 1000, 1000) == 0.0


def test_constant_and_time_schedule():
    assert lr_at_step(50, 100, peak=1.0, warmup=0.1, decay="constant", final_lr_ratio=0.0) == 1.0
    # the clock-driven schedule is the step curve at a fraction of the horizon
    for p in (0.0, 0.05, 0.5, 0.99):
        assert lr_at_progress(p, peak=1.0, warmup=0.08, decay="linear", final_lr_ratio=0.0) == pytest.approx(
            lr_at_step(int(p * 1e6), 10**6, peak=1.0, warmup=0.08, decay="linear", final_lr_ratio=0.0))
    assert lr_at_progress(1.5, peak=1.0, warmup=0.1, decay="linear", final_lr_ratio=0.0) < 1e-5


def test_train_config_resolves_recipe_and_overrides():
    cfg = TrainConfig(preset="flash-small", recipe="vq").resolved()
    assert (cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.decay, cfg.final_lr_ratio, cfg.clip) == (4e-4, 0.9, 0.98, 1e-9, "cosine", 0.1, 0.1)
    assert cfg.steps == DEFAULT_STEPS == 300  # no budget given: the default step budget
    assert TrainConfig(recipe="vq").resolved().lr == SMALL_MODEL_LR  # flash-tiny: under SMALL_MODEL_PARAMS
    cfg = TrainConfig(recipe="flash", lr=1e-3, clip=0.0, time_minutes=2.0).resolved()
    assert (cfg.lr, cfg.clip, cfg.steps, cfg.eps) == (1e-3, 0.0, None, 1e-6)
    cfg = TrainConfig(context_len=128, tokens_per_batch=1024, micro_batch_tokens=256, tokens=5000)
    assert (cfg.rows_per_batch, cfg.rows_per_micro_batch, cfg.accumulation_steps, cfg.step_budget) == (8, 2, 4, 5)
    assert TrainConfig.from_dict(cfg.resolved().to_dict()) == cfg.resolved()


@pytest.mark.parametrize("bad", [
    dict(steps=-1), dict(steps=0), dict(context_len=0), dict(tokens_per_batch=1000, context_len=256),
    dict(micro_batch_tokens=3072), dict(micro_batch_tokens=100), dict(lr=-1.0), dict(warmup=1.0),
    dict(recipe="adam"), dict(objective="seq2seq"), dict(decay="step"), dict(time_minutes=0),
    dict(beta2=1.0), dict(keep=-1), dict(temperature=-0.5), dict(tokens=0), dict(device="tpu"),
])
def test_train_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="train config"):
        TrainConfig(**bad)
