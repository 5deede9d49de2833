"""``lintime bench model`` decoding rows per path (``lintime.bench.decode``): ``--decode-path``
resolution, one row per (L, path) with the shared prefill, the graph and HF static-compiled rows
skipped on the CPU with their reason, a failing path skipping only its own longer contexts, batch > 1;
on CUDA (marked) the graph and static-compiled rows are measured."""

from __future__ import annotations

import pytest
import torch

from lintime.bench import model as bm
from lintime.bench import report
from lintime.bench.decode import decode_paths
from lintime.cli import main

LINEAR, HF = "gla-tiny", "hf:llama-tiny"


def _settings(**kw) -> bm.Settings:
    base = {"presets": LINEAR, "contexts": "16", "decode_contexts": "8,24", "decode_steps": 2, "prefill_chunk": 8,
            "dtype": "fp32", "device": "cpu", "parts": "decode"}
    base.update(kw)
    return bm.make_settings(**base)


def test_decode_path_flag():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert decode_paths("auto", cpu) == ("eager",) and decode_paths("auto", cuda) == ("eager", "graph")
    assert decode_paths("both", cpu) == ("eager", "graph") and decode_paths("graph", cpu) == ("graph",)
    assert _settings().decode_paths == ("eager",)
    with pytest.raises(ValueError, match="--decode-path must be one of"):
        _settings(decode_path="fast")


def test_rows_per_batch_and_path_share_the_prefill_and_graph_is_skipped_on_cpu():
    rows = bm.bench_decode(_settings(decode_path="both", decode_batch="1,3"))
    assert [(r.L, r.batch, r.path) for r in rows] == [
        (L, B, p) for L in (8, 24) for B in (1, 3) for p in ("eager", "graph")]
    by = {(r.L, r.batch, r.path): r for r in rows}
    for L in (8, 24):
        one, three = by[L, 1, "eager"], by[L, 3, "eager"]
        for r in (one, three):
            assert r.status == "ok" and r.steps == 2 and r.token_ms > 0 and r.path == "eager"
        # a fresh L-token prompt per context (its prefill timed); batch 3 decodes its state replicated
        assert one.prefill_tokens == L and one.prefill_tokens_per_s == pytest.approx(L / one.prefill_s)
        assert three.prefill_s is None and "replicated" in three.note and three.state_mib == one.state_mib
        assert three.tokens_per_s == pytest.approx(3e3 / three.token_ms)
        for B in (1, 3):
            assert by[L, B, "graph"].status == "skipped: CUDA graphs need a CUDA device (device cpu)"
    lines = report.decode_table([vars(r) for r in rows]).splitlines()
    assert lines[3].split()[1:5] == ["8", "1", "graph", "-"] and "skipped: CUDA graphs" in lines[3]


def test_a_state_that_cannot_fit_is_a_memory_skip_row_and_skips_longer_contexts(monkeypatch):
    from lintime.bench import decode as bd

    # pretend a CUDA device with 1 MiB free: gla-tiny's state fits at batch 1, not at batch 4096
    monkeypatch.setattr(bd, "free_bytes", lambda device: 2**20)
    rows = bm.bench_decode(_settings(decode_batch="1,4096", decode_contexts="8,24"))
    status = {(r.L, r.batch): r.status for r in rows}
    assert status[8, 1] == "ok" and status[24, 1] == "ok"
    assert status[8, 4096].startswith("skipped: memory: B=4096 at L=8 needs ~") and "GiB free" in status[8, 4096]
    assert status[24, 4096] == status[8, 4096]  # the longer context is skipped for the same reason
    # nothing fits: the decoding rows are skipped, the batch-1 row keeps its measured prefill
    monkeypatch.setattr(bd, "free_bytes", lambda device: 1)
    (row,) = bm.bench_decode(_settings(decode_contexts="8"))
    assert row.status.startswith("skipped: memory: B=1 at L=8") and row.token_ms is None
    assert row.prefill_tokens == 8 and row.prefill_tokens_per_s == pytest.approx(8 / row.prefill_s)


def test_hf_static_compiled_row_is_skipped_on_cpu():
    pytest.importorskip("transformers")
    rows = bm.bench_decode(_settings(presets=HF, decode_path="graph"))
    assert [(r.L, r.path, r.status) for r in rows] == [
        (L, "static-compiled", "skipped: HF compiles the static-cache forward on CUDA only (device cpu)")
        for L in (8, 24)]


def test_a_failing_path_skips_only_its_longer_contexts():
    def case(row, model, s, device, amp):
        if row.path == "graph" and row.L == 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        row.token_ms = 1.0

    rows = bm.bench_decode(_settings(decode_contexts="8,24,40", decode_path="both"), decode_case=case)
    status = {(r.L, r.path): r.status for r in rows}
    assert [status[L, "eager"] for L in (8, 24, 40)] == ["ok"] * 3
    assert [status[L, "graph"] for L in (8, 24, 40)] == ["OOM", "skipped: OOM at L=8", "skipped: OOM at L=8"]


def test_cli_decode_path(tmp_path, capsys):
    common = ["--presets", LINEAR, "--parts", "decode", "--decode-contexts", "8", "--decode-steps", "1",
              "--device", "cpu", "--no-plots", "--out", str(tmp_path)]
    assert main(["bench", "model", "--decode-path", "graph", *common]) == 0
    assert "skipped: CUDA graphs need a CUDA device" in capsys.readouterr().out
    assert main(["bench", "model", "--decode-path", "nope", *common]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_and_static_compiled_rows_are_measured():
    pytest.importorskip("transformers")
    rows = bm.bench_decode(_settings(presets=f"transformer-pp-tiny,{LINEAR},{HF}", device="cuda", dtype="bf16",
                                     decode_steps=4, decode_batch="1,2"))
    by = {(r.preset, r.L, r.batch, r.path): r for r in rows}
    for p in ("transformer-pp-tiny", LINEAR):
        for L in (8, 24):
            for B in (1, 2):
                g, e = by[p, L, B, "graph"], by[p, L, B, "eager"]
                assert g.status == "ok" and e.status == "ok", (p, L, B, g.status, e.status)
                assert g.token_ms > 0 and g.prefill_tokens_per_s == e.prefill_tokens_per_s
            assert by[p, L, 1, "eager"].prefill_tokens_per_s > 0
    for L in (8, 24):
        for B in (1, 2):
            r = by[HF, L, B, "static-compiled"]
            assert r.status == "ok" and r.token_ms > 0 and r.prefill_tokens == L, (L, B, r.status)
    # a static cache per context: longer for the longer prompt
    assert by[HF, 24, 1, "static-compiled"].state_mib > by[HF, 8, 1, "static-compiled"].state_mib
