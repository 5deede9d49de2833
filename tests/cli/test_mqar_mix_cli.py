"""``lintime train --task mqar --mqar-mix``: the flag parses into the run's config (and back from its
config.json), and the flags it replaces or cannot go with are refused in one line.  (A task run is
not resumable, so there is no resume check of the mix to test.)"""

from __future__ import annotations

import json

import pytest

from lintime.cli import main
from lintime.training.tasks import TaskTrainConfig


def _train(out, name, *extra):
    return ["train", "--task", "mqar", "--preset", "transformer-pp-tiny", "--n-heads", "1", "--position", "none",
            "--d-model", "16", "--task-vocab", "32", "--device", "cpu", "--out", str(out), "--name", name,
            "--no-progress", "--steps", "2", *extra]


def test_the_mix_flag_round_trips_into_the_runs_config(tmp_path, capsys):
    assert main(_train(tmp_path, "a", "--mqar-mix", "16x2:256,32x4:128", "--tokens-per-batch", str(6 * 32))) == 0
    out = capsys.readouterr().out
    assert "mqar mix 16x2:256,32x4:128" in out and "batch 6 = 16/2: 4 rows" in out, out
    saved = json.loads((tmp_path / "a" / "config.json").read_text())["train"]
    assert saved["mix"] == [[16, 2, 256], [32, 4, 128]]
    cfg = TaskTrainConfig.from_dict(saved)
    assert cfg.mix == ((16, 2, 256), (32, 4, 128)) and (cfg.seq_len, cfg.kv_pairs, cfg.train_examples, cfg.rows) == (
        32, 4, 384, 6)
    # without counts, --examples is split equally
    assert main(_train(tmp_path, "b", "--mqar-mix", "16x2,32x4", "--examples", "512")) == 0
    capsys.readouterr()
    saved = json.loads((tmp_path / "b" / "config.json").read_text())["train"]
    assert saved["mix"] == [[16, 2, 256], [32, 4, 256]]


@pytest.mark.parametrize("extra, message", [
    (["--mqar-mix", "16x2,32x4", "--context-len", "32"], "drop --context-len"),
    (["--mqar-mix", "16x2:64,32x4:64", "--examples", "100"], "drop --examples"),
    (["--mqar-mix", "16x2:64,32x4"], "--mqar-mix:"),
    (["--mqar-mix", "zoology", "--task-vocab", "256", "--tokens-per-batch", str(256 * 256)], "multiple of 9"),
])
def test_refusals(tmp_path, capsys, extra, message):
    assert main(_train(tmp_path, "r", *extra)) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_language_model_run_refuses_the_mix(tmp_path, capsys):
    assert main(["train", "--mqar-mix", "zoology", "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "--mqar-mix" in err and "apply to --task mqar only" in err, err
