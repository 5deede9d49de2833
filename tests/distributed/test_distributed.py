"""Distributed training on the CPU: 2 gloo processes (tests/distributed/launch.py, hard timeouts).

Every 2-process scenario runs in ONE launch (``workers.scenarios``: the same two processes run
them in turn; a process start-up costs seconds on a loaded CI machine; the launch also runs the checks of
test_ddp_graph_step.py and test_fsdp_compiled_step.py, tests/distributed/plan.py), and the single-process
references and resumes run in the test process; the ``two_ranks`` fixture does it all once and
the tests below check its pieces:

* context parallelism: logits and every parameter gradient of 2 ranks (each holding half of every
  row, documents crossing the split) equal the single-process model's, fp64, for the mixed chunk
  (FLASH), GLA, linear and VQ families; and under bf16 autocast for FLASH and VQ, whose final
  states are partly bf16 while the receiving rank starts from fp32 (the hand-off casts to the
  receiver's dtypes: a bf16 send against an fp32 receive hung NCCL), by the half-precision rule;
* DDP, FSDP2 and context-parallel training: per-step losses of ``lintime.training.train`` on 2
  processes equal a single process at the same global batch (fp32, with gradient accumulation);
* resume, every way between world sizes 1 and 2: checkpoints taken at step 2 of 4 (after a
  validation pass, which leaves the FSDP root unsharded: the case that once lost the optimizer
  state of the root's parameters) continued 1 -> 2 (FSDP and DDP, a single-process checkpoint
  under torchrun), 2 -> 2 (DDP), 2 -> 1 (FSDP and DDP): all four per-step losses equal the
  uninterrupted single-process run's, and a distributed checkpoint loads through ``load_model``;
* clean shutdown: a rank that raises in step 2 ends both processes with a non-zero exit status
  well within the collective timeout.

Tolerances: fp64 op checks use ``assert_exact`` (tests/tolerances.py) (the fp64 tolerance for two exact
forms); the fp32 training losses agree to 1e-5 relative -- the only differences are summation
orders (gradient reduction over ranks, the chunked ops' partial sums), ~1e-7 per step, and 4 steps
of AdamW amplify them little (a lost optimizer state or a wrong batch moves a loss by >= 1e-4).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from launch import run_ranks_outcome
from plan import (
    CLIP,
    CLIP_WRAPS,
    CP_AMP_PRESETS,
    CP_PRESETS,
    ONE_RANK_RESUMES,
    ROWS,
    SHARD_STEP,
    STEP2,
    STEPS,
    TWO_RANK_RUNS,
    T,
)
from plan import config as _config
from workers import clip_rows, fail_at, single_step, tiny_model

from lintime.models import CausalLM, get_preset
from tolerances import (
    HALF_FACTOR,
    HALF_FLOOR,
    assert_exact,
    assert_half_rule,
    rel_rms,
)
from lintime.training import TrainConfig, load_model
from lintime.training.context_parallel import ContextParallel
from lintime.training.parallel import DistEnv

LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def two_ranks(launched_all) -> dict:
    """The folder's one launch (``launched_all`` of tests/distributed/conftest.py, ``plan.launch_all``): the
    single-process references, every 2-process scenario in one launch, then the 2 -> 1 resumes.  ``{"out", "single":
    {cp: losses}, "cp_ops": [...], "cp_amp_ops": [...], "runs": {name: result}, "resumed": {name: (TrainResult,
    losses)}, "clip", "shard_step", ...}``."""
    return launched_all


def _assert_losses(label: str, ref: list[float], got: list[float]) -> None:
    assert len(got) == len(ref) == STEPS, (label, got)
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"{label} step {step}: {b} vs single process {a}"


def test_context_parallel_equals_single_process(two_ranks):
    for (preset, chunk), (r0, r1) in zip(CP_PRESETS, two_ranks["cp_ops"]):
        ref = single_step(preset, chunk, ROWS, T)
        logits = torch.cat([r0["logits"].view(ROWS, T // 2, -1), r1["logits"].view(ROWS, T // 2, -1)], 1)
        assert_exact(f"{preset} logits", ref["logits"].view(ROWS, T, -1), logits)
        assert math.isclose(r0["loss"] + r1["loss"], ref["loss"], rel_tol=1e-12)
        assert set(r0["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            assert_exact(f"{preset} grad {name}", g, r0["grads"][name])


def test_context_parallel_under_bf16_autocast(two_ranks):
    """fp32 model, bf16 autocast (``--precision bf16``): the mixed chunk (FLASH) and VQ mixers
    return their partial-chunk buffers in bf16 while the receiving rank starts from a state in the
    residual stream's fp32.  The hand-off once sent bf16 against an fp32 receive: gloo aborted a
    rank here (size mismatch in the backward), NCCL hung (2 H200, 2026-11-22).  Now both ranks finish (the launch's
    timeout turns a hang into a failure) and logits and gradients obey the half-precision rule
    against the fp64 single process, with the single-process bf16 run as the baseline."""
    for (preset, chunk), (r0, r1) in zip(CP_AMP_PRESETS, two_ranks["cp_amp_ops"]):
        ref64 = single_step(preset, chunk, ROWS, T)
        base = single_step(preset, chunk, ROWS, T, amp=True)
        logits = torch.cat([r0["logits"].view(ROWS, T // 2, -1), r1["logits"].view(ROWS, T // 2, -1)], 1)
        assert logits.dtype == torch.bfloat16
        assert_half_rule(f"{preset} bf16 logits", ref64["logits"].view(ROWS, T, -1), logits,
                         base["logits"].view(ROWS, T, -1))
        assert set(r0["grads"]) == set(ref64["grads"])
        for name, g64 in ref64["grads"].items():
            # parameter gradients are fp32 (autocast keeps the parameters fp32): the same rule
            # with bf16's floor
            err, err_base = rel_rms(g64, r0["grads"][name]), rel_rms(g64, base["grads"][name])
            bound = HALF_FACTOR * err_base + HALF_FLOOR[torch.bfloat16]
            assert err <= bound, f"{preset} bf16 grad {name}: error {err:.3e} > {bound:.3e}"


def test_fsdp_gradient_clipping_equals_single_process(two_ranks):
    """The sharded clip (squared norms of the local shards, one all-reduce, the replicated 0-D
    ScaledSin scale counted once) against ``torch.nn.utils.clip_grad_norm_`` on one process:
    the norm and every clipped gradient, fp32 (only summation orders differ), for both
    ``wrap_model`` layouts of ``CLIP_WRAPS``."""
    preset, chunk, T, max_norm = CLIP
    model = tiny_model(preset, chunk, dtype=torch.float32)
    assert any(p.dim() == 0 for p in model.parameters())  # the replicated case is covered
    ids = clip_rows(2, T, model.config.vocab_size)
    (model(ids[:, :-1], targets=ids[:, 1:]) / (2 * (T - 1))).backward()
    ref = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    assert ref > 4 * max_norm  # the clip bites
    for wrap, ranks in zip(CLIP_WRAPS, two_ranks["clip"]):
        for rank, got in enumerate(ranks):
            assert isinstance(got["norm"], torch.Tensor) and got["norm"].dim() == 0  # to_host=False: no read
            assert math.isclose(float(got["norm"]), ref, rel_tol=1e-5), (wrap, rank, float(got["norm"]), ref)
            for name, p in model.named_parameters():
                torch.testing.assert_close(got["grads"][name], p.grad, rtol=1e-4, atol=1e-7, msg=f"{wrap} rank {rank} {name}")


def test_optimizer_step_on_local_shards_is_bitwise_the_dtensor_step(two_ranks):
    """``ShardStep`` (fused AdamW on the shards' local tensors, no DTensor dispatch) against
    ``optimizer.step()`` on the DTensors: after 4 steps (its state replaced by a copy before step
    3) every parameter and every ``exp_avg`` is bit for bit the same, and the optimizer's own
    DTensor state is the one updated (what a sharded checkpoint saves)."""
    for rank, got in enumerate(two_ranks["shard_step"]):
        ref, local = got["dtensor"], got["local"]
        assert ref["params"].keys() == local["params"].keys() and len(ref["exp_avg"]) == len(ref["params"])
        for kind in ("params", "exp_avg"):
            for name, t in ref[kind].items():
                assert torch.equal(t, local[kind][name]), f"rank {rank} {kind} {name}"
        start = tiny_model(*SHARD_STEP[:2], dtype=torch.float32)
        assert any(not torch.equal(p.detach(), local["params"][n]) for n, p in start.named_parameters())  # it trained


@pytest.mark.parametrize("name", ["ddp", "fsdp", "cp"])
def test_two_process_losses_equal_single_process(two_ranks, name):
    cp = {n: c for n, _, c, _ in TWO_RANK_RUNS}[name]
    run = two_ranks["runs"][name]
    assert run["step"] == STEPS
    _assert_losses(name, two_ranks["single"][cp], [loss for _, loss in run["losses"]])


@pytest.mark.parametrize("name", ["single-to-fsdp2", "single-to-ddp2", "ddp-to-ddp2"])
def test_resume_on_two_processes(two_ranks, name):
    run = two_ranks["runs"][name]
    ref = two_ranks["single"][1]
    assert run["step"] == STEPS
    # the first step this call took is step 3 (it resumed, not restarted)
    assert math.isclose(run["first_loss"], ref[2], rel_tol=LOSS_RTOL), (run["first_loss"], ref)
    _assert_losses(name, ref, [loss for _, loss in run["losses"]])


@pytest.mark.parametrize("name", [n for n, _ in ONE_RANK_RESUMES])
def test_resume_on_one_process(two_ranks, name):
    res, losses = two_ranks["resumed"][name]
    ref = two_ranks["single"][1]
    assert res.step == STEPS and math.isclose(res.first_loss, ref[2], rel_tol=LOSS_RTOL)
    _assert_losses(name, ref, losses)


def test_distributed_checkpoint_loads_with_load_model(two_ranks):
    ckpt_dir = two_ranks["out"] / "fsdp" / STEP2
    assert (ckpt_dir / "optimizer").is_dir() and (ckpt_dir / "model.safetensors").is_file()
    loaded = load_model(ckpt_dir)  # the HF exporter / eval / generate path
    assert loaded.step == 2
    plain = load_model(two_ranks["out"] / "single-cp1" / STEP2).model
    for (n, a), (_, b) in zip(loaded.model.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)


def test_failing_rank_ends_every_process(base, tmp_path):
    """Rank 1 raises in step 2 while rank 0 waits for it in the gradient reduction: both must
    exit non-zero by themselves, rank 0 within seconds of rank 1 (not by the 60 s collective
    timeout; start-up and step 1 take ~15 s of the launch on a loaded 2-core machine)."""
    cfg = _config(base, parallel="ddp", eval_every=0, save_every=0)
    outcome = run_ranks_outcome(fail_at, 2, cfg, str(tmp_path), "fail", 1, 2, timeout=120, dist_timeout_s=60)
    for rank, o in enumerate(outcome):
        assert o["status"] != "hung", f"rank {rank} hung: {outcome}"
        assert o["exitcode"] not in (0, None), f"rank {rank} exited with {o['exitcode']}: {outcome}"
    lag = outcome[0]["seconds"] - outcome[1]["seconds"]
    assert lag < 20, f"rank 0 stopped {lag:.0f} s after the failing rank 1"
    assert "injected failure in step 2" in outcome[1]["report"]
    assert outcome[0]["status"] == "error"


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
