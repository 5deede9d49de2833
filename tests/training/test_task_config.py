"""lintime.training.tasks: the task run's config (Zoology's batch rule, the per-epoch cosine, the
model changes) and its refusals."""

from __future__ import annotations

import math

import pytest

from lintime.training.tasks import TaskTrainConfig, cosine_lr, zoology_batch_size


def test_zoology_rules():
    assert [zoology_batch_size(T) for T in (64, 128, 256, 512, 1024)] == [512, 512, 256, 128, 64]
    assert [cosine_lr(1.0, e, 4) for e in range(4)] == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5,
                                                                      (1 + math.cos(3 * math.pi / 4)) / 2])
    cfg = TaskTrainConfig(seq_len=256, kv_pairs=16, train_examples=1000)
    assert cfg.rows == 256 and TaskTrainConfig(train_examples=100).rows == 100


def test_model_changes():
    m = TaskTrainConfig(preset="transformer-pp-tiny", d_model=96, n_heads=1, position="none").model_config()
    assert (m.d_model, m.n_layers, m.vocab_size, m.ffn, m.mixer.n_heads, m.position) == (96, 2, 8192, None, 1, "none")
    kept = TaskTrainConfig(preset="transformer-pp-tiny", mlp=True, n_layers=None).model_config()
    assert kept.ffn is not None and kept.n_layers == 2 and kept.mixer.n_heads == 4
    learned = TaskTrainConfig(preset="transformer-tiny", position="learned", seq_len=128, kv_pairs=8).model_config()
    assert learned.max_positions == 128
    with pytest.raises(ValueError, match="has no heads"):
        TaskTrainConfig(preset="flash-tiny", n_heads=2).model_config()


@pytest.mark.parametrize("bad, message", [
    (dict(task="lm"), "task must be one of"), (dict(kv_pairs=40), "mqar:"), (dict(position="rope"), "position must be"),
    (dict(early_stop=2.0), "early_stop"), (dict(lr=0.0), "lr must be"), (dict(epochs=0), "epochs"),
])
def test_refusals(bad, message):
    with pytest.raises(ValueError, match=message):
        TaskTrainConfig(**bad)
    assert TaskTrainConfig.from_dict(TaskTrainConfig().to_dict()) == TaskTrainConfig()
