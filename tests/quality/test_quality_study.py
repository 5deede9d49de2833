"""The quality study's plan, seed aggregation, verdict rules and report (benchmarks/quality) on
synthetic results.

The curves below are typed in (not produced by the code under test); the expected means, spreads,
speed-ups and equal-time values are worked out by hand from them."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

QUALITY = Path(__file__).resolve().parents[2] / "benchmarks" / "quality"
sys.path.insert(0, str(QUALITY))

import quality_plan as qp  # noqa: E402
import quality_report as qr  # noqa: E402
import quality_stats as qs  # noqa: E402


@pytest.mark.parametrize("mode", ["full", "smoke", "smoke-gpu"])
def test_every_table_compares_equal_tokens_and_context(mode):
    runs = qp.build_plan(mode, tokens=1 << 22, tables=qp.TABLES)
    assert len({r.id for r in runs}) == len(runs)
    by_table: dict[str, list] = {}
    for r in runs:
        for t in r.tables:
            by_table.setdefault(t, []).append(r)
        assert r.tokens % r.tokens_per_batch == 0 and r.tokens_per_batch % r.context_len == 0
        assert r.id == f"{r.group}-s{r.seed}"
    assert {r.tokens for r in by_table["main"]} == {by_table["main"][0].tokens}
    assert {r.context_len for r in by_table["main"]} == {by_table["main"][0].context_len}
    if mode == "full":
        assert {r.model for r in by_table["main"]} == set(qp.MODELS)
        assert all(r.tokens == 1 << 22 for r in runs)
        for ctx in qp.CONTEXTS:  # every context has its Transformer++ reference
            assert f"{qp.REFERENCE}-{ctx}" in {r.group for r in runs}
        chunk = {r.id: r for r in by_table["chunk"] if r.model == "flash"}
        assert sorted({r.chunk_size for r in chunk.values()}) == [64, 128, 256, 512]
        assert {r.context_len for r in chunk.values()} == {qp.CHUNK_CONTEXT}
        from lintime.models import get_preset

        for r in chunk.values():
            assert get_preset(r.preset).mixer.chunk_size == r.chunk_size
    # the queue starts the main table first, and every configuration's seed 0 before any seed 1
    keys = [(r.tier, r.seed) for r in runs]
    assert keys == sorted(keys)


def test_every_configuration_runs_every_seed_from_its_own_initial_draw():
    runs = qp.build_plan("full", tables=qp.TABLES, seeds=(0, 1, 2))
    seeds: dict[str, set] = {}
    for r in runs:
        seeds.setdefault(r.group, set()).add(r.seed)
    assert all(v == {0, 1, 2} for v in seeds.values())
    # issue 31: flash-512 / -1024 / -2048 of one seed must not start from the same weights
    inits = [r.init_seed for r in runs]
    assert len(set(inits)) == len(inits)
    by_id = {r.id: r for r in runs}
    assert len({by_id[f"flash-{c}-s0"].init_seed for c in qp.CONTEXTS}) == len(qp.CONTEXTS)
    # the draw belongs to the run id: the same on another budget, another seed list, another call
    other = {r.id: r.init_seed for r in qp.build_plan("full", tokens=1 << 20, seeds=(2,))}
    assert other["flash-1024-s2"] == by_id["flash-1024-s2"].init_seed
    # the smoke runs several seeds of a few configurations (so aggregation runs on a CPU), one of the rest
    smoke = qp.build_plan("smoke")
    counts = {g: sum(r.group == g for r in smoke) for g in {r.group for r in smoke}}
    assert counts[f"flash-{qp.MAIN_CONTEXT}"] == 2 and counts[f"vq-{qp.MAIN_CONTEXT}"] == 1
    with pytest.raises(ValueError, match="seeds"):
        qp.build_plan("full", seeds=(0, 0))


def test_the_default_plan_fits_three_gpus_and_its_cost_is_printed():
    plan = qp.build_plan("full")
    f3 = qp.fits(plan, 3, 540)
    assert f3["fits"] and f3["gpu_s"] == pytest.approx(sum(r.estimate_s() for r in plan))
    # a GPU more or less moves the makespan the right way; the whole plan on one GPU does not fit
    assert qp.fits(plan, 4, 540)["makespan_s"] < f3["makespan_s"] < qp.fits(plan, 2, 540)["makespan_s"]
    assert not qp.fits(plan, 1, 540)["fits"]
    assert f3["makespan_s"] >= qp.STUDY_FIXED_S + max(r.estimate_s() for r in plan)
    text = qp.describe(plan, 3, 540)
    assert "GPU-s" in text and "fits" in text


def test_first_reach_interpolates_between_evaluations():
    curve = [{"step": 10, "time_s": 10.0, "bpb": 3.0}, {"step": 20, "time_s": 20.0, "bpb": 2.0},
             {"step": 30, "time_s": 30.0, "bpb": 1.5}]
    assert qs.first_reach(curve, 2.5, "time_s") == pytest.approx(15.0)
    assert qs.first_reach(curve, 1.75, "step") == pytest.approx(25.0)
    assert qs.first_reach(curve, 3.5, "time_s") == 10.0  # already there at the first point
    assert qs.first_reach(curve, 1.4, "time_s") is None
    # the value at a time: interpolated, "ended" after the last point, None before the first
    assert qs.bpb_at(curve, 25.0) == (pytest.approx(1.75), "")
    assert qs.bpb_at(curve, 40.0) == (1.5, "ended")
    assert qs.bpb_at(curve, 5.0) == (None, "before")


def test_one_off_time_is_step_one_and_every_compile_step_beyond_the_median():
    # step 1 took 12 s, step 5 took 4 s (a compile), the others 0.5 s
    t, rows = 12.0, [{"step": 1, "time_s": 12.0, "loss": 5.0}]
    for s in range(2, 10):
        t += 4.0 if s == 5 else 0.5
        rows.append({"step": s, "time_s": t, "loss": 4.0})
    assert qs.startup_offset(rows) == pytest.approx(11.5 + 3.5)
    rows.append({"step": 3, "tokens": 3, "time_s": 13.0, "val_bpb": 2.0})  # before the compile step
    rows.append({"step": 9, "tokens": 9, "time_s": t, "val_bpb": 1.9})
    curve = qs.val_curve(rows)
    assert curve[0]["time_s"] == pytest.approx(3 * 0.5)  # steps 1-3 at the median
    assert curve[1]["time_s"] == pytest.approx(9 * 0.5)  # every step at the median


def test_mean_spread_diff_and_the_verdict_rules():
    a, b = qs.stat([1.0, 2.0, 3.0]), qs.stat([2.0, 2.0])
    assert (a["mean"], a["spread"], a["n"]) == (2.0, 1.0, 3)  # sample std (n - 1)
    one = qs.stat([5.0, None, math.nan])
    assert (one["mean"], one["spread"], one["n"]) == (5.0, 0.0, 1)
    d = qs.diff(a, b)
    assert (d["mean"], d["spread"], d["beyond"]) == (0.0, 1.0, False)
    assert qs.diff(a, one)["beyond"] is None  # one seed: no verdict either way
    assert qs.fmt_stat(a) == "2.0000 ± 1.0000" and qs.fmt_stat(one) == "5.0000 (1 seed)"
    assert qs.fmt_stat(qs.stat([1.0, 3.0]), of=3) == "2.0000 ± 1.4142 (n=2)"

    def dd(m, s, n=3):
        return {"mean": m, "spread": s, "n": n}

    # "match" within ±0.1: the whole interval must sit inside, or wholly beyond one side
    assert qs.judge_match(dd(0.02, 0.05), 0.1)[0] == "matches"
    assert qs.judge_match(dd(0.08, 0.05), 0.1)[0] == qs.NO_VERDICT  # 0.03 .. 0.13 straddles 0.1
    assert qs.judge_match(dd(0.2, 0.05), 0.1)[0] == "falls short"
    assert qs.judge_match(dd(-0.2, 0.05), 0.1)[0] == "beats"
    assert qs.judge_match(dd(0.2, 0.0, n=1), 0.1)[0] == qs.NO_VERDICT
    # a cost bounded by 0.01: below zero beyond the spread beats it
    assert qs.judge_bound(dd(-0.05, 0.02), 0.01)[0] == "beats"
    assert qs.judge_bound(dd(0.004, 0.005), 0.01)[0] == "matches"
    assert qs.judge_bound(dd(0.02, 0.005), 0.01)[0] == "falls short"
    assert qs.judge_bound(dd(0.012, 0.005), 0.01)[0] == qs.NO_VERDICT


def _write_run(out: Path, run, status: str, bpb_end: float, seconds: float, eval_bpb: float | None = None):
    """32 evenly timed steps for 2^20 tokens; validation every 8 steps, falling linearly to bpb_end."""
    d = out / "runs" / run.id
    d.mkdir(parents=True)
    n = run.steps
    rows = []
    for s in range(1, n + 1):
        row = {"step": s, "tokens": s * run.tokens_per_batch, "time_s": seconds * s / n, "loss": 3.0}
        if s % max(1, n // 4) == 0 or s == n:
            row["val_bpb"] = bpb_end + (n - s) / n
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    L = run.context_len
    e = eval_bpb or bpb_end
    rec = {"status": status, "n_params": 25_000_000,
           "train": {"steps": n, "tokens": run.tokens, "elapsed_s": seconds, "val": {"val_bpb": bpb_end}},
           "eval": {"results": [{"context_len": L, "bits_per_byte": e},
                                {"context_len": 2 * L, "bits_per_byte": e + 0.1},
                                {"context_len": 4 * L, "bits_per_byte": None, "skipped": "longer than the table"}]}}
    (d / "result.json").write_text(json.dumps(rec))


def _study(out: Path, plan, date: str, devices: list[str], sha: str = "abc", tokens: int = 1 << 20,
           tables=("main",)):
    env = {"date_utc": date, "devices": devices, "slots": [str(i) for i in range(len(devices))], "torch": "2.11",
           "cuda": "13.0", "triton": "3.6", "python": "3.12", "git_commit": "abc", "mode": "full",
           "tokens_per_run": tokens, "corpus": {"content_sha256": sha}, "host_cpus": 16, "seeds": [0, 1, 2],
           "tables": list(tables)}
    (out / "runs").mkdir(parents=True)
    (out / "study.json").write_text(json.dumps({"environment": env, "plan": [dict(r.__dict__, steps=r.steps) for r in plan]}))


def test_report_aggregates_seeds_and_gives_verdicts_only_beyond_the_spread(tmp_path):
    plan = qp.build_plan("full", tokens=1 << 20)
    by_id = {r.id: r for r in plan}
    out = tmp_path / "out"
    _study(out, plan, "2026-11-27 03:00:00", ["NVIDIA H100"] * 3)
    for s, (tpp, fl, fq) in enumerate([(1.60, 1.50, 1.59), (1.62, 1.52, 1.61), (1.58, 1.48, 1.60)]):
        _write_run(out, by_id[f"transformer-pp-1024-s{s}"], "ok", tpp, 100.0)
        _write_run(out, by_id[f"flash-1024-s{s}"], "ok", fl, 50.0)
        _write_run(out, by_id[f"flash-quad-1024-s{s}"], "ok", fq, 80.0)
    _write_run(out, by_id["gla-1024-s0"], "ok", 1.70, 60.0)
    _write_run(out, by_id["gla-1024-s1"], "ok", 1.80, 60.0)
    _write_run(out, by_id["gla-1024-s2"], "failed", 9.0, 1.0)
    doc = tmp_path / "results.md"
    doc.write_text("# old\n\n## Notes on the 2026-11-22 runs (by hand)\n\n* about another study\n")
    assert qr.main(["--results", str(out), "--doc", str(doc)]) == 0
    data = json.loads((tmp_path / "results" / "quality.json").read_text())
    main = data["tables"]["main"]
    assert main["flash"]["bpb"]["mean"] == pytest.approx(1.50) and main["flash"]["bpb"]["spread"] == pytest.approx(0.02)
    assert main["gla"]["status"] == "2/3 ok (1 failed)" and main["gla"]["bpb"]["n"] == 2
    assert main["vq"]["status"] == "0/3 ok (3 missing)"  # planned, never written
    # speed-up per FLASH seed: its curve (12.5 s steps of 0.25 bits/byte) crosses Transformer++'s mean
    # final 1.60 at 45 / 46 / 44 s; Transformer++'s mean time is 100 s
    sp = [100 / 45, 100 / 46, 100 / 44]
    assert main["flash"]["speedup_time"]["mean"] == pytest.approx(statistics.fmean(sp))
    assert main["flash"]["speedup_time"]["spread"] == pytest.approx(statistics.stdev(sp))
    # equal wall time at 25 s (0.25 x 100 s): FLASH is 0.5 above its end there, Transformer++ 0.75
    eq = data["tables"]["equal_time"]["rows"]
    assert eq["flash"]["0.25"]["mean"] == pytest.approx(2.0) and eq["transformer-pp"]["0.25"]["mean"] == pytest.approx(2.35)
    assert eq["flash"]["1.0"]["ended"] == 3 and eq["flash"]["0.5"]["ended"] == 0  # it ended at 50 s
    # FLASH - Transformer++ = -0.10 ± 0.04, beyond the 1 % band: beats; FLASH - FLASH-Quad = -0.10 ± 0.03
    verdict = {v["claim"]: v["verdict"] for v in data["verdicts"]}
    assert verdict["FLASH matches Transformer++'s quality (context 1024)"] == "beats"
    assert verdict["FLASH-Quad -> FLASH costs little quality (Table 5; context 1024)"] == "beats"
    # reached before Transformer++'s time beyond the spread, but not by T / 4.9 (20.4 s: ~0.59 above its end)
    assert verdict["FLASH reaches Transformer++'s final quality 1.0-4.9x faster in training time "
                   "(Table 3; context 1024)"] == "matches"
    assert len(verdict) == 3  # only the main context is in this study: no claim at other contexts
    gap = data["tables"]["gap"]["1024"]
    assert gap["gap_bpb"]["mean"] == pytest.approx(-0.10) and gap["gap_bpb"]["spread"] == pytest.approx(0.03)
    assert gap["per_token_pct"] == pytest.approx(100 * ((2 ** -0.10) ** 4 - 1))  # 4 bytes per token
    text = doc.read_text()
    assert "1.5000 ± 0.0200" in text and "2/3" in text and "**[2/3 ok (1 failed)]**" in text
    gla_row = next(line for line in text.splitlines() if line.startswith("| GLA"))
    assert "+0.1500 ± 0.0907 (beyond the spread)" in gla_row
    assert "Not in this study" in text and "about another study" not in text  # the old study's notes dropped
    assert sorted(data["plots"]) == sorted(["bpb_vs_steps_1024.png", "bpb_vs_time_1024.png", "equal_time_1024.png",
                                            "extrapolation.png"])


def test_a_difference_within_the_spread_gets_no_verdict(tmp_path):
    plan = qp.build_plan("full", tokens=1 << 20)
    by_id = {r.id: r for r in plan}
    out = tmp_path / "out"
    _study(out, plan, "2026-11-27 03:00:00", ["NVIDIA H100"])
    for s, (tpp, fl) in enumerate([(1.60, 1.58), (1.70, 1.66), (1.50, 1.62)]):
        _write_run(out, by_id[f"transformer-pp-1024-s{s}"], "ok", tpp, 100.0)
        _write_run(out, by_id[f"flash-1024-s{s}"], "ok", fl, 100.0)
    doc = tmp_path / "results.md"
    assert qr.main(["--results", str(out), "--doc", str(doc)]) == 0
    data = json.loads((tmp_path / "results" / "quality.json").read_text())
    verdict = {v["claim"]: v["verdict"] for v in data["verdicts"]}
    # FLASH 1.62 ± 0.04, Transformer++ 1.60 ± 0.10: d = +0.02 inside a spread of 0.14
    assert verdict["FLASH matches Transformer++'s quality (context 1024)"] == qs.NO_VERDICT
    assert "(within the spread)" in doc.read_text()


def test_pending_page_lists_the_plan_and_says_nothing_was_measured(tmp_path):
    doc = tmp_path / "results.md"
    assert qr.main(["--pending", "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert "not yet run on a GPU" in text and "GPU-seconds" in text
    for r in qp.build_plan("full"):
        assert f"`{r.id}`" in text


def test_plan_entries_from_before_seeds_are_their_own_configuration():
    assert qs.group_of({"id": "flash-1024", "seed": 0}) == ("flash-1024", 0)
    assert qs.group_of({"id": "flash-1024-s2", "group": "flash-1024", "seed": 2}) == ("flash-1024", 2)


def test_merge_adds_a_second_session_and_the_report_labels_every_run(tmp_path):
    """A later call's runs (a failed seed again, another configuration) are merged into the first
    folder: the failed record is replaced, the header lists both sessions, each run carries its
    session, and only rows whose timings mix sessions are marked."""
    import quality_merge as qm

    plan = qp.build_plan("full", tokens=1 << 20, tables=qp.TABLES)
    by_id = {r.id: r for r in plan}
    a, b = tmp_path / "a", tmp_path / "b"
    first = [f"{g}-s{s}" for g in ("transformer-pp-1024", "flash-1024", "transformer-pp-2048") for s in (0, 1)]
    _study(a, [by_id[i] for i in first + ["performer-1024-s0"]], "2026-11-27 03:20:40",
           ["NVIDIA H200", "NVIDIA H200"], tables=qp.TABLES)
    for i in first:
        _write_run(a, by_id[i], "ok", 1.60 if "transformer" in i else 1.55, 100.0 if "transformer" in i else 50.0)
    _write_run(a, by_id["performer-1024-s0"], "failed", 9.0, 1.0)
    _study(b, [by_id[i] for i in ("performer-1024-s0", "gla-2048-s0", "gla-2048-s1")], "2026-11-27 04:51:56",
           ["NVIDIA H200"], tables=qp.TABLES)
    _write_run(b, by_id["performer-1024-s0"], "ok", 1.90, 200.0)
    _write_run(b, by_id["gla-2048-s0"], "ok", 1.65, 40.0)
    _write_run(b, by_id["gla-2048-s1"], "ok", 1.66, 40.0)
    (b / "logs").mkdir()
    (b / "logs" / "gla-2048-s0.log").write_text("log\n")
    (b / "gpu.txt").write_text("index, name, driver_version, memory.total [MiB]\n0, NVIDIA H200, 580.159.04, 143771 MiB\n")
    # a third folder with another corpus is refused, and nothing is written
    c = tmp_path / "c"
    _study(c, [by_id["gla-512-s0"]], "2026-11-28 00:00:00", ["NVIDIA H200"], sha="other")
    _write_run(c, by_id["gla-512-s0"], "ok", 1.6, 10.0)
    before = (a / "study.json").read_text()
    assert qm.main(["--into", str(a), "--add", str(c)]) == 2
    assert (a / "study.json").read_text() == before and not (a / "runs" / "gla-512-s0").exists()

    assert qm.main(["--into", str(a), "--add", str(b), "--note", "the rest"]) == 0
    assert json.loads((a / "runs" / "performer-1024-s0" / "result.json").read_text())["status"] == "ok"
    assert (a / "sessions" / "2026-11-27_045156" / "logs" / "gla-2048-s0.log").exists()
    assert qm.main(["--into", str(a), "--add", str(b), "--runs", "gla-2048-s0"]) == 2  # ok already: needs --replace
    study = json.loads((a / "study.json").read_text())
    assert [p["id"] for p in study["plan"]] == [r.id for r in plan if r.id in set(first) | {
        "performer-1024-s0", "gla-2048-s0", "gla-2048-s1"}]  # the full plan's order
    sess = qr.sessions(study)
    assert [s["label"] for s in sess] == ["A", "B"]
    assert sess[0]["superseded"] == [{"run": "performer-1024-s0", "status": "failed", "by": "B"}]
    assert sess[1]["environment"]["driver"] == "580.159.04"

    doc = tmp_path / "results.md"
    assert qr.main(["--results", str(a), "--doc", str(doc)]) == 0
    data = json.loads((tmp_path / "results" / "quality.json").read_text())
    assert data["runs"]["performer-1024-s0"]["session"] == "B" and data["runs"]["flash-1024-s0"]["session"] == "A"
    text = doc.read_text()
    assert "**Session A** (6 runs on this page; `performer-1024-s0` (failed here) ran again in session B)" in text
    assert "**Session B** (3 runs on this page)" in text and "driver 580.159.04" in text and "the rest" in text
    main = text[text.index("## Main table"):text.index("## Equal wall time")]
    row = {line.split("|")[1].strip(): line for line in main.splitlines() if line.startswith("| ")}
    assert "†" in row["Performer"] and "†" not in row["FLASH"]  # B against A's Transformer++ / A against A
    assert "| `performer-1024-s0` | 0 |" in text and "| B | ok |" in text
    lines = text.splitlines()
    head = lines.index("| model | 512: time (s) | 1024: time (s) | 2048: time (s) | 8192: time (s) |")
    gla = next(line for line in lines[head:] if line.startswith("| GLA |")).split("|")
    assert gla[4].strip() == "40.0 ± 0.0 (n=2) †"  # 2048: two of three seeds, 40 s (session B), against A's Transformer++


def test_only_selects_runs_by_id_or_by_configuration():
    import quality_run as qrun

    plan = qp.build_plan("full")
    assert [r.id for r in qrun.select(plan, ["flash-1024"])] == [r.id for r in plan if r.group == "flash-1024"]
    assert [r.id for r in qrun.select(plan, ["gla-1024-s2", "vq-1024-s0"])] == [
        r.id for r in plan if r.id in ("gla-1024-s2", "vq-1024-s0")]  # plan order
    with pytest.raises(SystemExit, match="unknown"):
        qrun.select(plan, ["flash-4096"])
