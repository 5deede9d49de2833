"""The quality study's plan and report generator (benchmarks/quality) on synthetic results.

The curves below are typed in (not produced by the code under test); the expected speed-ups are
worked out by hand from them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

import quality_plan as qp  # noqa: E402
import quality_report as qr  # noqa: E402


@pytest.mark.parametrize("mode", ["full", "smoke", "smoke-gpu"])
def test_every_table_compares_equal_tokens_and_context(mode):
    runs = qp.build_plan(mode, tokens=1 << 23)
    assert len({r.id for r in runs}) == len(runs)
    by_table: dict[str, list] = {}
    for r in runs:
        for t in r.tables:
            by_table.setdefault(t, []).append(r)
        assert r.tokens % r.tokens_per_batch == 0 and r.tokens_per_batch % r.context_len == 0
    assert {r.tokens for r in by_table["main"]} == {by_table["main"][0].tokens}
    assert {r.context_len for r in by_table["main"]} == {by_table["main"][0].context_len}
    if mode == "full":
        assert {r.model for r in by_table["main"]} == set(qp.MODELS)
        assert all(r.tokens == 1 << 23 for r in runs)
        for ctx in qp.CONTEXTS:  # every context has its Transformer++ reference
            assert f"{qp.REFERENCE}-{ctx}" in {r.id for r in runs}
        chunk = {r.id: r for r in by_table["chunk"]}
        assert sorted(r.chunk_size for r in chunk.values()) == [64, 128, 256, 512]
        assert {r.context_len for r in chunk.values()} == {qp.CHUNK_CONTEXT}
        from lintime.models import get_preset

        for r in chunk.values():
            assert get_preset(r.preset).mixer.chunk_size == r.chunk_size
    # the queue starts the main table first
    tiers = [r.tier for r in runs]
    assert tiers == sorted(tiers)


def test_full_plan_fits_four_gpus_at_the_guessed_speed():
    queues = qp.schedule(qp.build_plan("full"), 4)
    assert max(sum(r.estimate_s() for r in q) for q in queues) < 480


def test_first_reach_interpolates_between_evaluations():
    curve = [{"step": 10, "time_s": 10.0, "bpb": 3.0}, {"step": 20, "time_s": 20.0, "bpb": 2.0},
             {"step": 30, "time_s": 30.0, "bpb": 1.5}]
    assert qr.first_reach(curve, 2.5, "time_s") == pytest.approx(15.0)
    assert qr.first_reach(curve, 1.75, "step") == pytest.approx(25.0)
    assert qr.first_reach(curve, 3.5, "time_s") == 10.0  # already there at the first point
    assert qr.first_reach(curve, 1.4, "time_s") is None


def test_speedup_is_reference_time_over_time_to_reach_its_final_score():
    ref = [{"step": 100, "time_s": 50.0, "bpb": 2.0}, {"step": 200, "time_s": 100.0, "bpb": 1.6}]
    fast = [{"step": 100, "time_s": 20.0, "bpb": 1.8}, {"step": 200, "time_s": 40.0, "bpb": 1.4}]
    sp = qr.speedup(fast, ref)
    # 1.6 is reached halfway between (20 s, 1.8) and (40 s, 1.4): 30 s, step 150
    assert sp["time"] == pytest.approx(100 / 30) and sp["steps"] == pytest.approx(200 / 150)
    assert qr.speedup(ref, ref)["time"] == pytest.approx(1.0)
    slow = [{"step": 200, "time_s": 100.0, "bpb": 1.7}]
    assert qr.speedup(slow, ref)["time"] is None


def test_startup_offset_counts_step_one_at_the_median_step():
    rows = [{"step": 1, "time_s": 12.0, "loss": 5.0}] + [{"step": s, "time_s": 12.0 + (s - 1) * 0.5, "loss": 4.0}
                                                         for s in range(2, 10)]
    assert qr.startup_offset(rows) == pytest.approx(11.5)
    rows.append({"step": 9, "tokens": 9, "time_s": 16.0, "val_bpb": 2.0})
    assert qr.val_curve(rows)[0]["time_s"] == pytest.approx(4.5)


def _write_run(out: Path, run, status: str, bpb_end: float, seconds: float, eval_bpb: float | None = None):
    d = out / "runs" / run.id
    d.mkdir(parents=True)
    n = run.steps
    rows = []
    for s in range(1, n + 1):
        row = {"step": s, "tokens": s * run.tokens_per_batch, "time_s": seconds * s / n, "loss": 3.0}
        if s % max(1, n // 4) == 0 or s == n:
            row["val_bpb"] = bpb_end + (n - s) / n  # falls linearly to bpb_end
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    L = run.context_len
    rec = {"status": status, "n_params": 25_000_000,
           "train": {"steps": n, "tokens": run.tokens, "elapsed_s": seconds, "val": {"val_bpb": bpb_end}},
           "eval": {"results": [{"context_len": L, "bits_per_byte": eval_bpb or bpb_end},
                                {"context_len": 2 * L, "bits_per_byte": (eval_bpb or bpb_end) + 0.1},
                                {"context_len": 4 * L, "bits_per_byte": None, "skipped": "longer than the table"}]}}
    (d / "result.json").write_text(json.dumps(rec))


def test_report_from_partial_results(tmp_path):
    """Missing, failed and killed runs are marked; the tables are computed from the rest."""
    plan = qp.build_plan("full", tokens=1 << 20)
    by_id = {r.id: r for r in plan}
    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    env = {"date_utc": "2026-11-22 00:00:00", "devices": ["NVIDIA H200"], "slots": ["0", "1"], "torch": "2.11",
           "cuda": "13.0", "triton": "3.6", "python": "3.12", "git_commit": "abc", "mode": "full", "tokens_per_run": 1 << 20}
    (out / "study.json").write_text(json.dumps({"environment": env, "plan": [dict(r.__dict__, steps=r.steps) for r in plan]}))
    _write_run(out, by_id["transformer-pp-1024"], "ok", 1.60, 100.0)
    _write_run(out, by_id["flash-1024"], "ok", 1.55, 50.0)
    _write_run(out, by_id["flash-quad-1024"], "ok", 1.50, 80.0)
    _write_run(out, by_id["gla-1024"], "failed", 2.5, 10.0)
    _write_run(out, by_id["flash-2048"], "ok", 1.50, 60.0)  # no Transformer++ at 2048
    doc = tmp_path / "results.md"
    assert qr.main(["--results", str(out), "--doc", str(doc)]) == 0
    data = json.loads((tmp_path / "results" / "quality.json").read_text())
    main = data["tables"]["main"]
    # 2^20 tokens = 32 steps; flash's curve: bpb = 1.55 + (32 - s)/32 at s = 8, 16, 24, 32; 1.60 falls
    # between s=24 (1.80) and s=32 (1.55): s = 24 + 8 * 0.2 / 0.25 = 30.4, at 50 * 30.4 / 32 s
    assert main["flash"]["speedup_steps"] == pytest.approx(32 / 30.4)
    assert main["flash"]["speedup_time"] == pytest.approx(100 / (50 * 30.4 / 32))
    assert main["transformer-pp"]["speedup_time"] == pytest.approx(1.0)
    assert main["vq"]["status"] == "missing"
    assert data["tables"]["context"]["flash"][str(2048)]["ref_available"] is False
    gap = data["tables"]["gap"][str(1024)]
    assert gap["gap_bpb"] == pytest.approx(0.05) and gap["ppl_increase_pct"] == pytest.approx((2**0.05 - 1) * 100)
    assert data["tables"]["gap"][str(512)]["gap_bpb"] is None
    text = doc.read_text()
    assert "**[failed]**" in text and "**[missing]**" in text and "no reference" in text
    assert "n/a" in text  # the skipped 4x evaluation
    verdict = {v["claim"]: v["verdict"] for v in data["verdicts"]}
    assert verdict["FLASH matches Transformer++'s quality (context 1024)"] == "beats"  # 1.55 vs 1.60: > 1 %
    assert verdict["FLASH matches Transformer++'s quality (context 512)"] == "not measured"
    assert sorted(data["plots"]) == sorted(["bpb_vs_steps_1024.png", "bpb_vs_time_1024.png", "context_bpb_vs_steps.png",
                                            "context_bpb_vs_time.png", "chunk_size.png", "extrapolation.png"])


def test_pending_page_lists_the_plan_and_says_nothing_was_measured(tmp_path):
    doc = tmp_path / "results.md"
    assert qr.main(["--pending", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "not yet run on a GPU" in text
    for r in qp.build_plan("full"):
        assert f"`{r.id}`" in text
