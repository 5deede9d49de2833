"""``lintime bench model`` on CPU at tiny sizes: JSON structure, values that make sense (positive,
ordered percentiles, tokens/s consistent with the step time, a KV cache that grows with the
context and a linear-time state that does not), the OOM / error / budget paths (a case raising
``torch.cuda.OutOfMemoryError`` gives an "OOM" row and the run goes on), tables, plots, the
command line and merging JSON files."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from lintime.bench import model as bm
from lintime.bench import report
from lintime.bench.measure import quantiles
from lintime.cli import main

SOFTMAX, LINEAR = "transformer-pp-tiny", "gla-tiny"


def _settings(**kw) -> bm.Settings:
    base = {"presets": f"{SOFTMAX},{LINEAR}", "contexts": "16,32", "decode_contexts": "8,24", "tokens_per_batch": 32,
            "steps": 2, "warmup": 1, "decode_steps": 2, "prefill_chunk": 8, "dtype": "fp32", "device": "cpu"}
    base.update(kw)
    return bm.make_settings(**base)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_model")
    lines: list[str] = []
    s = _settings(presets=f"{SOFTMAX},no-such-base,{LINEAR}")
    result = bm.run_model(s, str(out), echo=lines.append)
    return result, out, "\n".join(lines)


def test_json_structure_and_environment(run):
    result, out, _ = run
    with open(out / "bench_model.json") as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(result))
    env = saved["env"]
    for key in ("device", "torch", "triton", "python", "date", "git_commit"):
        assert key in env
    assert env["device"].startswith("cpu") and env["torch"] == torch.__version__
    assert saved["settings"]["contexts"] == [16, 32] and saved["settings"]["dtype"] == "fp32"
    assert [(r["preset"], r["T"]) for r in saved["train"]] == [
        (p, T) for p in (SOFTMAX, "no-such-base", LINEAR) for T in (16, 32)]
    assert [(r["preset"], r["L"]) for r in saved["decode"]] == [
        (p, L) for p in (SOFTMAX, "no-such-base", LINEAR) for L in (8, 24)]
    assert set(saved["train"][0]) == {f.name for f in dataclasses.fields(bm.TrainRow)}
    assert set(saved["decode"][0]) == {f.name for f in dataclasses.fields(bm.DecodeRow)}


def test_missing_preset_is_a_skip_row_with_its_reason(run):
    result, _, _ = run
    for part in ("train", "decode"):
        rows = [r for r in result[part] if r["preset"] == "no-such-base"]
        assert len(rows) == 2
        for r in rows:
            assert r["status"].startswith("skipped: unknown preset 'no-such-base'")
            assert r["family"] is None


def test_training_rows_are_measured_and_consistent(run):
    result, _, _ = run
    rows = [r for r in result["train"] if r["preset"] != "no-such-base"]
    assert rows and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["rows"] == 32 // r["T"] and r["tokens"] == 32
        assert r["steps"] == 2
        assert 0 < r["step_p10_ms"] <= r["step_ms"] <= r["step_p90_ms"]
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_ms"] * 1e3)
        assert r["params"] > 0 and r["family"] in ("softmax", "gla")
        assert r["peak_mib"] is None  # CPU: not measured


def test_decoding_state_grows_for_softmax_and_not_for_gla(run):
    result, _, _ = run
    by = {(r["preset"], r["L"]): r for r in result["decode"]}
    for p in (SOFTMAX, LINEAR):
        for L in (8, 24):
            r = by[p, L]
            assert r["status"] == "ok" and r["steps"] == 2 and r["batch"] == 1
            assert 0 < r["token_p10_ms"] <= r["token_ms"] <= r["token_p90_ms"]
            assert r["tokens_per_s"] == pytest.approx(1e3 / r["token_ms"])
            assert r["state_mib"] > 0 and r["prefill_s"] > 0
    assert by[SOFTMAX, 24]["state_mib"] > by[SOFTMAX, 8]["state_mib"]  # KV cache
    assert by[LINEAR, 24]["state_mib"] == by[LINEAR, 8]["state_mib"]  # constant state


def test_tables_and_plots(run):
    result, out, text = run
    assert "training step" in text and "decoding, per token" in text
    table = report.train_table(result["train"])
    assert len(table.splitlines()) == 2 + len(result["train"])
    assert "skipped: unknown preset" in table and f"{SOFTMAX:<20}" in table
    assert len(report.decode_table(result["decode"]).splitlines()) == 2 + len(result["decode"])
    for name in ("bench_model_train.png", "bench_model_decode.png"):
        path = out / name
        assert path.is_file() and path.stat().st_size > 1000
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _raising(err_at: dict):
    """A train_case that raises ``err_at[T]`` (an exception instance) and measures the rest."""

    def case(row, cfg, s, device, amp):
        if row.T in err_at:
            raise err_at[row.T]
        return bm._train_case(row, cfg, s, device, amp)

    return case


def test_oom_row_then_longer_contexts_skipped_and_the_run_goes_on():
    s = _settings(contexts="8,16,32", parts="train")
    seen = []
    rows = bm.bench_train(s, seen.append, train_case=_raising({16: torch.cuda.OutOfMemoryError("CUDA out of memory")}))
    assert seen == rows
    status = {(r.preset, r.T): r.status for r in rows}
    for p in (SOFTMAX, LINEAR):
        assert status[p, 8] == "ok"
        assert status[p, 16] == "OOM"
        assert status[p, 32] == "skipped: OOM at T=16"
    oom = next(r for r in rows if r.status == "OOM")
    assert oom.step_ms is None and oom.tokens_per_s is None


def test_runtime_error_out_of_memory_counts_as_oom_other_errors_do_not_stop_the_preset():
    s = _settings(presets=SOFTMAX, contexts="8,16,32", parts="train")
    rows = bm.bench_train(s, train_case=_raising({8: RuntimeError("boom\nsecond line"),
                                                 32: RuntimeError("CUDA error: out of memory")}))
    assert [r.status for r in rows] == ["error: RuntimeError: boom second line", "ok", "OOM"]


def test_decode_oom_row_then_skips():
    calls = []

    def case(row, model, s, device, amp):
        calls.append(row.L)
        if row.L == 24:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        row.token_ms = 1.0

    s = _settings(presets=SOFTMAX, decode_contexts="8,24,40", parts="decode")
    rows = bm.bench_decode(s, decode_case=case)
    assert calls == [8, 24]
    assert [r.status for r in rows] == ["ok", "OOM", "skipped: OOM at L=24"]
    assert rows[1].token_ms is None


def test_case_budget_cuts_the_timed_steps_and_skips_longer_contexts():
    s = _settings(presets=SOFTMAX, contexts="8,16", steps=3, case_budget_s=1e-6, parts="train")
    rows = bm.bench_train(s)
    assert rows[0].status == "ok" and rows[0].steps == 1 and "1/3 steps" in rows[0].note
    assert rows[1].status.startswith("skipped: median step at T=8 took") and rows[1].step_ms is None


def test_budget_judges_the_median_timed_step_not_the_warmup():
    """The H200 run lost flash-base beyond 1k: a first step of 9 s (Triton compiling and
    autotuning) against a 6 s budget, while the timed steps took 0.26 s.  A case whose warm-up
    is slow but whose timed steps fit must not skip the longer contexts; one whose median timed
    step is over the budget must."""
    s = _settings(presets=SOFTMAX, contexts="8,16,32", parts="train", case_budget_s=6.0)

    def case(median_s, warm_s):
        def fill(row, cfg, s, device, amp):
            row.step_ms = row.step_p10_ms = row.step_p90_ms = median_s * 1e3
            row.steps = s.steps
            return warm_s  # what the old rule judged

        return fill

    rows = bm.bench_train(s, train_case=case(0.26, 9.0))
    assert [r.status for r in rows] == ["ok"] * 3
    rows = bm.bench_train(s, train_case=case(7.0, 7.0))
    assert [r.status for r in rows] == ["ok"] + ["skipped: median step at T=8 took 7.0 s > budget 6 s"] * 2


def test_warmup_runs_past_a_slow_compiling_first_step(monkeypatch):
    """_train_case: a first warm-up step longer than the budget (compilation) does not cut the
    warm-up short -- the second warm-up step still runs -- and the row is measured."""
    clock = {"t": 0.0}
    calls = []

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock["t"]

    def fake_step_fn(model, batch, amp):
        def step():
            calls.append(len(calls))
            clock["t"] += 100.0 if len(calls) == 1 else 0.01  # the first call "compiles" for 100 s
            return 1.0

        return step, None

    monkeypatch.setattr(bm, "time", FakeTime)
    monkeypatch.setattr(bm, "train_step_fn", fake_step_fn)
    s = _settings(presets=SOFTMAX, contexts="8,16", steps=2, warmup=3, parts="train", case_budget_s=6.0)
    rows = bm.bench_train(s)
    assert [r.status for r in rows] == ["ok", "ok"]
    assert len(calls) == 2 * (3 + 2)  # every warm-up step and every timed step, at both contexts


def test_learned_position_table_is_extended_and_said_so():
    cfg, note = bm.preset_config("linear-tiny", 5000)
    assert cfg.max_positions == 5000 and note == "position table 1024 -> 5000"
    cfg, note = bm.preset_config("linear-tiny", 100)
    assert cfg.max_positions == 1024 and note == ""
    with pytest.raises(ValueError, match="unknown preset"):
        bm.preset_config("nope", 10)


def test_parse_sizes_and_quantiles():
    assert bm.parse_sizes("4k, 1k,512,1k", "contexts") == (512, 1024, 4096)
    assert bm.parse_sizes("1m", "contexts") == (1 << 20,)
    for bad in ("4q", "0", ",", "k"):
        with pytest.raises(ValueError, match="--contexts"):
            bm.parse_sizes(bad, "contexts")
    q = quantiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert q == pytest.approx({"median": 3.0, "p10": 1.4, "p90": 4.6})
    assert quantiles([7.0]) == {"median": 7.0, "p10": 7.0, "p90": 7.0}


def test_default_and_quick_settings():
    s = bm.make_settings(device="cpu")
    assert s.contexts == (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072) and s.decode_contexts == s.contexts
    assert s.tokens_per_batch == 32768 and s.dtype == "fp32"
    # every family at base size on the default path, and the honest anchors: our fastest softmax path, HF eager and
    # compiled, fla, and the eager step a user gets with graphs off
    from lintime.models import get_preset
    from lintime.models.presets import all_presets

    families = {get_preset(p).family for p in s.presets if ":" not in p and "@" not in p}
    assert families >= {c.family for n, c in all_presets().items() if n.endswith("-base")}
    assert {"hf:llama-base", "hf:llama-base+compile", "fla:gla-base", "transformer-pp-base@graph",
            "flash-base@eager", "flash-medium", "transformer-pp-medium"} <= set(s.presets)
    q = bm.make_settings(device="cpu", quick=True)
    assert all(p.partition("@")[0].removesuffix("+compile").endswith("-tiny") for p in q.presets)
    assert bm.make_settings(device="cpu", dtype="bf16").dtype == "bf16"


def test_cli_runs_merges_and_reports_user_errors(tmp_path, capsys):
    a, b, m = (str(tmp_path / x) for x in "abm")
    common = ["--contexts", "16", "--decode-contexts", "8", "--tokens-per-batch", "16", "--steps", "1",
              "--warmup", "1", "--decode-steps", "1", "--device", "cpu"]
    assert main(["bench", "model", "--presets", SOFTMAX, "--out", a, *common]) == 0
    assert main(["bench", "model", "--presets", LINEAR, "--out", b, "--parts", "train", "--no-plots", *common]) == 0
    assert sorted(os.listdir(b)) == ["bench_model.json"]
    out = capsys.readouterr().out
    assert f"{SOFTMAX:<20}" in out and "wrote" in out
    assert main(["bench", "model", "--from-json", f"{a},{b}", "--out", m]) == 0
    with open(os.path.join(m, "bench_model.json")) as f:
        merged = json.load(f)
    assert [r["preset"] for r in merged["train"]] == [SOFTMAX, LINEAR]
    assert [r["preset"] for r in merged["decode"]] == [SOFTMAX]
    assert os.path.getsize(os.path.join(m, "bench_model_train.png")) > 1000
    capsys.readouterr()
    for argv, msg in (
        (["bench", "model", "--contexts", "4q"], "--contexts: '4q' is not a size"),
        (["bench", "model", "--dtype", "int8", "--device", "cpu"], "--dtype must be one of"),
        (["bench", "model", "--parts", "eval"], "--parts must name train and/or decode"),
        (["bench", "ops", "--presets", SOFTMAX], "--presets applies to `lintime bench model`"),
        (["bench", "ops", "--no-plots"], "--no-plots applies to `lintime bench model`"),
        (["bench", "model", "--cases", "linear_gla"], "--cases applies to `lintime bench ops`"),
        (["bench", "model", "--from-json", str(tmp_path / "none")], "no bench_model.json"),
        (["bench", "weights"], "unknown bench target 'weights'"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, (argv, err)


def test_device_error_at_cleanup_is_a_row_not_a_crash(monkeypatch):
    """On the H200 a CUDA illegal memory access surfaced in the synchronize after the case (the
    performer-base training process died and wrote no row): the row must say so and the longer
    contexts are skipped."""
    real = bm.free_memory
    fail = {"n": 1}

    def flaky(device):
        if fail["n"]:
            fail["n"] -= 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real(device)

    monkeypatch.setattr(bm, "free_memory", flaky)
    s = _settings(presets=SOFTMAX, contexts="8,16", parts="train")
    rows = bm.bench_train(s)
    assert rows[0].status == "error: RuntimeError: CUDA error: an illegal memory access was encountered"
    assert rows[0].step_ms is None and rows[1].status == "skipped: device error at T=8"


def test_tables_keep_their_columns_when_values_are_missing():
    """An OOM / skipped row has no times: its ``-`` cells must fill their columns, so every later
    column (peak memory, status) starts where the header's does."""
    ok = {"preset": "p", "T": 1024, "rows": 32, "step_ms": 253.0, "step_p10_ms": 245.3, "step_p90_ms": 253.2,
          "tokens_per_s": 129523.0, "peak_mib": 43648.0, "status": "ok", "note": ""}
    oom = dict(ok, T=131072, rows=1, step_ms=None, step_p10_ms=None, step_p90_ms=None, tokens_per_s=None,
               peak_mib=135517.0, status="OOM")
    skipped = dict(oom, peak_mib=None, status="skipped: OOM at T=128k")
    lines = report.train_table([ok, oom, skipped]).splitlines()
    col = lines[0].index("status")
    assert [ln.index(r["status"]) for ln, r in zip(lines[2:], (ok, oom, skipped))] == [col] * 3
    peak_end = lines[0].index("peak MiB") + len("peak MiB")
    assert lines[3][:peak_end].endswith("135,517") and lines[4][:peak_end].endswith("-")
    assert lines[3].split()[3:7] == ["-"] * 4  # step ms, p10, p90, tokens/s

    d_ok = {"preset": "p", "L": 1024, "batch": 1, "token_ms": 11.3, "token_p10_ms": 11.1, "token_p90_ms": 12.2,
            "tokens_per_s": 88.0, "state_mib": 3.375, "peak_mib": 740.0, "status": "ok", "note": ""}
    d_err = dict(d_ok, token_ms=None, token_p10_ms=None, token_p90_ms=None, tokens_per_s=None, state_mib=None,
                 peak_mib=691.0, status="error: RuntimeError: x")
    lines = report.decode_table([d_ok, d_err]).splitlines()
    col = lines[0].index("status")
    assert lines[2].index("ok") == col and lines[3].index("error:") == col
    state_end = lines[0].index("state MiB") + len("state MiB")
    assert lines[2][:state_end].endswith("3.375") and lines[3][:state_end].endswith("-")


def test_graph_step_rows_are_named_by_preset_and_skipped_where_they_cannot_run():
    """``<preset>@graph`` rows time lintime's captured step (``step == "graph"``); the train case sees the row's
    step; an anchor, an unknown step or a CPU device gives a skip row with its reason."""
    seen = []

    def case(row, cfg, s, device, amp):
        seen.append((row.preset, row.step, cfg.family))
        row.step_ms, row.tokens_per_s = 1.0, 1.0

    s = _settings(presets=f"{LINEAR},{LINEAR}@graph,hf:llama-tiny@graph,{LINEAR}@fast", contexts="16", parts="train")
    rows = bm.bench_train(s, train_case=case)
    status = {r.preset: (r.step, r.status) for r in rows}
    assert status[LINEAR] == ("eager", "ok")
    assert status[f"{LINEAR}@graph"][1] == "skipped: the captured step needs CUDA (device cpu)"
    assert "not an anchor's" in status["hf:llama-tiny@graph"][1]
    assert "unknown step 'fast'" in status[f"{LINEAR}@fast"][1]
    assert seen == [(LINEAR, "eager", "gla")]
    s_cuda = dataclasses.replace(s, presets=(f"{LINEAR}@graph",), device="meta")
    rows = bm.bench_train(s_cuda, train_case=case)
    assert "needs CUDA" in rows[0].status  # any device but CUDA


def test_default_rows_take_the_step_lintime_train_takes():
    """A plain preset row times what `lintime train` does by default there: on CUDA the captured packed-documents
    step for a model that plans packing on the device, eager steps otherwise (and always on the CPU)."""
    from lintime.models import get_preset

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert bm.default_step(get_preset("flash-tiny"), cuda) == "graph-documents"
    assert bm.default_step(get_preset("transformer-pp-tiny"), cuda) == "graph-documents"
    assert bm.default_step(get_preset("vq-tiny"), cuda) == "eager"
    assert bm.default_step(get_preset("flash-tiny"), cpu) == "eager"


def test_documents_batch_cuts_every_row():
    T, rows = 4 * bm.DOC_TOKENS, 3
    b = bm.random_batch(rows, T, 100, torch.device("cpu"), documents=True)
    cu = b.cu_seqlens.tolist()
    assert set(range(0, rows * T + 1, T)) <= set(cu)  # every row start is a boundary
    assert len(cu) - 1 > rows  # and rows hold several documents
    one = bm.random_batch(rows, T, 100, torch.device("cpu"))
    assert one.cu_seqlens.tolist() == list(range(0, rows * T + 1, T))


def test_compiled_hf_anchor_is_the_same_model_under_torch_compile():
    pytest.importorskip("transformers")
    from lintime.bench import anchors

    plain = anchors.anchor_spec("hf:llama-tiny", 64, torch.device("cpu"))
    compiled = anchors.anchor_spec("hf:llama-tiny+compile", 64, torch.device("cpu"))
    assert compiled.impl == plain.impl + " + torch.compile" and compiled.config["torch_compile"]
    model = compiled.build(torch.device("cpu"))
    assert hasattr(model, "_orig_mod") and type(model._orig_mod).__name__ == plain.model_class
