"""lm-evaluation-harness end to end, offline, on an exported folder and the local .jsonl tasks of
tests/hf/assets/lm_eval_tasks (the ones docs/ecosystem.md shows): multiple choice, rolling
log-likelihood, generate-until.  The scores are checked against the same quantities computed
directly with the lintime model."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hf_helpers import require_lm_eval, write_run

from lintime.cli import main as cli_main
from lintime.generation import GenerationConfig, generate
from lintime.training.checkpoint import load_model

TASKS = Path(__file__).parent / "assets" / "lm_eval_tasks"


def _logprob(model, ids: list[int], start: int) -> float:
    """Sum of log p(ids[t] | ids[:t]) for t >= start."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0].double(), -1)
    return sum(logp[t - 1, ids[t]].item() for t in range(start, len(ids)))


def test_lm_eval_local_tasks(tmp_path, monkeypatch):
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    run = write_run(tmp_path / "run", "gla-tiny")
    out = tmp_path / "hf"
    assert cli_main(["export", str(run), str(out), "--no-remote-code"]) == 0
    tasks = tmp_path / "tasks"
    shutil.copytree(TASKS, tasks)
    monkeypatch.chdir(tasks)  # the YAMLs name their .jsonl relative to the working folder
    res = simple_evaluate(
        model="hf", model_args=f"pretrained={out},add_bos_token=False", device="cpu", batch_size=4,
        tasks=["lintime_tiny_choice", "lintime_tiny_rolling", "lintime_tiny_generate"],
        task_manager=TaskManager(include_path=str(tasks)), log_samples=True,
    )
    r = res["results"]
    lt = load_model(run)
    tok, model = lt.tokenizer, lt.model

    # add_bos_token=False: contexts are scored without bos, and a rolling window
    # starts from the bos prefix token -- exactly lintime's bits per byte of a document.
    # multiple choice: accuracy from lintime's own log-likelihoods of " choice" after the question
    docs = [json.loads(line) for line in (tasks / "tiny_choice.jsonl").read_text().splitlines()]
    correct = 0
    for d in docs:
        ctx = tok.encode(d["question"])
        scores = [_logprob(model, ctx + tok.encode(" " + c), len(ctx)) for c in d["choices"]]
        correct += int(max(range(len(scores)), key=scores.__getitem__) == d["answer"])
    assert math.isclose(r["lintime_tiny_choice"]["acc,none"], correct / len(docs))

    # rolling log-likelihood: bits per byte of each whole document after bos
    texts = [json.loads(line)["text"] for line in (tasks / "tiny_text.jsonl").read_text().splitlines()]
    nll = -sum(_logprob(model, [tok.bos_id] + tok.encode(t), 1) for t in texts)
    nbytes = sum(len(t.encode()) for t in texts)
    assert math.isclose(r["lintime_tiny_rolling"]["bits_per_byte,none"], nll / nbytes / math.log(2), rel_tol=1e-5)

    # generate-until: the greedy continuation lintime itself draws, cut at the first stop string
    samples = res["samples"]["lintime_tiny_generate"]
    for s in samples:
        ref = generate(model, tok, s["doc"]["prompt"], GenerationConfig(max_new_tokens=8, temperature=0,
                                                                        stop=("\n", "."), add_bos=False))[0].text
        assert s["resps"][0][0] == ref
