"""lm-evaluation-harness, offline, on an exported folder with the passkey task lintime writes as a
local .jsonl + YAML (lintime.evaluation.tasks.passkey.write_lm_eval_task): lm-eval's greedy answers
and exact-match score equal lintime's own on the same prompts.  Skipped without lm-eval (the `eval`
extra; CI installs it)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_helpers import require_lm_eval, write_run

from lintime.cli import main as cli_main
from lintime.evaluation.tasks.passkey import greedy_continuations, write_lm_eval_task
from lintime.training.checkpoint import load_model


def test_passkey_task_through_lm_eval(tmp_path):
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    run = write_run(tmp_path / "run", "gla-tiny")
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out), "--no-remote-code"]) == 0
    lt = load_model(run)
    tasks = tmp_path / "tasks"
    yaml = write_lm_eval_task(tasks, lt.tokenizer, context_lens=(160,), depths=(0.0, 1.0), trials=1)
    docs = [json.loads(line) for line in (tasks / "lintime_passkey.jsonl").read_text().splitlines()]
    assert len(docs) == 2 and all(re.fullmatch(r"\d{5}", d["target"]) for d in docs)
    assert all(len(lt.tokenizer.encode(d["prompt"])) == 159 for d in docs)  # + bos = the context length

    res = simple_evaluate(
        model="hf", model_args=f"pretrained={out},add_bos_token=True", device="cpu", batch_size=2,
        tasks=["lintime_passkey"], task_manager=TaskManager(include_path=str(yaml.parent)), log_samples=True,
    )
    samples = sorted(res["samples"]["lintime_passkey"], key=lambda s: s["doc_id"])
    correct = 0
    for s in samples:
        ids = [lt.tokenizer.bos_id] + lt.tokenizer.encode(s["doc"]["prompt"])
        ours = lt.tokenizer.decode(greedy_continuations(lt.model, torch.tensor([ids]), 9)[0])
        assert s["resps"][0][0] == ours.split("\n")[0]  # greedy until the stop string, as lm-eval draws it
        correct += int(ours[:5] == s["doc"]["target"])
    assert res["results"]["lintime_passkey"]["exact_match,key"] == pytest.approx(correct / len(samples))
