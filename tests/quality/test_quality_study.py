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


def _study(out: Path, plan, date: str, devices: list[str], sha: str = "abc", tokens: int = 1 << 20):
    env = {"date_utc": date, "devices": devices, "slots": [str(i) for i in range(len(devices))], "torch": "2.11",
           "cuda": "13.0", "triton": "3.6", "python": "3.12", "git_commit": "abc", "mode": "full",
           "tokens_per_run": tokens, "corpus": {"content_sha256": sha}, "host_cpus": 16}
    (out / "runs").mkdir(parents=True)
    (out / "study.json").write_text(json.dumps({"environment": env, "plan": [dict(r.__dict__, steps=r.steps) for r in plan]}))


def test_merge_adds_a_second_session_and_the_report_labels_every_run(tmp_path):
    """A later call's runs are merged into the first folder: the failed record is replaced, the
    header lists both sessions, each run carries its session, and only cells that compare runs of
    different sessions are marked."""
    import quality_merge as qm

    plan = qp.build_plan("full", tokens=1 << 20)
    by_id = {r.id: r for r in plan}
    a, b = tmp_path / "a", tmp_path / "b"
    _study(a, [by_id[i] for i in ("transformer-pp-1024", "flash-1024", "performer-1024", "transformer-pp-2048")],
           "2026-11-22 03:20:40", ["NVIDIA H200", "NVIDIA H200"])
    _write_run(a, by_id["transformer-pp-1024"], "ok", 1.60, 100.0)
    _write_run(a, by_id["flash-1024"], "ok", 1.55, 50.0)
    _write_run(a, by_id["performer-1024"], "failed", 9.0, 1.0)
    _write_run(a, by_id["transformer-pp-2048"], "ok", 1.70, 100.0)
    _study(b, [by_id[i] for i in ("performer-1024", "gla-2048")], "2026-11-22 04:51:56", ["NVIDIA H200"])
    _write_run(b, by_id["performer-1024"], "ok", 1.90, 200.0)
    _write_run(b, by_id["gla-2048"], "ok", 1.65, 40.0)
    (b / "logs").mkdir()
    (b / "logs" / "gla-2048.log").write_text("log\n")
    (b / "gpu.txt").write_text("index, name, driver_version, memory.total [MiB]\n0, NVIDIA H200, 580.159.04, 143771 MiB\n")
    # a third folder with another corpus is refused, and nothing is written
    c = tmp_path / "c"
    _study(c, [by_id["gla-512"]], "2026-11-23 00:00:00", ["NVIDIA H200"], sha="other")
    _write_run(c, by_id["gla-512"], "ok", 1.6, 10.0)
    before = (a / "study.json").read_text()
    assert qm.main(["--into", str(a), "--add", str(c)]) == 2
    assert (a / "study.json").read_text() == before and not (a / "runs" / "gla-512").exists()

    assert qm.main(["--into", str(a), "--add", str(b), "--note", "the rest"]) == 0
    assert json.loads((a / "runs" / "performer-1024" / "result.json").read_text())["status"] == "ok"
    assert (a / "sessions" / "2026-11-22_045156" / "logs" / "gla-2048.log").exists()
    # taking an ok run again needs --replace
    assert qm.main(["--into", str(a), "--add", str(b), "--runs", "gla-2048"]) == 2
    study = json.loads((a / "study.json").read_text())
    assert [p["id"] for p in study["plan"]] == [r.id for r in plan if r.id in
                                                {"transformer-pp-1024", "flash-1024", "performer-1024",
                                                 "transformer-pp-2048", "gla-2048"}]  # the full plan's order
    sess = qr.sessions(study)
    assert [s["label"] for s in sess] == ["A", "B"]
    assert sess[0]["runs"] == [r.id for r in plan if r.id in {"flash-1024", "transformer-pp-1024", "transformer-pp-2048"}]
    assert sess[0]["superseded"] == [{"run": "performer-1024", "status": "failed", "by": "B"}]
    assert sorted(sess[1]["runs"]) == ["gla-2048", "performer-1024"]
    assert sess[1]["environment"]["driver"] == "580.159.04"

    doc = tmp_path / "results.md"
    assert qr.main(["--results", str(a), "--doc", str(doc)]) == 0
    data = json.loads((tmp_path / "results" / "quality.json").read_text())
    assert data["runs"]["performer-1024"]["session"] == "B" and data["runs"]["flash-1024"]["session"] == "A"
    assert [s["label"] for s in data["sessions"]] == ["A", "B"]
    text = doc.read_text()
    assert "**Session A** (3 runs on this page; `performer-1024` (failed here) ran again in session B)" in text
    assert "**Session B** (2 runs on this page)" in text and "2x NVIDIA H200" in text and "1x NVIDIA H200" in text
    assert "driver 580.159.04" in text and "the rest" in text
    row = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "†" in row["Performer"] and "†" not in row["FLASH"]  # B against A's Transformer++ / A against A
    assert "| `performer-1024` | `performer-medium` | B | ok |" in text
    # GLA at 2048 (B) is marked in the context tables, FLASH at 1024 (A) is not
    lines = text.splitlines()
    head = lines.index("| model | 512: time (s) | 1024: time (s) | 2048: time (s) | 8192: time (s) |")
    gla = next(line for line in lines[head:] if line.startswith("| GLA |")).split("|")
    assert gla[4].strip() == "40.0 †"  # 2048: 40 s, evenly spaced steps (no start-up), session B vs A
    flash = next(line for line in lines[head:] if line.startswith("| FLASH |")).split("|")
    assert flash[3].strip() == "50.0"  # 1024, session A like its reference
    assert text.count("† run in session B (1x NVIDIA H200, 2026-11-22 04:51 UTC), its Transformer++ reference "
                      "in session A (2x NVIDIA H200, 2026-11-22 03:20 UTC)") == 2  # main and context tables


def test_one_session_folder_reads_as_before(tmp_path):
    """A folder without extra_sessions: one session, no session column, no marks."""
    plan = qp.build_plan("full", tokens=1 << 20)
    by_id = {r.id: r for r in plan}
    out = tmp_path / "out"
    _study(out, [by_id["transformer-pp-1024"], by_id["flash-1024"]], "2026-11-22 03:20:40", ["NVIDIA H200"] * 2)
    _write_run(out, by_id["transformer-pp-1024"], "ok", 1.60, 100.0)
    _write_run(out, by_id["flash-1024"], "ok", 1.55, 50.0)
    study = json.loads((out / "study.json").read_text())
    assert [(s["label"], sorted(s["runs"])) for s in qr.sessions(study)] == [("A", ["flash-1024", "transformer-pp-1024"])]
    doc = tmp_path / "results.md"
    doc.write_text("# old page\n\n| stale table |\n\n## Notes on the run (by hand)\n\n* kept note\n")
    assert qr.main(["--results", str(out), "--doc", str(doc)]) == 0
    assert qr.main(["--results", str(out), "--doc", str(doc)]) == 0  # twice: the notes once, at the end
    text = doc.read_text()
    assert text.endswith("## Notes on the run (by hand)\n\n* kept note\n") and text.count("kept note") == 1
    assert "stale table" not in text
    assert text.splitlines()[2].startswith("Measured 2026-11-22 03:20:40 UTC on NVIDIA H200 (2 used")
    assert "†" not in text and "| session |" not in text and "Session A" not in text
