"""lintime.training.tasks' step forms: the fixed-shape query loss, the shared MQARData, and the
graph step (``graph="eager"`` on the CPU: GraphedStep's body without the capture; ``capture`` on
CUDA) against the plain loop."""

from __future__ import annotations

import json

import pytest
import torch

from lintime.evaluation.tasks.mqar import MQARConfig, mqar_examples
from lintime.models import CausalLM
from lintime.training.tasks import MQARData, TaskRun, TaskTrainConfig, query_loss, train_task


@pytest.mark.parametrize("preset, short", [("transformer-pp-tiny", False), ("vq-tiny", False),
                                           ("transformer-pp-tiny", True)])
def test_fixed_shape_query_loss_equals_the_masked_one(preset, short):
    """Rule: bitwise where every row has its ``queries`` targets (the same rows in the same order
    through the same loss) -- the loss and every gradient.  ``short``: one row keeps 2 of its 4
    targets and 3 more positions are picked than a row has targets; those add nothing, but the loss
    then sums over more (zero) rows in another order: fp32 rounding, 1e-6 relative."""
    cfg = TaskTrainConfig(preset=preset, d_model=32, vocab_size=64, seq_len=32, kv_pairs=4)
    torch.manual_seed(0)
    model = CausalLM(cfg.model_config()).eval()
    x, y = mqar_examples(cfg.mqar, 6, seed=3)
    if short:
        y[0, y[0] != -100] = torch.tensor([-100, 40, -100, 41])
    losses, grads = [], []
    for queries in (None, cfg.mqar.queries + 3 * short):
        model.zero_grad()
        loss = query_loss(model, x, y, {}, queries=queries)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    if not short:
        assert torch.equal(losses[0], losses[1])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    else:
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
        for a, b in zip(*grads):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_mqar_data_serves_the_stream_and_refuses_another_setting(tmp_path):
    """Batches (also across generator blocks: 100 rows) and the test set are mqar_examples' rows."""
    task = MQARConfig(vocab_size=64, seq_len=32, kv_pairs=4)
    data = MQARData(task, seed=4, train_examples=1000, test_examples=50, device="cpu")
    for start in (0, 200, 500):
        x, y = data.batch(start, 100)
        rx, ry = mqar_examples(task, 100, seed=4, split="train", start=start)
        assert torch.equal(x, rx) and torch.equal(y, ry)
    assert torch.equal(data.test[1], mqar_examples(task, 50, seed=4, split="test")[1])
    cfg = TaskTrainConfig(d_model=32, vocab_size=64, seq_len=32, kv_pairs=4, seed=5, train_examples=1000,
                          test_examples=50, device="cpu")
    with pytest.raises(ValueError, match="another setting"):
        TaskRun(cfg, out=tmp_path, name="x", echo=None, data=data)
    with pytest.raises(ValueError, match="graph must be one of"):
        TaskTrainConfig(graph="cuda")


def _metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "vq-tiny"])
def test_graph_step_body_trains_as_the_plain_loop(tmp_path, preset):
    """``graph="eager"`` (GraphedStep without the capture: fused AdamW at an fp32 rate tensor, the
    loss over the counted targets, VQ's commitment loss through ``aux_weight``, here 0.1 so that it
    is ~15 % of the train loss) against the plain loop (the rate a Python float) over 24 steps and 3
    evaluations.  Rule: 1e-5 relative on the train and test losses -- the two differ by the rate's
    fp32 rounding only (~1e-7 relative here), while a lost aux term, a stale batch or a wrong rate
    moves them by > 1e-2; accuracies equal."""
    kw = dict(preset=preset, d_model=32, vocab_size=32, seq_len=16, kv_pairs=2, train_examples=256, test_examples=32,
              batch_size=32, device="cpu", max_steps=24, eval_every=8, early_stop=0.0, lr=3e-3, aux_weight=0.1)
    runs = {g: train_task(TaskTrainConfig(**kw, graph=g), out=tmp_path, name=g, echo=None, plot=False)
            for g in ("off", "eager")}
    plain, graph = _metrics(runs["off"]), _metrics(runs["eager"])
    assert [r["step"] for r in plain] == [r["step"] for r in graph] == [8, 16, 24]
    for a, b in zip(plain, graph):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)
        assert a["val_accuracy"] == b["val_accuracy"]


def test_runs_advanced_in_turn_equal_runs_alone(tmp_path):
    """Two runs sharing one MQARData and advanced a few steps at a time in turn (the sweep's
    worker) end where each ends alone.  Rule: bitwise (the same steps on the same batches)."""
    kw = dict(preset="transformer-pp-tiny", d_model=32, vocab_size=32, seq_len=16, kv_pairs=2, train_examples=256,
              test_examples=32, batch_size=32, device="cpu", max_steps=12, eval_every=6, early_stop=0.0)
    cfgs = [TaskTrainConfig(**kw, lr=3e-3), TaskTrainConfig(**kw, lr=1e-2)]
    alone = [train_task(c, out=tmp_path, name=f"alone{i}", echo=None, plot=False) for i, c in enumerate(cfgs)]
    data = MQARData(cfgs[0].mqar, seed=0, train_examples=256, test_examples=32, device="cpu")
    runs = [TaskRun(c, out=tmp_path, name=f"turn{i}", echo=None, plot=False, data=data) for i, c in enumerate(cfgs)]
    while not all(r.done for r in runs):
        for r in runs:
            if not r.done:
                r.advance(4)
    for a, r in zip(alone, runs):
        b = r.finish()
        assert (a.steps, a.accuracy, a.stopped) == (b.steps, b.accuracy, b.stopped) == (12, a.accuracy, "max_steps")
        assert [m["loss"] for m in _metrics(a)] == [m["loss"] for m in _metrics(b)]


def test_a_failed_capture_falls_back_or_raises(tmp_path, monkeypatch):
    """A step that does not capture (GraphedStep.step gives None with a reason): by default the run
    goes on with the plain loop and says so in its form; ``fallback=False`` raises CaptureFailed
    (the sweep then retries the run in a fresh process) without taking a step."""
    from lintime.training.graphed import GraphedStep
    from lintime.training.tasks import CaptureFailed

    def no_capture(self, x, y, lr):
        self.failed = "operation not permitted when stream is capturing"
        return None

    monkeypatch.setattr(GraphedStep, "step", no_capture)
    kw = dict(preset="transformer-pp-tiny", d_model=32, vocab_size=32, seq_len=16, kv_pairs=2, train_examples=64,
              test_examples=16, batch_size=16, device="cpu", max_steps=4, eval_every=2, graph="eager")
    run = TaskRun(TaskTrainConfig(**kw), out=tmp_path, name="a", echo=None, plot=False)
    run.advance(1)
    assert run.step == 1 and run.form.startswith("off (the capture failed: operation not permitted")
    strict = TaskRun(TaskTrainConfig(**kw), out=tmp_path, name="b", echo=None, plot=False, fallback=False)
    with pytest.raises(CaptureFailed, match="not permitted"):
        strict.advance(1)
    assert strict.step == 0


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "gla-tiny", "vq-tiny"])
def test_captured_task_step_trains_as_the_eager_one(tmp_path, preset):
    """On CUDA the default step is captured; it must capture (no notice) and train as GraphedStep's
    eager body does.  Rule: 1 % per evaluation's train loss (bf16 autocast; both run the same
    kernels, but a replay and an eager step may pick other cuBLAS algorithms), accuracies within
    0.05 on 256 test examples."""
    kw = dict(preset=preset, d_model=64, seq_len=64, kv_pairs=4, train_examples=4096, test_examples=256,
              batch_size=64, device="cuda", max_steps=60, eval_every=20, early_stop=0.0, lr=2.2e-3)
    lines: list[str] = []
    cap = train_task(TaskTrainConfig(**kw, graph="auto"), out=tmp_path, name="cap", echo=lines.append, plot=False)
    eag = train_task(TaskTrainConfig(**kw, graph="eager"), out=tmp_path, name="eag", echo=None, plot=False)
    assert any("step capture" in line for line in lines) and not any("does not capture" in line for line in lines)
    for a, b in zip(_metrics(cap), _metrics(eag)):
        assert abs(a["loss"] - b["loss"]) <= 0.01 * abs(b["loss"]), (a, b)
        assert abs(a["val_accuracy"] - b["val_accuracy"]) <= 0.05, (a, b)
