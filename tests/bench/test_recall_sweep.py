"""benchmarks/recall_sweep.py end to end at --tiny size on the CPU: every registered family has
its row, the JSON, the table and the plot are written, and the best-rate rule picks the best."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import recall_sweep as rs  # noqa: E402


def test_tiny_sweep_covers_every_family(tmp_path, capsys):
    assert rs.main(["--tiny", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "recall_sweep.json").read_text())
    families = set(rs.family_presets())
    assert {r["family"] for r in data["best"]} == families and len(families) >= 9
    assert len(data["runs"]) == len(families) * 2  # two widths, one point, one rate
    failed = [r for r in data["runs"] if "error" in r]
    assert not failed, failed
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["steps"] == 1 for r in data["runs"])
    soft = [r for r in data["runs"] if r["family"] == "softmax"]
    assert all(r["n_heads"] == 1 and r["position"] == "none" for r in soft)
    table = (tmp_path / "recall_sweep.md").read_text()
    assert table.count("| 16 / 2 |") == len(families)
    assert (tmp_path / "recall_sweep.png").stat().st_size > 1000
    assert not (tmp_path / "runs").exists()  # run folders are temporary unless --keep-runs


def test_best_rate_per_point():
    runs = [
        {"family": "gla", "preset": "gla-tiny", "d_model": 64, "seq_len": 64, "kv_pairs": 4, "lr": 1e-3, "accuracy": 0.4},
        {"family": "gla", "preset": "gla-tiny", "d_model": 64, "seq_len": 64, "kv_pairs": 4, "lr": 1e-2, "accuracy": 0.7},
        {"family": "gla", "preset": "gla-tiny", "d_model": 64, "seq_len": 64, "kv_pairs": 4, "lr": 1e-1, "error": "x"},
        {"family": "vq", "preset": "vq-tiny", "d_model": 64, "seq_len": 64, "kv_pairs": 4, "lr": 1e-3, "error": "boom"},
    ]
    best = {r["family"]: r for r in rs.best_by_point(runs)}
    assert best["gla"]["accuracy"] == 0.7 and best["gla"]["lr"] == 1e-2
    assert best["vq"]["accuracy"] is None and best["vq"]["error"] == "boom"
    assert "| vq | 64 / 4 | failed |" in rs.table(list(best.values()))
