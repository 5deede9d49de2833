"""Distributed training on the CPU: 2 gloo processes (tests/distributed/launch.py, hard timeouts).

* context parallelism: logits and every parameter gradient of 2 ranks (each holding half of every
  row, documents crossing the split) equal the single-process model's, fp64, for the mixed chunk
  (FLASH), GLA, linear and VQ families;
* DDP, FSDP2 and context-parallel training: per-step losses of ``lintime.training.train`` on 2
  processes equal a single process at the same global batch (fp32, with gradient accumulation);
* resume on another number of processes: a 2-process FSDP run stopped after 2 steps (distributed
  checkpoint) and continued on 1 process gives the uninterrupted single-process losses, and its
  checkpoint loads through ``load_model``.

Tolerances: fp64 op checks use ``lintime.testing.assert_exact`` (the fp64 tolerance for two exact forms); the fp32 training losses agree to
1e-5 relative -- the only differences are summation orders (gradient reduction over ranks, the
chunked ops' partial sums), ~1e-7 per step, and 4 steps of AdamW amplify them little.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from launch import run_ranks
from workers import context_parallel_step, single_step, tiny_model, train_run

from lintime.models import CausalLM, get_preset
from lintime.testing import assert_exact
from lintime.training import TrainConfig, load_model, train
from lintime.training.parallel import ContextParallel, DistEnv

LOSS_RTOL = 1e-5
CP_PRESETS = (("flash-tiny", 8), ("gla-tiny", 8), ("linear-tiny", 8), ("vq-tiny", 8))
ROWS, T = 2, 64


def _cp_all(cases) -> list:
    return [context_parallel_step(p, c, ROWS, T) for p, c in cases]


def test_context_parallel_equals_single_process():
    outs = run_ranks(_cp_all, 2, CP_PRESETS, timeout=240)
    for i, (preset, chunk) in enumerate(CP_PRESETS):
        ref = single_step(preset, chunk, ROWS, T)
        r0, r1 = outs[0][i], outs[1][i]
        logits = torch.cat([r0["logits"].view(ROWS, T // 2, -1), r1["logits"].view(ROWS, T // 2, -1)], 1)
        assert_exact(f"{preset} logits", ref["logits"].view(ROWS, T, -1), logits)
        assert math.isclose(r0["loss"] + r1["loss"], ref["loss"], rel_tol=1e-12)
        assert set(r0["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            assert_exact(f"{preset} grad {name}", g, r0["grads"][name])


def _losses(result) -> list[float]:
    return [loss for _, loss in result["losses"]]


def _run_losses(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("loss") is not None]


def test_ddp_fsdp_and_context_parallel_losses_equal_single_process(base_config, tmp_path):
    refs: dict[int, list[float]] = {}
    for parallel, cp in (("ddp", 1), ("fsdp", 1), ("none", 2)):
        # context parallel: each rank's half row must be whole chunks (flash-tiny: C = 64)
        cfg = dict(base_config, context_len=64 * cp)
        if cp not in refs:
            ref = train(TrainConfig(**cfg), out=str(tmp_path), name=f"single-{cp}", progress=False, echo=None)
            refs[cp] = _run_losses(ref.run_dir)
        single = refs[cp]
        assert len(single) == base_config["steps"]
        cfg = dict(cfg, parallel=parallel, context_parallel=cp)
        res = run_ranks(train_run, 2, cfg, str(tmp_path), f"{parallel}-cp{cp}", timeout=240)
        got = _losses(res[0])
        assert len(got) == len(single), (parallel, cp)
        for step, (a, b) in enumerate(zip(single, got), 1):
            assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"{parallel} cp={cp} step {step}: {b} vs single {a}"


def test_resume_on_another_world_size(base_config, tmp_path):
    full = train(TrainConfig(**base_config), out=str(tmp_path), name="full", progress=False, echo=None)
    single = _run_losses(full.run_dir)
    cfg = dict(base_config, parallel="fsdp")
    first = run_ranks(train_run, 2, cfg, str(tmp_path), "split", None, 2, timeout=240)
    assert first[0]["step"] == 2
    ckpt_dir = tmp_path / "split" / "checkpoints" / "step_00000002"
    assert (ckpt_dir / "optimizer").is_dir() and (ckpt_dir / "model.safetensors").is_file()
    loaded = load_model(ckpt_dir)  # the HF exporter / eval / generate path
    assert loaded.step == 2
    # continue on one process (no torchrun): DCP re-shards the optimizer state
    rest = train(TrainConfig(**dict(base_config, parallel="none")), out=str(tmp_path), resume=tmp_path / "split",
                 progress=False, echo=None)
    assert rest.step == base_config["steps"]
    got = _run_losses(tmp_path / "split")
    assert len(got) == len(single)
    for step, (a, b) in enumerate(zip(single, got), 1):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"step {step}: resumed {b} vs single {a}"


def test_context_parallel_refuses_quadratic_attention_and_bad_lengths():
    env = DistEnv(world=2, cp_size=2, cp_rank=0)
    with pytest.raises(ValueError, match="quadratic attention"):
        ContextParallel(CausalLM(get_preset("transformer-tiny")), env)
    cp = ContextParallel(tiny_model("flash-tiny", 8), env)
    with pytest.raises(ValueError, match="multiple of 8"):
        cp.check_length(40)  # 20 tokens per rank: not whole chunks
    cp.check_length(48)
    cp.remove()


def test_config_validates_parallel_settings():
    with pytest.raises(ValueError, match="parallel must be one of"):
        TrainConfig(parallel="zero")
    with pytest.raises(ValueError, match="context_parallel"):
        TrainConfig(context_parallel=0)
    assert dataclasses.replace(TrainConfig(), parallel="fsdp").parallel == "fsdp"
