"""MQAR on a mixture of points (Zoology's multi-point training, issue 43): the mixture's text, batches
that hold every point in its stated proportion (each row the example the point's own stream has
there, padded), a loss the padding never enters (against each point's loss computed on its own,
unpadded), and a tiny mixture run on a CPU that learns every point and reports each."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lintime.evaluation.tasks.mqar import (
    IGNORE_INDEX,
    ZOOLOGY_MIX,
    MQARConfig,
    MQARMixData,
    QueryLoss,
    format_mix,
    mix_rows,
    mix_unit,
    mqar_examples,
    parse_mix,
    parse_points,
    query_loss,
)
from lintime.models import CausalLM
from lintime.training.step import forward_backward
from lintime.training.tasks import TaskTrainConfig, _Rows, train_task

MIX = ((16, 2, 300), (32, 4, 100), (32, 8, 200))  # proportions 3 : 1 : 2


def test_the_mix_text():
    assert parse_mix("zoology") == ZOOLOGY_MIX == ((64, 4, 100_000), (128, 8, 20_000), (256, 16, 20_000),
                                                   (256, 32, 20_000), (256, 64, 20_000))
    assert parse_mix("64x4:10,128/8:30") == ((64, 4, 10), (128, 8, 30))
    assert parse_mix("64x4,128x8,256x16", 100) == ((64, 4, 33), (128, 8, 33), (256, 16, 33))
    assert parse_mix(format_mix(ZOOLOGY_MIX)) == ZOOLOGY_MIX
    for bad in ("64x4:10,128x8", "64x4,64x4", "64x4:0", "64:4", "", "64x4,128x8"):
        with pytest.raises(ValueError):
            parse_mix(bad, None if bad == "64x4,128x8" else 100)
    assert parse_points("64x4, 512/128,64x4") == [(64, 4), (512, 128)]
    assert mix_unit(ZOOLOGY_MIX) == 9 and mix_rows(ZOOLOGY_MIX, 252) == (140, 28, 28, 28, 28)
    with pytest.raises(ValueError, match="multiple of 9"):
        mix_rows(ZOOLOGY_MIX, 256)
    # the config: seq_len / kv_pairs / train_examples derived, Zoology's 256 rows rounded to the unit
    cfg = TaskTrainConfig(mix=ZOOLOGY_MIX)
    assert (cfg.seq_len, cfg.kv_pairs, cfg.train_examples, cfg.rows) == (256, 64, 180_000, 252)
    assert cfg.batch_targets == 140 * 4 + 28 * (8 + 16 + 32 + 64) and cfg.queries == 64
    assert TaskTrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="multiple of 9"):
        TaskTrainConfig(mix=ZOOLOGY_MIX, batch_size=256)
    with pytest.raises(ValueError, match="mqar:"):  # each point is checked: 16 pairs do not fit 32 tokens
        TaskTrainConfig(mix=((32, 16, 10), (64, 4, 10)))
    with pytest.raises(ValueError, match="twice"):
        TaskTrainConfig(mix=((32, 4, 10), (32, 4, 20)))


def test_mixture_batches_hold_each_point_in_its_proportion():
    points = tuple(MQARConfig(vocab_size=64, seq_len=T, kv_pairs=n) for T, n, _ in MIX)
    data = MQARMixData(points, tuple(c for *_, c in MIX), seed=5, rows=12, test_examples=10, device="cpu")
    assert data.shares == (6, 2, 4)  # 12 rows x 300 / 100 / 200 of 600
    n_batches = 600 // 12
    for b in (0, 1, n_batches - 1):
        x, y = data.batch(b * 12, 12)
        assert x.shape == y.shape == (12, 32)
        row = 0
        for p, share in zip(points, data.shares):
            want_x, want_y = mqar_examples(p, share, seed=5, start=b * share)  # the point's own stream
            got_x, got_y = x[row:row + share], y[row:row + share]
            assert torch.equal(got_x[:, :p.seq_len], want_x) and torch.equal(got_y[:, :p.seq_len], want_y)
            assert (got_x[:, p.seq_len:] == 0).all() and (got_y[:, p.seq_len:] == IGNORE_INDEX).all()
            assert ((got_y != IGNORE_INDEX).sum(1) == p.kv_pairs).all()  # every row scores its point's queries
            row += share
    # over an epoch each point's examples are used once: share x batches <= its count
    assert [s * n_batches for s in data.shares] == [300, 100, 200]
    with pytest.raises(ValueError, match="whole batches"):
        data.batch(5, 12)


@pytest.mark.parametrize("preset", ["transformer-pp-tiny", "flash-tiny", "gla-tiny"])
def test_padding_never_enters_the_loss(preset):
    """The mixed batch's query loss and gradients (the trainer's eager step: forward_backward on QueryLoss
    with the batch's target count) equal the per-point losses computed on each point's rows alone, at its
    own length, summed; random tokens in the padding change nothing."""
    cfg = TaskTrainConfig(preset=preset, d_model=32, vocab_size=64, mix=MIX, batch_size=6)
    torch.manual_seed(0)
    model = CausalLM(cfg.model_config()).eval()
    data = MQARMixData(cfg.points, cfg.point_examples, seed=1, rows=6, test_examples=4, device="cpu")
    x, y = data.batch(6, 6)
    total = int(y.ne(IGNORE_INDEX).sum())
    assert total == cfg.batch_targets

    # by hand: each point's rows at their own length
    ref_loss = 0.0
    row = 0
    for p, share in zip(cfg.points, cfg.point_rows):
        xi, yi = x[row:row + share, :p.seq_len], y[row:row + share, :p.seq_len]
        ref_loss = ref_loss + query_loss(model, xi, yi, queries=p.queries)
        row += share
    (ref_loss / total).backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    ce, _ = forward_backward(QueryLoss(model, cfg.queries), _Rows(x, y), micro_rows=6, aux_weight=0.0,
                             n_targets=cfg.batch_targets, packed=False)
    assert math.isclose(ce, ref_loss.item() / total, rel_tol=1e-5)
    for (name, p), g in zip(model.named_parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6, msg=name)

    noisy = x.clone()
    pad = y.eq(IGNORE_INDEX) & torch.arange(32).ge(torch.tensor([16] * 3 + [32] * 3)[:, None])
    noisy[pad] = torch.randint(1, 64, (int(pad.sum()),))
    assert pad.any()
    with torch.no_grad():
        torch.testing.assert_close(query_loss(model, noisy, y, queries=cfg.queries),
                                   query_loss(model, x, y, queries=cfg.queries), rtol=1e-5, atol=1e-5)


def test_a_tiny_mixture_run_learns_every_point_and_reports_each(tmp_path, capsys):
    from lintime.cli import main

    mix = ((16, 2, 2048), (32, 4, 2048))
    cfg = TaskTrainConfig(preset="transformer-pp-tiny", n_heads=1, position="none", d_model=64, vocab_size=32,
                          mix=mix, batch_size=64, test_examples=200, epochs=16, lr=3e-3, device="cpu")
    res = train_task(cfg, out=tmp_path, name="mix", echo=None, plot=False)
    assert res.stopped == "early stop", res
    assert set(res.point_accuracy) == {"16/2", "32/4"}
    assert min(res.point_accuracy.values()) > 0.99 and res.accuracy == min(res.point_accuracy.values())
    rows = [json.loads(line) for line in (tmp_path / "mix" / "metrics.jsonl").read_text().splitlines()]
    assert all(set(r["val_points"]) == {"16/2", "32/4"} for r in rows)
    assert rows[-1]["val_accuracy"] == min(rows[-1]["val_points"].values())
    saved = json.loads((tmp_path / "mix" / "config.json").read_text())["train"]
    assert TaskTrainConfig.from_dict(saved) == cfg

    # lintime eval scores the run's points by default, and any points given
    assert main(["eval", str(tmp_path / "mix"), "--task", "mqar", "--examples", "100", "--no-progress",
                 "--json", str(tmp_path / "e.json")]) == 0
    got = json.loads((tmp_path / "e.json").read_text())["results"]
    assert [(r["config"]["seq_len"], r["config"]["kv_pairs"]) for r in got] == [(16, 2), (32, 4)]
    assert all(r["accuracy"] > 0.98 for r in got)
    assert main(["eval", str(tmp_path / "mix"), "--task", "mqar", "--examples", "20", "--no-progress",
                 "--points", "64x8,32x4", "--json", str(tmp_path / "f.json")]) == 0
    got = json.loads((tmp_path / "f.json").read_text())["results"]
    assert [(r["config"]["seq_len"], r["config"]["kv_pairs"]) for r in got] == [(64, 8), (32, 4)]
    capsys.readouterr()
