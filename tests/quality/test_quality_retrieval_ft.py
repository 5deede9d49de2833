"""Issue 43 item 3: run.py's retrieval fine-tune stage (its documents in retrieval.py, its time guard, its record)
and one smoke run end to end on a CPU.

The corpus is made here: every test-split document holds a marker word no train document has, so any test-split text
in the fine-tune's documents would show."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

torch = pytest.importorskip("torch")

import retrieval as rt  # noqa: E402
import run as study  # noqa: E402
from lintime.data.corpus import open_corpus  # noqa: E402
from lintime.evaluation.tasks.passkey import trial_key  # noqa: E402

WORDS = "alpha beta gamma delta kernel schema façade naïve über token stream buffer".split()


def _corpus(root: Path, n_files: int = 200) -> Path:
    """Files of words; each file's text names its own split (``TESTSPLIT<i>`` only in test documents)."""
    import random

    from lintime.data.corpus import split_of

    rng = random.Random(0)
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for i in range(n_files):
        key = f"doc{i:04d}.txt"
        tag = {"test": "TESTSPLIT", "validation": "VALSPLIT", "train": "trainsplit"}[split_of(key)]
        words = [rng.choice(WORDS) for _ in range(rng.randint(40, 160))]
        lines = [f"{tag}{i} " + " ".join(words[j:j + 8]) for j in range(0, len(words), 8)]
        (corpus / key).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return corpus


def _pairs(text: str) -> list[tuple[str, str]]:
    return re.findall(r"# The value of key ([a-z]{6}) is (\d{5})\.", text)


def _pass_keys(text: str) -> list[str]:
    return re.findall(r"# The pass key is (\d{5})\. Remember it\.", text)


def test_the_documents_are_train_split_text_one_row_each_and_mixed(tmp_path):
    corpus = _corpus(tmp_path)
    test_docs = [d.text for d in open_corpus(str(corpus)).documents("test")]
    assert test_docs  # the corpus has a test split to stay away from
    docs, summary = rt.fine_tune_documents(str(corpus), 1024, 200, mix=0.5, seed=3)
    assert len(docs) == 200 and summary["passkey"] + summary["needle"] == 100 and summary["text"] == 100
    assert summary["needle"] == 50 and summary["needle_fits"] and summary["mix"] == 0.5
    for d in docs:
        # exactly context - 2 bytes: with lintime's bos / eos one training row, never cut by a row boundary
        assert len(d["text"].encode("utf-8")) == 1022
        assert "TESTSPLIT" not in d["text"] and "VALSPLIT" not in d["text"]
        if d["kind"] == "passkey":
            keys = _pass_keys(d["text"])
            assert len(keys) == 1 and d["text"].endswith(f"The pass key is {keys[0]}.\n")
        elif d["kind"] == "needle":
            pairs = dict(_pairs(d["text"]))
            asked = re.search(r"What is the value of key ([a-z]{6})\? The value of key \1 is (\d{5})\.\n$", d["text"])
            assert len(pairs) == rt.N_KEYS and pairs[asked.group(1)] == asked.group(2)
        else:
            assert not _pass_keys(d["text"]) and not _pairs(d["text"])
    # every line that starts with its tag is the start of a train document's line (an inserted key may cut its end)
    train_lines = [ln for d in open_corpus(str(corpus)).documents("train") for ln in d.text.splitlines()]
    seen = 0
    for d in docs:
        tags = re.findall(r"(TESTSPLIT|VALSPLIT|trainsplit)(\d+)", d["text"])
        assert all(t == "trainsplit" for t, _ in tags)
        for ln in d["text"].splitlines():
            if ln.startswith("trainsplit") and ln.count(" ") >= 3:
                assert any(tl.startswith(ln) for tl in train_lines), ln
                seen += 1
    assert seen > 100
    # deterministic for a seed, another draw for another seed
    assert rt.fine_tune_documents(str(corpus), 1024, 200, mix=0.5, seed=3)[0] == docs
    assert rt.fine_tune_documents(str(corpus), 1024, 200, mix=0.5, seed=4)[0] != docs


def test_the_synthetic_keys_are_never_the_evaluations(tmp_path):
    corpus = _corpus(tmp_path)
    seed, ctx = 0, 512
    # what the evaluation of a run with this seed draws, worked out from its trials here
    eval_values, eval_names = set(), set()
    for m in rt.MULTIPLES:
        for depth in rt.DEPTHS:
            for t in range(10):
                eval_values.add(trial_key(seed, ctx * m, depth, t, rt.DIGITS)[0])
                pairs, _, _ = rt.needle_trial(seed, ctx * m, depth, t)
                eval_values.update(v for _, v in pairs)
                eval_names.update(n for n, _ in pairs)
    assert (eval_values, eval_names) == rt.evaluation_secrets(seed, ctx)
    docs, _ = rt.fine_tune_documents(str(corpus), ctx, 600, mix=1.0, seed=seed)
    keys = [k for d in docs for k in _pass_keys(d["text"])]
    pairs = [p for d in docs for p in _pairs(d["text"])]
    assert len(keys) == 300 and len(pairs) == 300 * rt.N_KEYS
    assert not set(keys) & eval_values
    assert not {v for _, v in pairs} & eval_values and not {n for n, _ in pairs} & eval_names
    # without the exclusion, 1,500 draws from 90,000 five-digit keys would meet the evaluation's ~500 values
    # (expected ~8 collisions): the exclusion, not luck, keeps them apart
    import numpy as np

    rng = np.random.default_rng([rt.FT_SEED_TAG, seed])
    free = {str(int(v)) for v in rng.integers(10_000, 100_000, 1500)}
    assert free & eval_values


def _done_rec(run, tokens_per_s=1e6):
    return {"timing": {"tokens_per_s": tokens_per_s},
            "retrieval": {"cells": [{"task": "passkey", "multiple": 1, "status": "done", "seconds": 10.0},
                                    {"task": "needle", "multiple": 1, "status": "done", "seconds": 12.0}]}}


def test_the_time_guard_skips_the_fine_tune_with_its_reason(tmp_path, monkeypatch):
    run = next(r for r in study.plan() if r.id == "transformer-pp-8192-s0")
    rec = _done_rec(run, tokens_per_s=310e3)
    need, parts = study.ft_need_s(run, rec, "cuda", after_1x_s=22.0 * 1.3)
    # by hand: 15 s documents + 45 s start + 32 x 2^18 / 310k tokens/s + (10 + 12) x 1.3
    assert need == pytest.approx(15 + 45 + 32 * 2**18 / 310e3 + 28.6)
    assert parts["train_s"] == pytest.approx(27.06, abs=0.05)

    def no_training(*a, **k):  # the guard must decide before anything is written or trained
        raise AssertionError("the fine-tune started")

    monkeypatch.setattr(study, "invoke", no_training)
    monkeypatch.setattr(study, "ft_documents_file", no_training)
    clock = [1000.0]
    monkeypatch.setattr(study.time, "monotonic", lambda: clock[0])
    out = study.retrieval_fine_tune(run, 7e-4, rec, data=tmp_path, work=tmp_path, device="cuda", gpus=1,
                                    deadline=1000.0 + 100.0, log=tmp_path / "log")
    assert out["status"] == "not run" and out["why"].startswith(f"needs ~{need:.0f} s") and "100 s left" in out["why"]
    assert out["settings"]["steps"] == study.RETRIEVAL_FT_STEPS and out["settings"]["lr"] == pytest.approx(7e-5)
    assert all(c["status"] == "not run" and "fine-tune not run: needs" in c["why"] for c in out["retrieval"]["cells"])
    assert {(c["task"], c["multiple"]) for c in out["retrieval"]["cells"]} == {
        (t, m) for t in rt.TASKS for m in rt.MULTIPLES}


def test_the_plan_lists_the_fine_tune_and_whether_it_fits(tmp_path, capsys):
    runs = {r.id: r for r in study.plan()}
    r = runs["flash-1024-s0"]
    assert r.ft_tokens == study.RETRIEVAL_FT_STEPS * study.TOKENS_PER_BATCH
    assert r.retrieval_ft_s == pytest.approx(study.RETRIEVAL_FT_PREP_S + study.START_S + r.est_s * r.ft_tokens / r.tokens
                                             + study.RETRIEVAL_S)
    assert runs["bpe-flash-1024-s0"].retrieval_ft_s == 0.0
    assert study.main(["--list", "--runs-dir", str(tmp_path), "--budget-s", "540"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("flash-1024-s0 "))
    assert f" {r.est_ft_device_s:7.0f} " in line and " yes " in line
    tpp8k = next(ln for ln in out.splitlines() if ln.startswith("transformer-pp-8192-s0 "))
    assert " no " in tpp8k  # ~490 s + ~150 s: not in one 540-s call
    assert "with the retrieval fine-tunes" in out and "retrieval fine-tune ('+ rft s')" in out


def test_a_smoke_run_records_both_retrieval_blocks(tmp_path):
    """One smoke study run end to end on a CPU: training, scoring, retrieval as trained, the fine-tune through
    ``lintime train --init-from`` on the mixed documents, retrieval again; then --no-retrieval-ft and --no-retrieval.
    (Sweep runs skip retrieval by the plan: test_quality_sweep.py.)"""
    from lintime.data import prepare

    data = tmp_path / "data"
    _corpus(data)
    prepare(str(data / "corpus"), "byte", data / "cache", quiet=True)
    runs_dir, work = tmp_path / "runs", tmp_path / "work"
    # the family's sweep, typed in: x1 best between x0.5 and the ladder's x2, so the study run starts at x1's rate
    first = [r for r in study.plan(smoke=True) if r.kind == "sweep" and r.family == "transformer-pp"]
    x1 = next(r for r in first if r.lr_factor == 1.0)
    for f, v in ((0.5, 6.0), (1.0, 5.0), (2.0, 5.5)):
        (runs_dir / f"sweep-transformer-pp-128-lrx{f:g}.json").parent.mkdir(parents=True, exist_ok=True)
        (runs_dir / f"sweep-transformer-pp-128-lrx{f:g}.json").write_text(json.dumps(
            {"id": f"sweep-transformer-pp-128-lrx{f:g}", "status": "done", "lr": x1.lr * f,
             "final": {"validation_bpb": v, "test_bpb": v}}))
    rid = "transformer-pp-128-s0"
    args = ["--smoke", "--only", rid, "--data", str(data), "--runs-dir", str(runs_dir), "--work", str(work),
            "--device", "cpu"]
    assert study.main(args) == 0
    rec = json.loads((runs_dir / f"{rid}.json").read_text())
    assert rec["status"] == "done", rec.get("error")
    assert rec["lr"] == x1.lr and "x1, interior" in rec["lr_source"]
    assert rec["retrieval"]["cells"] and rt.accuracy(rec["retrieval"], "passkey", 1) is not None
    ft = rec["retrieval_ft"]
    assert ft["status"] == "done", ft.get("why")
    st = ft["settings"]
    assert (st["steps"], st["context"], st["mix"]) == (2, 128, study.RETRIEVAL_FT_MIX)
    assert st["tokens"] == 2 * 1024 and st["lr"] == pytest.approx(rec["lr"] * study.RETRIEVAL_FT_LR_FACTOR)
    assert ft["train"]["steps_done"] == 2 and ft["train"]["tokens"] == 2048 and ft["train"]["rc"] == 0
    assert "--init-from" in ft["command"] and "retrieval_ft.jsonl" in ft["command"] and "--steps 2" in ft["command"]
    docs = ft["documents"]
    assert docs["passkey"] > 0 and docs["needle"] == 0 and not docs["needle_fits"]  # 128 bytes hold no 4 pairs
    assert "train split" in docs["filler"]
    assert {(c["task"], c["multiple"]) for c in ft["retrieval"]["cells"]} == {
        (t, m) for t in rt.TASKS for m in rt.MULTIPLES}
    assert rt.accuracy(ft["retrieval"], "passkey", 1) is not None
    # nothing of the fine-tune is left behind (its checkpoint cannot leave a GPU machine either)
    assert not (work / f"{rid}-rft").exists() and not (work / f"{rid}-rft-data").exists()
    # --no-retrieval-ft: as trained only; --no-retrieval: neither
    for flag, why in (("--no-retrieval-ft", "--no-retrieval-ft"), ("--no-retrieval", "--no-retrieval")):
        (runs_dir / f"{rid}.json").unlink()
        assert study.main(args + [flag]) == 0
        rec = json.loads((runs_dir / f"{rid}.json").read_text())
        assert rec["status"] == "done" and rec["retrieval_ft"]["status"] == "not run"
        assert rec["retrieval_ft"]["why"] == why
        measured = rt.accuracy(rec["retrieval"], "passkey", 1) is not None
        assert measured == (flag == "--no-retrieval-ft")
