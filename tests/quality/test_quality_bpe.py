"""Issue 43's BPE part (benchmarks/quality/run.py kind ``bpe``, report.py's BPE block): the plan, the
per-token perplexity / bits-per-byte scores against a computation written out here (the model run
document by document, the log-probabilities summed by hand, the bytes counted from the text), the
report's table, and one BPE run of the CPU smoke on a small corpus made here."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

import report as rep  # noqa: E402
import run as study  # noqa: E402

pytest.importorskip("tokenizers")

WORDS = ("the", "model", "state", "token", "cache", "query", "value", "kernel", "chunk", "café", "naïve", "→",
         "linear", "attention", "def", "return", "self", "x", "=", "(", ")", ":", "1", "2024", "λ")


def _corpus(root: Path, n_files: int = 320, seed: int = 0) -> Path:
    """Small documents of random words (some not ASCII: bytes differ from characters), one per file."""
    rng = random.Random(seed)
    corpus = root / "corpus"
    for i in range(n_files):
        words = [rng.choice(WORDS) for _ in range(rng.randint(20, 90))]
        lines = [" ".join(words[j:j + 9]) for j in range(0, len(words), 9)]
        (corpus / f"d{i % 7}").mkdir(parents=True, exist_ok=True)
        (corpus / f"d{i % 7}" / f"doc{i:04d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return corpus


def _val_texts(corpus: Path) -> list[str]:
    from lintime.data.corpus import open_corpus

    return [d.text for d in open_corpus(str(corpus)).documents("validation")]


# ------------------------------------------------------------------------------------------- the plan


def test_the_bpe_part_is_in_the_plan_with_the_budget_rule_in_bpe_tokens():
    runs = study.plan(train_tokens=112_034_957)
    bpe = [r for r in runs if r.kind == "bpe"]
    assert [r.id for r in bpe] == [f"bpe-{f}-1024-s0" for f in ("flash", "transformer-pp", "gla", "vq")]
    assert {r.preset for r in bpe} == {"flash-base", "transformer-pp-base", "gla-base", "vq-base"}
    for r in bpe:
        assert (r.context, r.seed, r.tokenizer, r.lr) == (1024, 0, "bpe:32000", None)  # lr: the family's swept one
        # 29,859,740 train tokens: 100M would be 3.3 epochs, so 2 epochs, whole 2^18 blocks below it, 2^16 a step
        assert r.tokens == (2 * 29_859_740 // 2**18) * 2**18 == 59_506_688 and r.steps == 59_506_688 // 2**16 == 908
        assert 1.0 <= r.tokens / study.BPE_TRAIN_TOKENS <= 2.0
        assert r.gpus == 1 and r.est_s <= study.CALL_TRAIN_S and r.retrieval_s == 0.0
        assert r.est_device_s == pytest.approx(r.est_s + study.START_S + study.EVAL_S)
    # byte runs keep their budget; the study runs their retrieval reserve (the sweep runs skip retrieval by the plan)
    byte = [r for r in runs if r.kind != "bpe"]
    assert all(r.tokenizer == "byte" and r.tokens >= 100_000_000 for r in byte)
    assert all(r.retrieval_s == (study.RETRIEVAL_S if r.kind == "study" else 0.0) for r in byte)
    # order: after every seed-0 study run, before the other seeds
    ids = [r.id for r in runs]
    last_seed0 = max(i for i, r in enumerate(runs) if r.kind == "study" and r.seed == 0)
    first_other = min(i for i, r in enumerate(runs) if r.kind == "study" and r.seed > 0)
    assert last_seed0 < ids.index("bpe-flash-1024-s0") and ids.index("bpe-vq-1024-s0") < first_other
    # --only bpe selects exactly them
    assert study.select(runs, "bpe") == bpe
    # the command: lintime's BPE, its own cache
    cmd = study.train_command(bpe[0], 7e-4, data=Path("/d"), work=Path("/w"), device="cuda", time_min=5.0,
                              resume=False, gpus=1)
    assert cmd[cmd.index("--tokenizer") + 1] == "bpe:32000"
    assert cmd[cmd.index("--cache-dir") + 1] == "/d/cache-bpe32000"
    byte_cmd = study.train_command(runs[0], 7e-4, data=Path("/d"), work=Path("/w"), device="cuda", time_min=5.0,
                                   resume=False, gpus=1)
    assert byte_cmd[byte_cmd.index("--cache-dir") + 1] == "/d/cache"


def test_list_shows_the_bpe_runs_with_their_epochs_and_estimates(capsys):
    assert study.main(["--list", "--only", "bpe"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("bpe-")]
    assert len(lines) == 4 and all("bpe:32000" in line and " 59.5M " in line and " 1.99 " in line for line in lines)
    assert "4 runs; estimated device time" in out and "once per call with a bpe run" in out


def test_the_smoke_plan_has_a_tiny_bpe_part():
    bpe = [r for r in study.plan(smoke=True) if r.kind == "bpe"]
    assert {r.preset for r in bpe} == {"flash-tiny", "transformer-pp-tiny"}
    assert all(r.tokenizer.startswith("bpe:") and r.context == study.SMOKE["sweep_context"] for r in bpe)


# ------------------------------------------------------------------------------------------- scores


def test_bpe_scores_match_a_computation_by_hand(tmp_path):
    """final_scores on a BPE cache: the documents the byte runs score, per-token perplexity and bits per byte
    equal to the model run on each document alone with the log-probabilities summed here."""
    import torch

    from lintime.data import prepare
    from lintime.models import CausalLM, get_preset

    corpus = _corpus(tmp_path)
    byte_cache, bpe_cache = tmp_path / "cache", tmp_path / "cache-bpe400"
    prepare(str(corpus), "byte", byte_cache, quiet=True)
    tok = prepare(str(corpus), "bpe:400", bpe_cache, quiet=True)["train"].tokenizer
    torch.manual_seed(0)
    model = CausalLM(get_preset("flash-tiny", vocab_size=tok.vocab_size)).eval()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"train": {"cache_dir": str(bpe_cache)}}))
    run = dataclasses.replace(next(r for r in study.plan(smoke=True) if r.kind == "bpe"), context=1024,
                              final_eval_tokens=1500)
    final = study.final_scores(run_dir, run, "cpu", SimpleNamespace(model=model, tokenizer=tok), byte_cache=byte_cache)

    # the byte runs' documents: the first whole validation documents whose byte targets (bytes + eos) reach 1500
    texts, reach = [], 0
    for text in _val_texts(corpus):
        texts.append(text)
        reach += len(text.encode("utf-8")) + 1
        if reach >= 1500:
            break
    assert 1 < len(texts) < len(_val_texts(corpus))  # a prefix of the split, not all of it
    nll, n = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = [tok.bos_id] + tok.encode(text) + [tok.eos_id]
            assert len(ids) - 1 <= run.context  # one window per document
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).double()[0], dim=-1)
            nll -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
            n += len(ids) - 1
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert n_bytes > sum(len(t) for t in texts)  # not ASCII: bytes, not characters
    assert (final["validation_docs"], final["validation_targets"], final["validation_bytes"]) == (len(texts), n, n_bytes)
    assert final["validation_perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)
    assert final["validation_bpb"] == pytest.approx(nll / math.log(2) / n_bytes, rel=1e-4)
    assert final["validation_bits_per_token"] == pytest.approx(nll / n / math.log(2), rel=1e-4)
    # the three agree with each other: bits per byte = log2(perplexity) x tokens / bytes
    for split in ("validation", "test"):
        assert final[f"{split}_bpb"] == pytest.approx(
            math.log2(final[f"{split}_perplexity"]) * final[f"{split}_targets"] / final[f"{split}_bytes"], rel=1e-9)
    assert final["tokenizer"] == tok.name
    # the BPE budget that selects those documents: their BPE targets, exactly
    from lintime.data import open_prepared

    bpe_ds, byte_ds = open_prepared(bpe_cache, "validation", tok), open_prepared(byte_cache, "validation")
    assert study.same_documents_tokens(bpe_ds, byte_ds, 1500) == n


def test_same_documents_refuses_caches_of_other_documents(tmp_path):
    from lintime.data import open_prepared, prepare

    a, b = _corpus(tmp_path / "a", n_files=320), _corpus(tmp_path / "b", n_files=200)
    prepare(str(a), "byte", tmp_path / "ca", quiet=True)
    prepare(str(b), "byte", tmp_path / "cb", quiet=True)
    with pytest.raises(ValueError, match="different documents"):
        study.same_documents_tokens(open_prepared(tmp_path / "ca", "validation"),
                                    open_prepared(tmp_path / "cb", "validation"), 1500)


# ------------------------------------------------------------------------------------------- the report


def _bpe_record(run, ppl_val, ppl_test, *, targets=1000, n_bytes=3700, commit="abcdef0123"):
    bpt = math.log2(ppl_val)
    return {"id": run.id, "status": "done", "run": dataclasses.asdict(run), "gpus": 1, "commit": commit, "lr": 7e-4,
            "tokens": run.tokens, "val_curve": [], "timing": {"one_off_s": 0.0, "train_s": 100.0},
            "tokenizer": {"name": "bpe-32000-x", "epochs": 1.99},
            "final": {"validation_perplexity": ppl_val, "test_perplexity": ppl_test,
                      "validation_bpb": bpt * targets / n_bytes, "test_bpb": math.log2(ppl_test) * targets / n_bytes,
                      "validation_targets": targets, "validation_bytes": n_bytes, "tokenizer": "bpe-32000-x"}}


def test_the_bpe_table_gap_bytes_per_token_and_not_run_cells(tmp_path):
    runs = study.plan(train_tokens=112_034_957)
    by = {r.id: r for r in runs}
    for rid, v, t in (("bpe-flash-1024-s0", 20.0, 21.0), ("bpe-transformer-pp-1024-s0", 25.0, 26.0)):
        (tmp_path / f"{rid}.json").write_text(json.dumps(_bpe_record(by[rid], v, t)))
    # FLASH's byte-level run at 1024, seed 0, scored on other documents (other bytes): flagged
    byte = {"id": "flash-1024-s0", "status": "done", "run": dataclasses.asdict(by["flash-1024-s0"]), "gpus": 1,
            "commit": "abc", "lr": 7e-4, "tokens": 1, "final": {"validation_bpb": 1.5, "validation_bytes": 9999}}
    (tmp_path / "flash-1024-s0.json").write_text(json.dumps(byte))
    tab = rep.bpe_table(rep.load(tmp_path, runs), runs)
    fl, tpp = tab["families"]["flash"], tab["families"]["transformer-pp"]
    assert fl["gap"] == pytest.approx(20.0 / 25.0 - 1) and tpp["gap"] is None
    assert fl["bytes_per_token"] == [pytest.approx(3.7)]
    assert fl["val"] == [pytest.approx(math.log2(20.0) * 1000 / 3700)]
    assert fl["byte_val"] == [1.5] and fl["same_documents"] is False
    md = rep.bpe_markdown(tab)
    line = next(x for x in md.splitlines() if x.startswith("| FLASH |"))
    assert "20.00 (1 seed)" in line and "21.00 (1 seed)" in line and "-20.00%" in line and "| 3.70 |" in line
    assert "1.5000 (1 seed) (other documents)" in line and "(1.99 epochs)" in line and "bpe-32000-x" in line
    assert "| Transformer++ | 1/1 | 25.00 (1 seed) |" in md and "(reference)" in md
    assert "| GLA | 0/1 | not run | not run | not run |" in md
    assert "59.5M tokens each (1.99 epochs" in md


def test_report_writes_the_bpe_block_with_every_cell_not_run(tmp_path):
    page = tmp_path / "results.md"
    page.write_text("# page\n\n<!-- BEGIN quality-study -->\nold\n<!-- END quality-study -->\n\n"
                    "<!-- BEGIN quality-retrieval -->\nold\n<!-- END quality-retrieval -->\n\n"
                    "<!-- BEGIN quality-bpe -->\nold\n<!-- END quality-bpe -->\n\nafter\n")
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    assert rep.main(["--runs-dir", str(runs_dir), "--page", str(page)]) == 0
    text = page.read_text()
    assert "old" not in text and text.endswith("after\n") and text.count("<!-- BEGIN quality-bpe -->") == 1
    block = text.split("<!-- BEGIN quality-bpe -->")[1].split("<!-- END quality-bpe -->")[0]
    rows = [x for x in block.splitlines() if x.startswith("| ") and not x.startswith("| family")]
    assert len(rows) == 4 and all(r.count("not run") == 6 for r in rows)
    assert "4 BPE runs" in text


# ------------------------------------------------------------------------------------------- the CPU smoke


def test_a_smoke_bpe_run_trains_scores_and_records(tmp_path):
    """One BPE run of the smoke plan, end to end on a CPU: it waits for nothing (its family's sweep records are
    written here), builds the BPE and its cache, trains through ``lintime train --tokenizer``, scores on the
    byte runs' documents and records per-token perplexity and bits per byte."""
    from lintime.data import prepare

    data = tmp_path / "data"
    corpus = _corpus(data)
    prepare(str(corpus), "byte", data / "cache", quiet=True)
    runs_dir = tmp_path / "runs"
    plan = study.plan(smoke=True)
    sweep = [r for r in plan if r.kind == "sweep" and r.family == "flash"]
    sweep.append(dataclasses.replace(sweep[1], id="sweep-flash-128-lrx2", lr=2 * sweep[1].lr, lr_factor=2.0))
    for r, v in zip(sweep, (3.0, 2.5, 2.7)):  # the second rate wins, with a rung either side (the ladder's x2)
        study.write_record(r, runs_dir, {"id": r.id, "status": "done", "final": {"validation_bpb": v}})
    rid = "bpe-flash-128-s0"
    assert study.main(["--smoke", "--only", rid, "--data", str(data), "--runs-dir", str(runs_dir),
                       "--work", str(tmp_path / "work"), "--device", "cpu"]) == 0
    rec = json.loads((runs_dir / f"{rid}.json").read_text())
    assert rec["status"] == "done", rec.get("error")
    assert rec["lr"] == sweep[1].lr and "--tokenizer bpe:512" in rec["command"]
    tok = rec["tokenizer"]
    assert tok["spec"] == "bpe:512" and tok["name"] == rec["final"]["tokenizer"] and tok["name"].startswith("bpe-")
    assert tok["epochs"] == pytest.approx(rec["run"]["tokens"] / tok["splits"]["train"]["tokens"])
    f = rec["final"]
    assert 1.0 < f["validation_perplexity"] < tok_vocab(tok) and f["validation_bpb"] > 0
    assert f["validation_bpb"] == pytest.approx(
        math.log2(f["validation_perplexity"]) * f["validation_targets"] / f["validation_bytes"], rel=1e-9)
    # the byte runs' documents: bytes counted from the text, first documents reaching the smoke's 2048 targets
    n_bytes, reach = 0, 0
    for text in _val_texts(corpus):
        n_bytes += len(text.encode("utf-8"))
        reach += len(text.encode("utf-8")) + 1
        if reach >= rec["run"]["final_eval_tokens"]:
            break
    assert f["validation_bytes"] == n_bytes
    # the validation curve is per token (no bits per byte during training with a BPE)
    assert rec["val_curve"] and all(p["bpb"] is None and p["perplexity"] > 1 for p in rec["val_curve"])
    assert all(c["status"] == "not run" and "BPE" in c["why"] for c in rec["retrieval"]["cells"])
    # the report's smoke table shows it
    md = rep.render_bpe(runs_dir, plan)
    assert f"{f['validation_perplexity']:.2f} (1 seed)" in md and "| Transformer++ | 0/1 | not run |" in md


def tok_vocab(tok: dict) -> int:
    return int(tok["spec"].split(":")[1])
