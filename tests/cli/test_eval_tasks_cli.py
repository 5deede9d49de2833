"""``lintime eval --task passkey | extrapolation | mqar`` and ``lintime train --task mqar`` end to
end on the CPU: tables, JSON equal to the library's numbers, plots, one-line errors."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lintime.cli import main
from lintime.data import ByteTokenizer
from lintime.evaluation import load_split
from lintime.evaluation.tasks.extrapolation import evaluate_extrapolation
from lintime.evaluation.tasks.mqar import MQARConfig, evaluate_mqar
from lintime.models import CausalLM, get_preset
from lintime.training import load_model
from lintime.training.checkpoint import save_checkpoint, write_run_config

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 3}\n" * (2 + i % 5) for i in range(40)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """An (untrained) gla-tiny run trained "at context 16" on a small corpus."""
    root = tmp_path_factory.mktemp("tasks")
    for i, text in enumerate(TEXTS):
        (root / "corpus").mkdir(exist_ok=True)
        (root / "corpus" / f"m{i:02d}.py").write_text(text, encoding="utf-8")
    tok = ByteTokenizer()
    torch.manual_seed(0)
    model = CausalLM(get_preset("gla-tiny", vocab_size=tok.vocab_size))
    run = root / "runs" / "tiny"
    train = {"corpus": str(root / "corpus"), "cache_dir": str(root / "cache"), "context_len": 16, "text_field": "text"}
    write_run_config(run, model_config=model.config, objective="clm", tokenizer=tok, train=train)
    save_checkpoint(run, 3, model, {"step": 3})
    return run


def test_passkey_table_json_and_plot(run_dir, tmp_path, capsys):
    out = tmp_path / "pk.json"
    assert main(["eval", str(run_dir), "--task", "passkey", "--context-lens", "200,300", "--depths", "0,1",
                 "--trials", "2", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "passkey retrieval: 5-digit keys in stdlib (test split)" in text and "depth 1" in text
    data = json.loads(out.read_text())
    assert data["task"] == "passkey" and data["step"] == 3
    assert [(c["context_len"], c["depth"], c["trials"]) for c in data["cells"]] == [
        (200, 0.0, 2), (200, 1.0, 2), (300, 0.0, 2), (300, 1.0, 2)]
    assert all(len(a) <= 5 for c in data["cells"] for a in c["answers"])
    assert (tmp_path / "pk.png").stat().st_size > 1000


def test_extrapolation_equals_the_library_and_compares_curves(run_dir, tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    args = ["eval", str(run_dir), "--task", "extrapolation", "--factor", "4", "--max-windows", "0", "--no-progress"]
    assert main(args + ["--json", str(first)]) == 0
    text = capsys.readouterr().out
    assert "buckets of 16" in text and "16-31*" in text and "beyond the training context (16)" in text
    data = json.loads(first.read_text())
    loaded = load_model(run_dir)
    ref = evaluate_extrapolation(loaded.model, load_split(loaded.config, loaded.tokenizer, "validation"),
                                 tokenizer=loaded.tokenizer, trained_len=16, factor=4, max_windows=None)
    assert data["n_windows"] == ref.n_windows > 0 and len(data["buckets"]) == 4
    for got, want in zip(data["buckets"], ref.buckets):
        assert got["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-9)
    plot = tmp_path / "both.png"
    assert main(args + ["--json", str(second), "--compare", str(first), "--plot", str(plot)]) == 0
    assert plot.stat().st_size > 1000


def test_mqar_on_a_language_model_uses_its_vocabulary(run_dir, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["eval", str(run_dir), "--task", "mqar", "--context-lens", "32", "--kv-pairs", "2,4", "--examples", "50",
                 "--json", str(out), "--no-progress"]) == 0
    assert "not trained on it" in capsys.readouterr().out
    data = json.loads(out.read_text())
    loaded = load_model(run_dir)
    want = evaluate_mqar(loaded.model, MQARConfig(vocab_size=260, seq_len=32, kv_pairs=4), n_examples=50)
    got = data["results"][1]
    assert got["config"]["kv_pairs"] == 4 and got["accuracy"] == pytest.approx(want.accuracy)


@pytest.mark.parametrize("argv, message", [
    (["--task", "recall"], "--task must be lm, mqar, passkey or extrapolation"),
    (["--task", "passkey", "--depths", "0,x"], "--depths takes numbers"),
    (["--task", "passkey", "--context-lens", "40"], "shorter than the needle"),
    (["--task", "mqar", "--kv-pairs", "40", "--context-lens", "64"], "mqar: 40 pairs"),
])
def test_task_errors_are_one_line(run_dir, capsys, argv, message):
    assert main(["eval", str(run_dir), "--no-progress"] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_train_task_refuses_language_model_flags(tmp_path, capsys):
    assert main(["train", "--task", "mqar", "--corpus", "x", "--out", str(tmp_path)]) == 2
    assert "--task mqar does not use --corpus" in capsys.readouterr().err
    assert main(["train", "--kv-pairs", "8", "--out", str(tmp_path)]) == 2
    assert "--kv-pairs apply to --task mqar only" in capsys.readouterr().err


def test_train_mqar_then_eval_attention_recalls(tmp_path, capsys):
    """The sanity anchor on a CPU: Transformer++ with Zoology's attention block (one head, no MLP;
    RoPE alone) learns an easy MQAR (vocabulary 64, 32 tokens, 8 pairs; chance ~ 1/8) to >= 90 %
    test accuracy through ``lintime train --task mqar`` and ``lintime eval --task mqar``
    (measured: 100 % after 3 epochs of 128 steps, ~10 s on one thread, 2026-11-27)."""
    started = time.perf_counter()
    assert main(["train", "--task", "mqar", "--preset", "transformer-pp-tiny", "--n-heads", "1", "--position", "none",
                 "--task-vocab", "64", "--context-len", "32", "--kv-pairs", "8", "--examples", "4096",
                 "--tokens-per-batch", "1024", "--epochs", "6", "--seed", "1", "--device", "cpu",
                 "--out", str(tmp_path), "--name", "mq", "--no-progress"]) == 0
    run = tmp_path / "mq"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["epoch"] == 1 and rows[-1]["val_accuracy"] >= 0.9
    assert (run / "accuracy_vs_epoch.png").is_file()
    capsys.readouterr()
    out = tmp_path / "mq.json"
    assert main(["eval", str(run), "--task", "mqar", "--kv-pairs", "2,8", "--examples", "500", "--json", str(out),
                 "--no-progress"]) == 0
    assert "MQAR (the run's task), test stream of seed 1" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["config"]["kv_pairs"] for r in data["results"]] == [2, 8]
    assert all(r["config"]["seq_len"] == 32 and r["config"]["vocab_size"] == 64 for r in data["results"])
    assert data["results"][1]["accuracy"] >= 0.9 and data["results"][1]["n_queries"] == 500 * 8
    assert (tmp_path / "mq.png").is_file()
    assert time.perf_counter() - started < 60


@pytest.mark.parametrize("command", ["train", "eval"])
def test_help_renders(command, capsys):
    """argparse formats every help string (a bare '%' in a docstring breaks it)."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and "--task" in capsys.readouterr().out
