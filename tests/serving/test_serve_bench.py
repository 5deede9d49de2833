"""benchmarks/serve_bench.py on the CPU: a real server per model, concurrent streaming clients, the latency and
throughput fields filled, every request finished, the engine's steps fewer than its tokens (requests shared
steps); the softmax anchor served the same way; the HF static-cache anchor alone (``--hf-anchor``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_presets import small_chunks

from lintime.data import ByteTokenizer
from lintime.models import CausalLM, get_preset
from lintime.training.checkpoint import save_checkpoint, write_run_config

REPO = Path(__file__).resolve().parents[2]


def _run(path: Path, preset: str) -> Path:
    tok = ByteTokenizer()
    cfg = small_chunks(get_preset(preset, vocab_size=tok.vocab_size))
    torch.manual_seed(0)
    write_run_config(path, model_config=cfg, objective="clm", tokenizer=tok, train={})
    save_checkpoint(path, 0, CausalLM(cfg), {})
    return path


def test_serve_bench_reports_every_model(tmp_path):
    models = [_run(tmp_path / "gla", "gla-tiny"), _run(tmp_path / "tpp", "transformer-pp-tiny")]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "LINTIME_API_KEY": ""}
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_bench.py"), "--out", str(tmp_path / "out"),
                          "--models", ",".join(map(str, models)), "--clients", "4", "--requests", "2",
                          "--prompt-tokens", "40", "--new-tokens", "8", "--start-s", "120", "--request-s", "60"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "serve_bench.json").read_text())["rows"]
    assert [r["served_as"] for r in rows] == ["gla", "tpp"]
    for r in rows:
        assert r["requests"] == 8 and r["failed"] == 0 and r["finish"]["length"] + r["finish"]["stop"] == 8
        assert r["pieces_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] is not None
        assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["engine"]["steps"] < r["engine"]["tokens_generated"]  # requests shared decoding steps


def test_serve_bench_hf_anchor_alone(tmp_path):
    """``--models '' --hf-anchor tiny``: the HF static-cache anchor's rows (benchmarks/hf_generate_bench.py in its own
    process, on the same load: batch = clients, rounds = requests) join serve_bench.json with the serve rows' keys."""
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serve_bench.py"), "--out", str(tmp_path),
                          "--models", "", "--hf-anchor", "tiny", "--clients", "2", "--requests", "2",
                          "--prompt-tokens", "12", "--new-tokens", "3",
                          "--hf-flags", "--dtype fp32 --device cpu --modes static,static+compile"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads((tmp_path / "serve_bench.json").read_text())["rows"]
    assert [(r["served_as"], r["status"].split(":")[0]) for r in rows] == [
        ("hf generate static", "ok"), ("hf generate static+compile", "skipped")]
    r = rows[0]
    assert r["model"] == "hf:llama-tiny" and r["clients"] == 2 and r["requests"] == 4 and r["failed"] == 0
    assert r["output_tokens"] == 2 * 3 * 2 and r["finish"]["length"] == 4 and r["prompt_tokens"] == 12
    assert r["tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 and r["itl_ms"]["p50"] is not None
    assert "hf generate static" in res.stdout.split("\nmodel")[-1]  # in the table
