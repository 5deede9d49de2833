"""lintime.training.tasks at CPU sizes: the query-only loss equals the model's loss on every
position, the plain step is forward_backward on rows, pre-drawn test examples score as drawn ones,
the time-boxed schedule (steps, evaluations, a cosine that still ends at 0) and the three ways a run
stops."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lintime.evaluation.tasks.mqar import MQARConfig, QueryLoss, evaluate_mqar, mqar_examples, query_loss
from lintime.models import CausalLM
from lintime.training.step import forward_backward
from lintime.training.tasks import TaskTrainConfig, _Rows, cosine_lr, schedule, train_task


@pytest.mark.parametrize("micro", [8, 4])
def test_the_plain_task_step_is_forward_backward_on_rows(micro):
    """TaskRun's plain step, forward_backward(packed=False) on QueryLoss: in one micro-batch the same
    gradients, bit for bit, as the query loss over the batch's targets taken by hand; in two, the
    accumulated ones within fp32 rounding."""
    from tolerances import assert_exact

    cfg = TaskTrainConfig(preset="vq-tiny", d_model=32, vocab_size=64, seq_len=32, kv_pairs=4, aux_weight=0.1)
    torch.manual_seed(0)
    model = CausalLM(cfg.model_config()).eval()  # eval: the codebook stays put between the two passes
    x, y = mqar_examples(cfg.mqar, 8, seed=3)
    n = 8 * cfg.mqar.queries
    aux: dict = {}
    loss = query_loss(model, x, y, aux, queries=cfg.mqar.queries) / n
    loss = loss + cfg.aux_weight * sum(v.float() for v in aux.values())
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    ce, aux_loss = forward_backward(QueryLoss(model, cfg.mqar.queries), _Rows(x, y), micro_rows=micro,
                                    aux_weight=cfg.aux_weight, n_targets=n, packed=False)
    assert math.isclose(ce + aux_loss, loss.item(), rel_tol=1e-6)
    for (name, p), g in zip(model.named_parameters(), ref):
        if micro == 8:
            assert torch.equal(p.grad, g), name
        else:
            assert_exact(name, g, p.grad)


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "vq-tiny"])
def test_query_loss_equals_the_full_loss(preset):
    """Same summed loss and same gradients as ``model(x, targets=y)`` (which computes every
    position's logits); Transformer-VQ's commitment loss still reaches ``aux_losses``."""
    cfg = TaskTrainConfig(preset=preset, d_model=32, vocab_size=64, seq_len=32, kv_pairs=4)
    torch.manual_seed(0)
    model = CausalLM(cfg.model_config()).eval()  # eval: Transformer-VQ's codebook moves in training forwards
    x, y = mqar_examples(cfg.mqar, 6, seed=2)
    aux: dict = {}
    ours = query_loss(model, x, y, aux)
    ours.backward()
    g_ours = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    ref = model(x, targets=y)
    ref.backward()
    g_ref = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    assert len(g_ours) == len(g_ref)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert (preset == "vq-tiny") == ("vq_commit" in aux)


def test_pre_drawn_examples_score_as_drawn_ones():
    cfg = MQARConfig(vocab_size=64, seq_len=32, kv_pairs=4)
    torch.manual_seed(0)
    model = CausalLM(TaskTrainConfig(d_model=32, vocab_size=64, seq_len=32, kv_pairs=4).model_config())
    drawn = evaluate_mqar(model, cfg, n_examples=70, seed=5, batch_size=16)
    given = evaluate_mqar(model, cfg, n_examples=70, seed=5, batch_size=32,
                          examples=mqar_examples(cfg, 70, seed=5, split="test"))
    assert (given.accuracy, given.n_queries) == (drawn.accuracy, drawn.n_queries) == (given.accuracy, 280)
    assert given.loss == pytest.approx(drawn.loss, rel=1e-5)
    with pytest.raises(ValueError, match="examples must be"):
        evaluate_mqar(model, cfg, n_examples=70, examples=mqar_examples(cfg, 60, split="test"))


def test_schedule_of_zoology_and_of_a_time_boxed_run():
    # Zoology: 64 epochs of 100 000 // 512 = 195 batches, one evaluation per epoch
    assert schedule(TaskTrainConfig()) == (64 * 195, 195, 64)
    # the sweep: cut at 800 steps, an evaluation every 50; the cosine keeps Zoology's length
    # (12 480 steps = 250 evaluations), so the run ends near the peak rate
    steps, stage, stages = schedule(TaskTrainConfig(max_steps=800, eval_every=50))
    assert (steps, stage, stages) == (800, 50, 250)
    assert cosine_lr(1.0, steps // stage - 1, stages) > 0.99
    # a cap that does not divide: the last evaluation comes at the cap
    assert schedule(TaskTrainConfig(max_steps=120, eval_every=50, batch_size=64)) == (120, 50, 64 * 1562 // 50 + 1)
    # a cap above the epochs' steps does not bind
    assert schedule(TaskTrainConfig(train_examples=1024, epochs=2, max_steps=10_000)) == (4, 2, 2)


def _tiny(**kw) -> TaskTrainConfig:
    base = dict(preset="transformer-pp-tiny", d_model=32, vocab_size=32, seq_len=16, kv_pairs=2, train_examples=256,
                test_examples=32, batch_size=32, device="cpu", n_heads=1, position="none")
    return TaskTrainConfig(**{**base, **kw})


def test_a_capped_run_evaluates_every_eval_every_steps(tmp_path):
    res = train_task(_tiny(epochs=64, max_steps=20, eval_every=8, early_stop=0.0, lr=3e-3), out=tmp_path, name="a",
                     echo=None, plot=False)
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [8, 16, 20] and res.steps == 20 and res.stopped == "max_steps"
    lrs = [r["lr"] for r in rows]  # Zoology's cosine (64 epochs of 8 batches = 64 evaluations), cut at step 20
    assert lrs == pytest.approx([3e-3 * 0.5 * (1 + math.cos(math.pi * i / 64)) for i in range(3)])
    assert rows[1]["epoch"] == 2 and rows[2]["epoch"] == 2.5  # 8 batches per epoch
    assert res.accuracy == rows[-1]["val_accuracy"] and not (res.run_dir / "accuracy_vs_epoch.png").exists()


def test_a_run_stops_at_its_wall_clock_cap(tmp_path):
    res = train_task(_tiny(max_steps=100_000, eval_every=1000, early_stop=0.0, max_seconds=0.5), out=tmp_path,
                     name="b", echo=None, plot=False)
    rows = (res.run_dir / "metrics.jsonl").read_text().splitlines()
    assert res.stopped == "max_seconds" and 1 <= res.steps < 100_000 and len(rows) == 1
    assert 0.0 <= res.accuracy <= 1.0


def test_a_run_stops_early_above_the_target(tmp_path):
    """Any accuracy is above early_stop = 1e-9 once a query is right; a run that never gets one
    right runs to its end: either way the reason is stated."""
    res = train_task(_tiny(max_steps=24, eval_every=4, early_stop=1e-9, lr=1e-2), out=tmp_path, name="c", echo=None,
                     plot=False)
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    if res.stopped == "early stop":
        assert rows[-1]["val_accuracy"] > 0 and all(r["val_accuracy"] == 0 for r in rows[:-1])
    else:
        assert res.stopped == "max_steps" and all(r["val_accuracy"] == 0 for r in rows)
